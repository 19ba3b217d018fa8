"""The projection ops (same signatures as reference.py) for a model that holds block-FP8 weights, chosen by
select_kernels in place of triton.py's: a dense weight (the not-convert modules: lm_head, the GDN ba / a, b
projections, the router) goes to triton.py's op unchanged; a BlockFp8Weight is read by the FP8 kernels, never
dequantised per call:

- up to triton_fp8_gemv.MAX_ROWS rows of x: the weight-only FP8 GEMV (triton_fp8_gemv.py);
- above: the W8A8 block GEMM (triton_fp8_gemm.py: x quantised per token group, fp8 tensor-core dots).

The pre-norm, conv and gate folds of the bf16 GEMVs are not in the FP8 kernels yet: rms_norm_linear runs the
norm kernel then the FP8 product, rms_norm_linear_conv adds the conv update kernel, gated_linear runs the gate
op first (two or three launches, each at its own kernel's rate).

A weight the FP8 kernels cannot take (a column group that is not a power of two >= 16 / 32: tiny test models
only; every published shape has 128) is multiplied by the dequantising reference (fp32), with a warning naming
the op and the shape once per shape: correct, slow, and said.
"""

from __future__ import annotations

import logging

import torch

from ..activation import triton as activation_triton
from ..conv1d import triton as conv_triton
from ..norm import triton as norm_triton
from ..quant.fp8 import BlockFp8Weight
from ..triton_common import ACTIVATION_DTYPES, check, check_same_device
from . import reference
from . import triton as dense
from .triton_fp8_gemm import check_w8a8, w8a8_gemm
from .triton_fp8_gemv import MAX_ROWS, check_fp8_gemv, fp8_gemv

logger = logging.getLogger(__name__)

# Rows of x above which the W8A8 GEMM runs instead of the weight-only GEMV (the GEMV's limit).
W8A8_MIN_ROWS = MAX_ROWS + 1
_warned: set[tuple] = set()


def _refuse_once(op: str, weight: BlockFp8Weight, kernel: str, why: str) -> None:
    key = (op, kernel, tuple(weight.shape), weight.row_group, weight.col_group)
    if key not in _warned:
        _warned.add(key)
        logger.warning("%s: FP8 weight %s (groups %d x %d) not taken by the %s (%s); dequantising reference "
                       "for this shape (correct, slow)", op, tuple(weight.shape), weight.row_group,
                       weight.col_group, kernel, why)


def fp8_linear(x: torch.Tensor, weight: BlockFp8Weight, op: str = "linear") -> torch.Tensor:
    """x [..., K] @ weight^T in x's dtype: the FP8 GEMV up to MAX_ROWS rows, the W8A8 GEMM above."""
    check(weight.qweight.dim() == 2, op, f"weight must be [N, K], got {tuple(weight.shape)}")
    K = weight.shape[1]
    check(x.dim() >= 1 and x.shape[-1] == K, op, f"x must be [..., {K}] for weight {tuple(weight.shape)}, "
          f"got {tuple(x.shape)}")
    check(x.dtype in ACTIVATION_DTYPES, op, f"unsupported dtype {x.dtype} (expected one of {ACTIVATION_DTYPES})")
    check_same_device(op, x, weight.qweight, weight.scale)
    M = x.shape[:-1].numel()
    if M < W8A8_MIN_ROWS:
        kernel, why = "FP8 GEMV", check_fp8_gemv(weight)
    else:
        kernel, why = "W8A8 GEMM", check_w8a8(weight)
    if why is not None:
        _refuse_once(op, weight, kernel, why)
        return reference.linear(x, weight)
    return fp8_gemv(x, weight) if M < W8A8_MIN_ROWS else w8a8_gemm(x, weight)


def linear(x: torch.Tensor, weight: torch.Tensor | BlockFp8Weight) -> torch.Tensor:
    """See reference.linear."""
    if isinstance(weight, BlockFp8Weight):
        return fp8_linear(x, weight)
    return dense.linear(x, weight)


def rms_norm_linear(
    x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
    weight: torch.Tensor | BlockFp8Weight, *, zero_centered: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """See reference.rms_norm_linear: with an FP8 weight the norm kernel, then fp8_linear."""
    if not isinstance(weight, BlockFp8Weight):
        return dense.rms_norm_linear(x, residual, norm_weight, eps, weight, zero_centered=zero_centered)
    if residual is None:
        h, s = norm_triton.rms_norm(x, norm_weight, eps, zero_centered=zero_centered), x
    else:
        h, s = norm_triton.rms_norm(x, norm_weight, eps, zero_centered=zero_centered, residual=residual)
    return fp8_linear(h, weight, "rms_norm_linear"), h, s


def rms_norm_linear_conv(
    x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
    weight: torch.Tensor | BlockFp8Weight, *, conv_weight: torch.Tensor, conv_state: torch.Tensor,
    state_indices: torch.Tensor, zero_centered: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """See reference.rms_norm_linear_conv: with an FP8 weight rms_norm_linear, then the conv update kernel
    on the first conv_weight.shape[0] columns (the projection rounded to x's dtype first, as the reference)."""
    if not isinstance(weight, BlockFp8Weight):
        return dense.rms_norm_linear_conv(x, residual, norm_weight, eps, weight, conv_weight=conv_weight,
                                          conv_state=conv_state, state_indices=state_indices,
                                          zero_centered=zero_centered)
    op = "rms_norm_linear_conv"
    D, N = conv_weight.shape[0], weight.shape[0]
    check(conv_weight.dim() == 2 and 1 <= D <= N, op,
          f"conv_weight must be [D, W] with D <= N = {N}, got {tuple(conv_weight.shape)}")
    y, h, s = rms_norm_linear(x, residual, norm_weight, eps, weight, zero_centered=zero_centered)
    y2 = y.reshape(-1, N)
    check(state_indices.shape == (y2.shape[0],), op, f"state_indices must be [{y2.shape[0]}] (one slot per row "
          f"of x), got {tuple(state_indices.shape)}")
    if y2.shape[0]:
        y2[:, :D] = conv_triton.causal_conv1d_update(y2[:, :D], conv_weight, conv_state=conv_state,
                                                     state_indices=state_indices)
    return y, h, s


def gated_linear(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor | BlockFp8Weight, *,
    norm_weight: torch.Tensor | None = None, eps: float = 1e-6, activation: str = "sigmoid",
) -> torch.Tensor:
    """See reference.gated_linear: with an FP8 weight the gate op (sigmoid_mul / rms_norm_gated; x * silu in
    torch), then fp8_linear."""
    if not isinstance(weight, BlockFp8Weight):
        return dense.gated_linear(x, gate, weight, norm_weight=norm_weight, eps=eps, activation=activation)
    op = "gated_linear"
    check(activation in reference.GATE_ACTIVATIONS, op, f"unsupported gate activation {activation!r} (expected "
          f"one of {reference.GATE_ACTIVATIONS})")
    check(gate.shape == x.shape and gate.dtype == x.dtype, op,
          f"gate must match x: {tuple(gate.shape)} {gate.dtype} vs {tuple(x.shape)} {x.dtype}")
    K = x.shape[-1]
    if norm_weight is None:
        h = activation_triton.sigmoid_mul(x, gate) if activation == "sigmoid" else x * torch.nn.functional.silu(gate)
    else:
        D = norm_weight.numel()
        check(norm_weight.dim() == 1 and D >= 1 and K % D == 0, op,
              f"norm_weight must be [D] with D dividing K = {K}, got {tuple(norm_weight.shape)}")
        lead = x.shape[:-1]
        hd = (*lead, K // D, D)
        h = norm_triton.rms_norm_gated(x.reshape(hd), gate.reshape(hd), norm_weight, eps,
                                       activation=activation).reshape(*lead, K)
    return fp8_linear(h, weight, op)


OPS = {"linear": linear, "rms_norm_linear": rms_norm_linear, "rms_norm_linear_conv": rms_norm_linear_conv,
       "gated_linear": gated_linear}
