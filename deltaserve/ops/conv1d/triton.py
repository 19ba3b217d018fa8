"""Triton causal depthwise conv1d + SiLU over packed sequences with pooled windows (same signatures as
reference.py).

Prefill: one program per (chunk of BT tokens aligned to a sequence start, BD channels); taps before the
sequence start read the slot's window (or zero). The program of a sequence's first chunk -- the only one
that reads the old window -- also writes the new window (the sequence's last W-1 inputs, older window
rows shifted in for sequences shorter than W-1), after a CTA barrier, so no other program can see a
half-written window. Decode: one program per (sequence, BD channels). No host sync: graph capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..triton_common import (
    check, check_index, check_last_contiguous, check_same_device, given_chunk_offsets, locate_chunk, next_pow2, silu,
)

BT = 64


@triton.jit(do_not_specialize=["N"])
def _conv_fwd_kernel(x, s_x_t, w, y, conv_state, coff, cu, idx, has_init, N, D,
                     W: tl.constexpr, WP: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
                     BLOCK_N: tl.constexpr, SILU: tl.constexpr):
    p = tl.program_id(0)
    ch = tl.program_id(1) * BD + tl.arange(0, BD)
    cm = ch < D
    n, c, bos, eos = locate_chunk(coff, cu, N, p, BLOCK_N)
    valid = n < N
    slot = tl.load(idx + n, mask=valid, other=-1).to(tl.int64)
    live = valid & (slot >= 0)
    init = tl.load(has_init + n, mask=valid, other=0) != 0
    win = conv_state + slot * ((W - 1) * D)
    rows = tl.arange(0, BT)
    tok = bos + c * BT + rows
    rm = (tok < eos) & valid
    acc = tl.zeros([BT, BD], dtype=tl.float32)
    for i in tl.static_range(W):
        src = tok - (W - 1) + i
        in_x = src >= bos
        m = rm[:, None] & cm[None, :] & live
        xv = tl.load(x + src.to(tl.int64)[:, None] * s_x_t + ch[None, :], mask=m & in_x[:, None], other=0.0)
        hv = tl.load(win + (W - 1 + src - bos)[:, None] * D + ch[None, :], mask=m & (~in_x)[:, None] & init,
                     other=0.0)
        wi = tl.load(w + ch * W + i, mask=cm, other=0.0).to(tl.float32)
        acc += (xv.to(tl.float32) + hv.to(tl.float32)) * wi[None, :]
    if SILU:
        acc = silu(acc)
    tl.store(y + tok.to(tl.int64)[:, None] * D + ch[None, :], acc.to(y.dtype.element_ty),
             mask=rm[:, None] & cm[None, :])
    # new window = last W-1 rows of [old window (W-1), x_bos .. x_eos-1], written by the first chunk
    r = tl.arange(0, WP)
    L = eos - bos
    src = L + r
    wm = (r[:, None] < W - 1) & cm[None, :] & live & (c == 0) & (L > 0)
    from_x = tl.load(x + (bos + src - (W - 1)).to(tl.int64)[:, None] * s_x_t + ch[None, :],
                     mask=wm & (src >= W - 1)[:, None], other=0.0)
    from_w = tl.load(win + src[:, None] * D + ch[None, :], mask=wm & (src < W - 1)[:, None] & init, other=0.0)
    new = from_x.to(tl.float32) + from_w.to(tl.float32)
    tl.debug_barrier()
    tl.store(win + r[:, None] * D + ch[None, :], new.to(conv_state.dtype.element_ty), mask=wm)


@triton.jit
def _conv_update_kernel(x, s_x_t, w, y, conv_state, idx, D,
                        W: tl.constexpr, WP: tl.constexpr, BD: tl.constexpr, SILU: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    ch = tl.program_id(1) * BD + tl.arange(0, BD)
    cm = ch < D
    slot = tl.load(idx + n).to(tl.int64)
    live = slot >= 0
    win = conv_state + slot * ((W - 1) * D)
    r = tl.arange(0, WP)
    old = tl.load(win + r[:, None] * D + ch[None, :], mask=(r[:, None] < W - 1) & cm[None, :] & live, other=0.0)
    xt = tl.load(x + n * s_x_t + ch, mask=cm & live, other=0.0)
    wt = tl.load(w + ch[None, :] * W + r[:, None], mask=(r[:, None] < W - 1) & cm[None, :], other=0.0)
    acc = tl.sum(old.to(tl.float32) * wt.to(tl.float32), axis=0)
    acc += xt.to(tl.float32) * tl.load(w + ch * W + (W - 1), mask=cm, other=0.0).to(tl.float32)
    if SILU:
        acc = silu(acc)
    tl.store(y + n * D + ch, tl.where(live, acc, 0.0).to(y.dtype.element_ty), mask=cm)
    shifted = tl.load(win + (r[:, None] + 1) * D + ch[None, :], mask=(r[:, None] + 1 < W - 1) & cm[None, :] & live,
                      other=0.0)
    new = tl.where(r[:, None] == W - 2, xt[None, :].to(tl.float32), shifted.to(tl.float32))
    tl.debug_barrier()
    tl.store(win + r[:, None] * D + ch[None, :], new.to(conv_state.dtype.element_ty),
             mask=(r[:, None] < W - 1) & cm[None, :] & live)


def _activation(op: str, activation: str | None) -> bool:
    check(activation in (None, "silu", "swish"), op, f"unsupported activation {activation!r} (expected 'silu' or None)")
    return activation is not None


def _check(op, x, weight, conv_state):
    check(x.dim() == 2, op, f"x must be [T, D], got {tuple(x.shape)}")
    D = x.shape[1]
    check(weight.dim() == 2 and weight.shape[0] == D and weight.is_contiguous(), op,
          f"weight must be contiguous [{D}, W], got {tuple(weight.shape)}")
    W = weight.shape[1]
    check(2 <= W <= 8, op, f"conv width {W} outside 2..8")
    check(tuple(conv_state.shape[1:]) == (W - 1, D) and conv_state.is_contiguous(), op,
          f"conv_state must be contiguous [S, {W - 1}, {D}], got {tuple(conv_state.shape)}")
    check(x.dtype in (torch.bfloat16, torch.float16, torch.float32), op, f"unsupported dtype {x.dtype}")
    check_last_contiguous(op, x=x)
    return D, W


def causal_conv1d_fn(
    x: torch.Tensor, weight: torch.Tensor, *, conv_state: torch.Tensor, cu_seqlens: torch.Tensor,
    state_indices: torch.Tensor, has_initial_state: torch.Tensor, activation: str | None = "silu",
    chunk_offsets: torch.Tensor | None = None,
) -> torch.Tensor:
    """chunk_offsets: chunk_offsets(cu_seqlens, PREFILL_CHUNK) when the caller has it (once per step), else
    computed here."""
    op = "causal_conv1d_fn"
    D, W = _check(op, x, weight, conv_state)
    act = _activation(op, activation)
    N = state_indices.shape[0]
    check_index(op, "state_indices", state_indices, N)
    check_index(op, "cu_seqlens", cu_seqlens, N + 1)
    check(has_initial_state.shape == (N,), op, f"has_initial_state must be [{N}]")
    check_same_device(op, x, weight, conv_state, cu_seqlens, state_indices, has_initial_state)
    T = x.shape[0]
    y = torch.empty((T, D), dtype=x.dtype, device=x.device)
    if T == 0 or N == 0:
        return y
    has_init = has_initial_state if has_initial_state.dtype != torch.bool else has_initial_state.view(torch.uint8)
    BD = 128
    coff = given_chunk_offsets(op, chunk_offsets, cu_seqlens, BT)
    _conv_fwd_kernel[(triton.cdiv(T, BT) + N, triton.cdiv(D, BD))](
        x, x.stride(0), weight, y, conv_state, coff, cu_seqlens, state_indices, has_init, N, D,
        W=W, WP=next_pow2(W - 1), BT=BT, BD=BD, BLOCK_N=max(16, next_pow2(N)), SILU=act, num_warps=4)
    return y


def causal_conv1d_update(
    x: torch.Tensor, weight: torch.Tensor, *, conv_state: torch.Tensor, state_indices: torch.Tensor,
    activation: str | None = "silu",
) -> torch.Tensor:
    op = "causal_conv1d_update"
    D, W = _check(op, x, weight, conv_state)
    act = _activation(op, activation)
    N = x.shape[0]
    check_index(op, "state_indices", state_indices, N)
    check_same_device(op, x, weight, conv_state, state_indices)
    y = torch.empty((N, D), dtype=x.dtype, device=x.device)
    if N == 0:
        return y
    BD = 1024
    _conv_update_kernel[(N, triton.cdiv(D, BD))](
        x, x.stride(0), weight, y, conv_state, state_indices, D, W=W, WP=next_pow2(W - 1), BD=BD, SILU=act,
        num_warps=4)
    return y
