"""Dense projection y = x W^T (no bias), the pre-norm projection (RMSNorm folded in front of it; for a GDN
layer's decode step also with the conv of its q|k|v channels behind it) and the
gated output projection (a gate, optionally after a per-head RMSNorm, in front of it): the references,
and the ops every Linear layer, the pre-norm sublayers, the sublayers' output projections and the logits
call.

A block-FP8 weight (ops/quant/fp8.py BlockFp8Weight) is dequantised and multiplied in fp32 (exactly the
checkpoint's values), the product rounded once to x's dtype; every op here reaches it through `linear`."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..activation.reference import sigmoid_mul
from ..conv1d.reference import causal_conv1d_update
from ..norm.reference import rms_norm, rms_norm_gated
from ..quant.fp8 import BlockFp8Weight

GATE_ACTIVATIONS = ("silu", "swish", "sigmoid")


def linear(x: torch.Tensor, weight: torch.Tensor | BlockFp8Weight) -> torch.Tensor:
    """x [..., K] @ weight[N, K]^T -> [..., N] in x's dtype (torch's matmul, fp32 accumulation on GPU)."""
    if isinstance(weight, BlockFp8Weight):
        return F.linear(x.float(), weight.dequantize(torch.float32)).to(x.dtype)
    return F.linear(x, weight)


def rms_norm_linear(
    x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
    *, zero_centered: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A pre-norm sublayer's input projection: (y, normed, sum) with sum = x + residual (x itself when
    residual is None), normed = rms_norm(sum, norm_weight, eps) and y = linear(normed, weight). The normed
    rows are returned for the sublayer's other readers (the MoE experts), the sum as the next residual."""
    if residual is None:
        normed, total = rms_norm(x, norm_weight, eps, zero_centered=zero_centered), x
    else:
        normed, total = rms_norm(x, norm_weight, eps, zero_centered=zero_centered, residual=residual)
    return linear(normed, weight), normed, total


def rms_norm_linear_conv(
    x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
    *, conv_weight: torch.Tensor, conv_state: torch.Tensor, state_indices: torch.Tensor, zero_centered: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A GDN layer's input projection at a one-token decode step, with the causal conv of its q|k|v channels:
    rms_norm_linear, then its first D = conv_weight.shape[0] output columns through the one-token conv update
    + SiLU (conv1d causal_conv1d_update: each row of x one token of the sequence in slot state_indices[m],
    its window conv_state[slot] [W-1, D] shifted in place; rows of slot -1 give zeros there and touch no
    window). Returns (y, normed, sum) as rms_norm_linear, y's first D columns post-conv (in x's dtype, the
    projection rounded to it before the conv as the unfused layer rounds it)."""
    y, normed, total = rms_norm_linear(x, residual, norm_weight, eps, weight, zero_centered=zero_centered)
    D, N = conv_weight.shape[0], weight.shape[0]
    y2 = y.reshape(-1, N)
    conv = causal_conv1d_update(y2[:, :D], conv_weight, conv_state=conv_state, state_indices=state_indices)
    return torch.cat([conv, y2[:, D:]], dim=-1).reshape(y.shape), normed, total


def gated_linear(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, *, norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6, activation: str = "sigmoid",
) -> torch.Tensor:
    """A gated sublayer's output projection, linear(h, weight) with h [..., K] from x and gate (same shape):
    - norm_weight None: h = x * act(gate) (the attention output gate: sigmoid_mul);
    - norm_weight [D]: h = rms_norm_gated over heads of D (K = heads * D), the GDN output norm
      (x * rsqrt(mean(x^2) + eps) * norm_weight * act(gate) per head).
    act is silu ("swish") or sigmoid; h is rounded to x's dtype before the product, as the two ops are."""
    if activation not in GATE_ACTIVATIONS:
        raise ValueError(f"gated_linear: unsupported gate activation {activation!r} (expected one of "
                         f"{GATE_ACTIVATIONS})")
    if gate.shape != x.shape:
        raise ValueError(f"gated_linear: x {tuple(x.shape)} and gate {tuple(gate.shape)} must have one shape")
    if norm_weight is None:
        h = sigmoid_mul(x, gate) if activation == "sigmoid" else x * F.silu(gate)
    else:
        D, K = norm_weight.numel(), x.shape[-1]
        if norm_weight.dim() != 1 or D == 0 or K % D:
            raise ValueError(f"gated_linear: norm_weight must be [D] with D dividing K = {K}, got "
                             f"{tuple(norm_weight.shape)}")
        lead = x.shape[:-1]
        h = rms_norm_gated(x.reshape(*lead, K // D, D), gate.reshape(*lead, K // D, D), norm_weight, eps,
                           activation=activation).reshape(*lead, K)
    return linear(h, weight)
