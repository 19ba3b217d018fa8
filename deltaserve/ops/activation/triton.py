"""Triton gating activations (same signatures as reference.py): one read of each input and one write, fp32
arithmetic and a single rounding to the input dtype (the eager reference rounds after each op, so bf16
results may differ by one bf16 ulp)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ..triton_common import (ACTIVATION_DTYPES, check, check_last_contiguous, check_same_device, pdl_launch, sigmoid,
                             silu)

BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(x, y, N, s_x, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < N
    g = tl.load(x + row * s_x + cols, mask=m, other=0.0).to(tl.float32)
    u = tl.load(x + row * s_x + N + cols, mask=m, other=0.0).to(tl.float32)
    tl.store(y + row * N + cols, (silu(g) * u).to(y.dtype.element_ty), mask=m)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    op = "silu_and_mul"
    check(x.dim() >= 1 and x.shape[-1] % 2 == 0, op, f"last dim must be even (gate | up), got {tuple(x.shape)}")
    check(x.dtype in ACTIVATION_DTYPES, op, f"unsupported dtype {x.dtype}")
    n = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * n) if x.dim() != 2 else x
    check_last_contiguous(op, x=x2)
    y = torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)
    rows = x2.shape[0]
    if rows and n:
        _silu_and_mul_kernel[(rows, triton.cdiv(n, BLOCK))](x2, y, n, x2.stride(0), BLOCK=BLOCK, num_warps=4)
    return y


@triton.jit
def _sigmoid_mul_kernel(x, g, y, N, s_x, s_g, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    if PDL:                          # a programmatic dependent: wait for the attention, release o_proj
        gdc_wait()
        gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < N
    xv = tl.load(x + row * s_x + cols, mask=m, other=0.0).to(tl.float32)
    gv = tl.load(g + row * s_g + cols, mask=m, other=0.0).to(tl.float32)
    tl.store(y + row * N + cols, (xv * sigmoid(gv)).to(y.dtype.element_ty), mask=m)


def sigmoid_mul(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    op = "sigmoid_mul"
    check(x.shape == gate.shape, op, f"x {tuple(x.shape)} and gate {tuple(gate.shape)} must have one shape")
    check(x.dtype in ACTIVATION_DTYPES and gate.dtype == x.dtype, op, f"unsupported dtypes {x.dtype}, {gate.dtype}")
    check(x.dim() >= 1, op, "x must have at least one dim")
    n = x.shape[-1]
    x2, g2 = x.reshape(-1, n), gate.reshape(-1, n)    # views where the leading dims merge (row strides kept)
    check_last_contiguous(op, x=x2, gate=g2)
    check_same_device(op, x, gate)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rows = x2.shape[0]
    pdl = dict(PDL=True, launch_pdl=True) if pdl_launch(x.device) else {}
    if rows and n:
        _sigmoid_mul_kernel[(rows, triton.cdiv(n, BLOCK))](x2, g2, y, n, x2.stride(0), g2.stride(0), BLOCK=BLOCK,
                                                          num_warps=4, **pdl)
    return y
