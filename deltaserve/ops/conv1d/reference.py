"""Causal depthwise conv1d + activation over packed sequences with pooled conv windows (plain PyTorch).

Layouts:
  x            [T, D]        pre-conv activations (the q|k|v channels of a GDN layer), T packed tokens
  weight       [D, W]        depthwise taps; weight[:, W-1] multiplies the current token
  conv_state   [S, W-1, D]   pool of conv windows: the last W-1 inputs of each live sequence, oldest first
  cu_seqlens   [N + 1]       token offsets; state_indices [N] slots (-1 = padded row, skipped)

y_t = act(sum_j weight[:, j] * x_{t-W+1+j}), with inputs before the sequence start taken from the
slot's window when has_initial_state, else zero. Arithmetic in fp32, y returned in x's dtype. The
window written back holds the sequence's last W-1 inputs (older window entries shifted in when the
sequence is shorter than W-1).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _activate(y: torch.Tensor, activation: str | None) -> torch.Tensor:
    if activation is None:
        return y
    if activation in ("silu", "swish"):
        return F.silu(y)
    raise ValueError(f"causal_conv1d: unsupported activation {activation!r} (expected 'silu' or None)")


def causal_conv1d_fn(
    x: torch.Tensor, weight: torch.Tensor, *, conv_state: torch.Tensor, cu_seqlens: torch.Tensor,
    state_indices: torch.Tensor, has_initial_state: torch.Tensor, activation: str | None = "silu",
    chunk_offsets: torch.Tensor | None = None,
) -> torch.Tensor:
    """Prefill: convolve each packed sequence, continuing from / writing back its pooled window. chunk_offsets:
    the Triton op's per-step chunk metadata (ops/chunks.py), not needed here."""
    W = weight.shape[1]
    out = torch.zeros_like(x)
    w = weight.float()
    bounds = cu_seqlens.tolist()
    has_init = has_initial_state.tolist()
    for n, slot in enumerate(state_indices.tolist()):
        s, e = bounds[n], bounds[n + 1]
        if slot < 0 or e == s:
            continue
        history = conv_state[slot].float() if has_init[n] else x.new_zeros((W - 1, x.shape[1]), dtype=torch.float32)
        seq = torch.cat([history, x[s:e].float()], dim=0)          # [W-1+L, D]
        windows = seq.unfold(0, W, 1)                              # [L, D, W]
        out[s:e] = _activate((windows * w).sum(-1), activation).to(x.dtype)
        conv_state[slot] = seq[-(W - 1):].to(conv_state.dtype)
    return out


def causal_conv1d_update(
    x: torch.Tensor, weight: torch.Tensor, *, conv_state: torch.Tensor, state_indices: torch.Tensor,
    activation: str | None = "silu",
) -> torch.Tensor:
    """Decode: one new input per sequence (x [N, D]); shifts it into the slot's window in place."""
    if min(state_indices.tolist(), default=0) < 0:  # padded rows: compute the live ones, zeros elsewhere
        out = torch.zeros_like(x)
        live = (state_indices >= 0).nonzero().flatten()
        if live.numel():
            out[live] = causal_conv1d_update(x[live], weight, conv_state=conv_state,
                                             state_indices=state_indices[live], activation=activation)
        return out
    return causal_conv1d_update_unpadded(x, weight, conv_state=conv_state, state_indices=state_indices,
                                         activation=activation)


def causal_conv1d_update_unpadded(
    x: torch.Tensor, weight: torch.Tensor, *, conv_state: torch.Tensor, state_indices: torch.Tensor,
    activation: str | None = "silu",
) -> torch.Tensor:
    """causal_conv1d_update for a batch without padded rows (every slot >= 0): no host read, so it can
    be traced into a compiled graph."""
    slots = state_indices.long()
    window = torch.cat([conv_state.index_select(0, slots), x.to(conv_state.dtype).unsqueeze(1)], dim=1)  # [N,W,D]
    conv_state.index_copy_(0, slots, window[:, 1:])
    y = (window.float() * weight.float().t()).sum(1)
    return _activate(y, activation).to(x.dtype)
