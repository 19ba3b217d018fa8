"""Triton RMSNorm variants (same signatures and rounding points as reference.py): fp32 arithmetic, one
rounding to the input dtype at the end; the residual sum is rounded to the input dtype first, as the
reference's `x + residual` is."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..triton_common import check, check_last_contiguous, check_same_device, next_pow2, sigmoid, silu


@triton.jit(do_not_specialize=["M"])
def _rms_norm_gated_kernel(x, z, w, y, M, H, s_x_m, s_x_h, s_z_m, s_z_h, eps,
                           N: tl.constexpr, BR: tl.constexpr, BN: tl.constexpr, SIGMOID: tl.constexpr):
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.arange(0, BN)
    m_idx = (rows // H).to(tl.int64)
    h_idx = rows % H
    mask = (rows[:, None] < M * H) & (cols[None, :] < N)
    xv = tl.load(x + m_idx[:, None] * s_x_m + h_idx[:, None] * s_x_h + cols[None, :], mask=mask, other=0.0)
    zv = tl.load(z + m_idx[:, None] * s_z_m + h_idx[:, None] * s_z_h + cols[None, :], mask=mask, other=0.0)
    xv = xv.to(tl.float32)
    zv = zv.to(tl.float32)
    wv = tl.load(w + cols, mask=cols < N, other=0.0).to(tl.float32)
    yv = xv * tl.rsqrt(tl.sum(xv * xv, axis=1) / N + eps)[:, None] * wv[None, :]
    if SIGMOID:
        gate = sigmoid(zv)
    else:
        gate = silu(zv)
    tl.store(y + rows.to(tl.int64)[:, None] * N + cols[None, :], (yv * gate).to(y.dtype.element_ty), mask=mask)


def _as_3d(t: torch.Tensor) -> torch.Tensor:
    """[..., H, N] or [M, N] as a [M, H, N] view (no copy when the leading dims can be merged)."""
    if t.dim() == 2:
        return t.unsqueeze(1)
    if t.dim() == 3:
        return t
    return t.reshape(-1, t.shape[-2], t.shape[-1])


def rms_norm_gated(
    x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float, *, activation: str = "silu",
) -> torch.Tensor:
    op = "rms_norm_gated"
    check(activation in ("silu", "swish", "sigmoid"), op,
          f"unsupported gate activation {activation!r} (expected 'silu' or 'sigmoid')")
    check(x.shape == z.shape, op, f"x {tuple(x.shape)} and z {tuple(z.shape)} must have one shape")
    check(x.dim() >= 2, op, f"x must have a row dim and a feature dim, got {tuple(x.shape)}")
    N = x.shape[-1]
    check(weight.shape == (N,), op, f"weight must be [{N}], got {tuple(weight.shape)}")
    check(x.dtype in (torch.bfloat16, torch.float16, torch.float32), op, f"unsupported dtype {x.dtype}")
    check_last_contiguous(op, x=x, z=z)
    check_same_device(op, x, z, weight)
    x3, z3 = _as_3d(x), _as_3d(z)
    M, H = x3.shape[0], x3.shape[1]
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.numel() == 0:
        return y
    BN = next_pow2(N)
    BR = max(1, min(64, 4096 // BN))
    _rms_norm_gated_kernel[(triton.cdiv(M * H, BR),)](
        x3, z3, weight, y, M, H, x3.stride(0), x3.stride(1), z3.stride(0), z3.stride(1), float(eps),
        N=N, BR=BR, BN=BN, SIGMOID=activation == "sigmoid", num_warps=4)
    return y


@triton.jit
def _rms_norm_kernel(x, r, w, y, xs, s_x, s_r, eps, N: tl.constexpr, BN: tl.constexpr,
                     RESIDUAL: tl.constexpr, ZERO_CENTERED: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BN)
    m = cols < N
    xv = tl.load(x + row * s_x + cols, mask=m, other=0.0)
    if RESIDUAL:
        rv = tl.load(r + row * s_r + cols, mask=m, other=0.0)
        xv = (xv.to(tl.float32) + rv.to(tl.float32)).to(x.dtype.element_ty)
        tl.store(xs + row * N + cols, xv, mask=m)
    xf = xv.to(tl.float32)
    wv = tl.load(w + cols, mask=m, other=0.0).to(tl.float32)
    if ZERO_CENTERED:
        wv = wv + 1.0
    yv = xf * tl.rsqrt(tl.sum(xf * xf, axis=0) / N + eps) * wv
    tl.store(y + row * N + cols, yv.to(y.dtype.element_ty), mask=m)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, *, zero_centered: bool = True,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    op = "rms_norm"
    N = x.shape[-1]
    check(weight.shape == (N,), op, f"weight must be [{N}], got {tuple(weight.shape)}")
    check(x.dtype in (torch.bfloat16, torch.float16, torch.float32), op, f"unsupported dtype {x.dtype}")
    check(N <= 65536, op, f"feature dim {N} too large for one program")
    x2 = x.reshape(-1, N)
    check_last_contiguous(op, x=x2)
    tensors = [x, weight]
    if residual is not None:
        check(residual.shape == x.shape and residual.dtype == x.dtype, op,
              f"residual must match x: {tuple(residual.shape)} {residual.dtype} vs {tuple(x.shape)} {x.dtype}")
        r2 = residual.reshape(-1, N)
        check_last_contiguous(op, residual=r2)
        tensors.append(residual)
    check_same_device(op, *tensors)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    xs = torch.empty(x.shape, dtype=x.dtype, device=x.device) if residual is not None else y
    rows = x2.shape[0]
    if rows:
        BN = next_pow2(N)
        _rms_norm_kernel[(rows,)](
            x2, r2 if residual is not None else x2, weight, y, xs, x2.stride(0),
            r2.stride(0) if residual is not None else 0, float(eps), N=N, BN=BN, RESIDUAL=residual is not None,
            ZERO_CENTERED=bool(zero_centered), num_warps=min(16, max(1, BN // 512)))
    return y if residual is None else (y, xs)
