"""Triton dense projections for few rows of x (decode), same signatures as reference.py plus an optional
launch `config` (a config.LinearConfig): each op checks its operands, takes its tiles from config.py's rules
(from host-side shapes only: CUDA-graph capturable) and runs our GEMV kernels (triton_gemv.py,
triton_gated.py) or falls back to the unfused launches.

- `linear`: up to GEMV_MAX_M rows our GEMV; above, F.linear (the product turns compute-bound, and cuBLAS's
  tensor-core GEMMs tie or beat ours there).
- `rms_norm_linear`: a pre-norm sublayer's input projection, RMSNorm(x + residual) W^T, with the residual
  add and the norm in the GEMV where default_prenorm_config folds them (M = 1: every decoder layer of a
  batch-1 decode step launches no norm).
- `rms_norm_linear_conv`: a GDN layer's input projection at a decode step with the causal conv update of
  its q|k|v channels in the GEMV's epilogue (the program that produces a channel's projection holds all
  its depthwise conv needs): SiLU(conv) stored instead of the projection, the window shifted;
  gdn_decode(conv_applied=True) then touches no window. ops.fusion.gdn_in_proj runs it at decode batches of
  CONV_FOLD_ROWS sequences.
- `gated_linear`: a gated sublayer's output projection (the attention output gate, or the GDN output norm,
  then the projection): one launch where default_gated_config folds (M = 1), else the gate op then `linear`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..activation import triton as activation_triton
from ..conv1d import triton as conv_triton
from ..norm import triton as norm_triton
from ..triton_common import ACTIVATION_DTYPES, check, check_same_device
from .config import (
    CONV_FOLD_ROWS,
    GATE_FOLD_MAX_ROWS,
    GEMV_MAX_M,
    SMALL_N,
    LinearConfig,
    default_conv_config,
    default_gated_config,
    default_linear_config,
    default_prenorm_config,
)
from .reference import GATE_ACTIVATIONS
from .triton_gated import gated_gemv
from .triton_gemv import check_config, gemv

__all__ = ["CONV_FOLD_ROWS", "GATE_FOLD_MAX_ROWS", "GEMV_MAX_M", "SMALL_N", "LinearConfig", "default_conv_config",
           "default_gated_config", "default_linear_config", "default_prenorm_config", "gated_linear", "linear",
           "rms_norm_linear", "rms_norm_linear_conv"]


def _check_operands(op: str, x: torch.Tensor, weight: torch.Tensor) -> None:
    check(weight.dim() == 2, op, f"weight must be [N, K], got {tuple(weight.shape)}")
    K = weight.shape[1]
    check(x.dim() >= 1 and x.shape[-1] == K, op, f"x must be [..., {K}] for weight {tuple(weight.shape)}, "
          f"got {tuple(x.shape)}")
    check(x.dtype in ACTIVATION_DTYPES, op, f"unsupported dtype {x.dtype} (expected one of {ACTIVATION_DTYPES})")
    check(weight.dtype == x.dtype, op, f"x and weight must share a dtype, got {x.dtype} and {weight.dtype}")
    check(x.stride(-1) == 1 or x.shape[-1] <= 1, op,
          f"x must be contiguous in its last dim (strides {tuple(x.stride())})")
    check(weight.stride(-1) == 1 or K <= 1, op,
          f"weight must be contiguous in its last dim (strides {tuple(weight.stride())})")


def linear(x: torch.Tensor, weight: torch.Tensor, *, config: LinearConfig | None = None) -> torch.Tensor:
    """See reference.linear. Up to GEMV_MAX_M rows of x (or any M with an explicit `config`): our GEMV
    kernels; otherwise F.linear, cuBLAS being the right choice for compute-bound products."""
    op = "linear"
    _check_operands(op, x, weight)
    check_same_device(op, x, weight)
    N, K = weight.shape
    lead = x.shape[:-1]
    M = lead.numel()
    x2 = x.reshape(M, K)                       # a view when the leading dims merge (rows may be strided)
    cfg = config if config is not None else default_linear_config(M, N, K)
    if cfg is None:
        return F.linear(x, weight)
    check_config(cfg, M)
    if M == 0 or N == 0:
        return torch.empty((*lead, N), dtype=x.dtype, device=x.device)
    if K == 0:
        return torch.zeros((*lead, N), dtype=x.dtype, device=x.device)
    return gemv(x2, weight, cfg).reshape(*lead, N)


def _check_prenorm(op: str, x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                   weight: torch.Tensor) -> None:
    """The pre-norm projections' operand checks."""
    _check_operands(op, x, weight)
    K = weight.shape[1]
    check(K >= 1, op, "the normalised dim K must be >= 1")
    check(norm_weight.shape == (K,), op, f"norm_weight must be [{K}], got {tuple(norm_weight.shape)}")
    tensors = [x, weight, norm_weight]
    if residual is not None:
        check(residual.shape == x.shape and residual.dtype == x.dtype, op,
              f"residual must match x: {tuple(residual.shape)} {residual.dtype} vs {tuple(x.shape)} {x.dtype}")
        check(residual.stride(-1) == 1, op,
              f"residual must be contiguous in its last dim (strides {tuple(residual.stride())})")
        tensors.append(residual)
    check_same_device(op, *tensors)


def rms_norm_linear(
    x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
    *, zero_centered: bool = True, config: LinearConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """See reference.rms_norm_linear. With tiles (default_prenorm_config, or an explicit `config` without
    split K): one launch, whose programs multiply their weight rows by x + residual and its norm's
    statistics gathered in the same loop (the row is the K-wide input of a few tokens, re-read from L2
    by each program); program 0 also writes the normed rows and the sum. Otherwise the norm kernel, then
    `linear` (our GEMV tiles or cuBLAS), as two launches."""
    op = "rms_norm_linear"
    _check_prenorm(op, x, residual, norm_weight, weight)
    N, K = weight.shape
    lead = x.shape[:-1]
    M = lead.numel()
    cfg = config if config is not None else default_prenorm_config(M, N, K)
    if cfg is None or M == 0 or N == 0:
        if residual is None:
            h, s = norm_triton.rms_norm(x, norm_weight, eps, zero_centered=zero_centered), x
        else:
            h, s = norm_triton.rms_norm(x, norm_weight, eps, zero_centered=zero_centered, residual=residual)
        return linear(h, weight), h, s
    x2, r2 = x.reshape(M, K), None if residual is None else residual.reshape(M, K)
    h = torch.empty((M, K), dtype=x.dtype, device=x.device)
    s = None if residual is None else torch.empty((M, K), dtype=x.dtype, device=x.device)
    y = gemv(x2, weight, cfg, (r2, norm_weight, eps, zero_centered, h, h if s is None else s))
    return y.reshape(*lead, N), h.view(*lead, K), x if s is None else s.view(*lead, K)


def _check_conv(op: str, M: int, N: int, x: torch.Tensor, conv_weight: torch.Tensor, conv_state: torch.Tensor,
                state_indices: torch.Tensor) -> None:
    check(conv_weight.dim() == 2 and conv_weight.is_contiguous() and 2 <= conv_weight.shape[1] <= 8, op,
          f"conv_weight must be contiguous [D, W] with W in 2..8, got {tuple(conv_weight.shape)}")
    D, W = conv_weight.shape
    check(1 <= D <= N, op, f"conv_weight's D = {D} channels must be among the N = {N} output columns")
    check(tuple(conv_state.shape[1:]) == (W - 1, D) and conv_state.dim() == 3 and conv_state.is_contiguous(), op,
          f"conv_state must be a contiguous pool [S, {W - 1}, {D}], got {tuple(conv_state.shape)}")
    check(conv_weight.dtype == conv_state.dtype == x.dtype, op, f"conv_weight and conv_state must be in x's dtype "
          f"{x.dtype}, got {conv_weight.dtype}, {conv_state.dtype}")
    check(state_indices.dim() == 1 and state_indices.shape[0] == M and state_indices.is_contiguous()
          and state_indices.dtype in (torch.int32, torch.int64), op,
          f"state_indices must be contiguous int32/int64 [{M}] (one slot per row of x), got "
          f"{tuple(state_indices.shape)} {state_indices.dtype}")
    check_same_device(op, x, conv_weight, conv_state, state_indices)


def rms_norm_linear_conv(
    x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
    *, conv_weight: torch.Tensor, conv_state: torch.Tensor, state_indices: torch.Tensor, zero_centered: bool = True,
    config: LinearConfig | None = None, window_prefetch: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """See reference.rms_norm_linear_conv: a GDN layer's input projection at a one-token decode step with the
    causal conv update of its q|k|v channels in the GEMV's epilogue. Each program's output rows below D are
    conv channels: after its weight stream it convolves them with the slot's window rows (loaded before the
    stream), stores SiLU(conv) instead of the projection and shifts the window (triton_folds.conv_epilogue);
    gdn_decode (conv_applied=True) is then the bare recurrence. The norm is folded as rms_norm_linear folds it
    (at M = 1 by default, or with an explicit `config`); otherwise the norm kernel runs first. Without tiles
    (default_conv_config None): rms_norm_linear, then the conv update kernel. `window_prefetch` (CUDA-core
    tiles; None, the default: wherever the tiles are CUDA-core ones): the window rows and taps only asked of
    L2 before the stream and loaded after it (the kernel's CONV_PF: no registers held through the weight
    stream; as fast as the projection without conv at the 35B in_proj, M = 1:
    `PYTHONPATH=. python benchmarks/gdn_decode_latency.py --conv`)."""
    op = "rms_norm_linear_conv"
    _check_prenorm(op, x, residual, norm_weight, weight)
    N, K = weight.shape
    lead = x.shape[:-1]
    M = lead.numel()
    _check_conv(op, M, N, x, conv_weight, conv_state, state_indices)
    D = conv_weight.shape[0]
    cfg = config if config is not None else default_conv_config(M, N, K)
    if window_prefetch is None:      # the default: wherever it applies
        window_prefetch = cfg is not None and not cfg.dot
    check(not window_prefetch or (cfg is not None and not cfg.dot), op,
          f"window_prefetch applies to the CUDA-core tiles (config dot=False) only, got {cfg}")
    if cfg is None or M == 0:
        y, h, s = rms_norm_linear(x, residual, norm_weight, eps, weight, zero_centered=zero_centered)
        y2 = y.reshape(M, N)
        if M:
            y2[:, :D] = conv_triton.causal_conv1d_update(y2[:, :D], conv_weight, conv_state=conv_state,
                                                         state_indices=state_indices)
        return y, h, s
    check_config(cfg, M)
    check(cfg.split_k == 1, op, f"config split_k={cfg.split_k}: the conv epilogue needs one program per row block "
          "over the whole of K")
    x2, r2 = x.reshape(M, K), None if residual is None else residual.reshape(M, K)
    conv = (conv_weight, conv_state, state_indices)
    if config is not None or default_prenorm_config(M, N, K) is not None:   # the norm folded in
        h = torch.empty((M, K), dtype=x.dtype, device=x.device)
        s = None if residual is None else torch.empty((M, K), dtype=x.dtype, device=x.device)
        y = gemv(x2, weight, cfg, (r2, norm_weight, eps, zero_centered, h, h if s is None else s), conv,
                 window_prefetch)
        return y.reshape(*lead, N), h.view(*lead, K), x if s is None else s.view(*lead, K)
    if residual is None:
        h, s = norm_triton.rms_norm(x2, norm_weight, eps, zero_centered=zero_centered), x
    else:
        h, s = norm_triton.rms_norm(x2, norm_weight, eps, zero_centered=zero_centered, residual=r2)
        s = s.view(*lead, K)
    return gemv(h, weight, cfg, conv=conv, window_prefetch=window_prefetch).reshape(*lead, N), h.view(*lead, K), s


def gated_linear(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, *, norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6, activation: str = "sigmoid", config: LinearConfig | None = None,
) -> torch.Tensor:
    """See reference.gated_linear. With tiles (default_gated_config: one row of x and a norm; or an explicit
    `config` with one row and no split K): one launch (triton_gated.gated_gemv). Otherwise the gate op (sigmoid_mul,
    rms_norm_gated; x * silu(gate) in torch) and then `linear`, as two launches."""
    op = "gated_linear"
    _check_operands(op, x, weight)
    check(activation in GATE_ACTIVATIONS, op, f"unsupported gate activation {activation!r} (expected one of "
          f"{GATE_ACTIVATIONS})")
    check(gate.shape == x.shape and gate.dtype == x.dtype, op,
          f"gate must match x: {tuple(gate.shape)} {gate.dtype} vs {tuple(x.shape)} {x.dtype}")
    check(gate.stride(-1) == 1 or gate.shape[-1] <= 1, op,
          f"gate must be contiguous in its last dim (strides {tuple(gate.stride())})")
    N, K = weight.shape
    tensors = [x, gate, weight]
    if norm_weight is not None:
        D = norm_weight.numel()
        check(norm_weight.dim() == 1 and D >= 1 and K % D == 0, op,
              f"norm_weight must be [D] with D dividing K = {K}, got {tuple(norm_weight.shape)}")
        tensors.append(norm_weight)
    check_same_device(op, *tensors)
    lead = x.shape[:-1]
    M = lead.numel()
    cfg = config if config is not None else default_gated_config(M, N, K, None if norm_weight is None else D)
    if cfg is None or M == 0 or N == 0 or K == 0:
        if norm_weight is None:
            h = activation_triton.sigmoid_mul(x, gate) if activation == "sigmoid" else x * F.silu(gate)
        else:
            hd = (*lead, K // D, D)
            h = norm_triton.rms_norm_gated(x.reshape(hd), gate.reshape(hd), norm_weight, eps,
                                           activation=activation).reshape(*lead, K)
        return linear(h, weight)
    check_config(cfg, M)
    check(M == 1 and not cfg.dot and cfg.split_k == 1, op,
          f"the folded gate takes one row of x on the CUDA-core kernel without split K, got {M} rows, {cfg}")
    if norm_weight is not None:
        check(D & (D - 1) == 0, op, f"the folded norm needs a power-of-two head size, got {D}")
    y = gated_gemv(x.reshape(M, K), gate.reshape(M, K), weight, norm_weight, eps, activation == "sigmoid", cfg)
    return y.reshape(*lead, N)
