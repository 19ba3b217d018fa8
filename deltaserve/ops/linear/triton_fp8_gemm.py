"""Triton W8A8 block-FP8 GEMM for many rows of x (prefill): y = x W^T with W a BlockFp8Weight (ops/quant/fp8.py)
and x quantised on the fly per token and group of the weight's column group (128 at published shapes) to e4m3
with fp32 scales (DeepSeek-V3's scheme, as vLLM's Triton block path runs it).

Two launches (bf16 / fp16 x; fp32 x runs the GEMM weight-only, without step 1):
1. `_act_quant_kernel`: x [M, K] -> e4m3 [M, K] + scales fp32 [M, ceil(K / G)]; a program takes GB groups
   of one row. Same arithmetic as quant.fp8.quantize_activations (amax floored, fp32 division, clamp,
   round to nearest even), so the reference is bit for bit the same operand.
2. `_w8a8_kernel`: a program owns a [BM, BN] output tile and walks K in steps of G: tl.dot of the e4m3
   tiles (exact products, fp32 accumulation) scaled by the step's activation scales (one per row) and
   weight multipliers (scale[n // row_group, step], one per column), added to the fp32 accumulator: the
   scales are applied per K block, never folded into the operands. Tiles are grouped along M (GROUP_M) so
   programs that run together share weight tiles in L2.

Launch parameters come from the shapes only (no host reads: CUDA-graph capturable).
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from ..quant.fp8 import ACT_SCALE_FLOOR, FP8_DTYPE, FP8_MAX, BlockFp8Weight
from ..triton_common import check

MIN_GROUP = 32           # the fp8 dot's K step (col_group) must be a power of two >= this
_MAX = tl.constexpr(FP8_MAX)
_FLOOR = tl.constexpr(ACT_SCALE_FLOOR)


@dataclasses.dataclass(frozen=True)
class W8A8Config:
    block_m: int = 64
    block_n: int = 128
    group_m: int = 8
    warps: int = 4
    stages: int = 3


def default_w8a8_config(M: int, N: int, K: int, dtype: torch.dtype = torch.bfloat16) -> W8A8Config:
    """128 x 128 tiles at 8 warps for large M, 64-row tiles below 128 rows; fp32 x (weight-only, fp32 tiles in
    shared memory) 64 x 64 at 2 stages. Not tuned on the device yet (`benchmarks/fp8_ops.py --gemm`)."""
    if dtype == torch.float32:
        return W8A8Config(block_m=64, block_n=64, warps=4, stages=2)
    if M >= 128:
        return W8A8Config(block_m=128, block_n=128, warps=8, stages=3)
    return W8A8Config(block_m=64, block_n=128, warps=4, stages=3)


@triton.jit(do_not_specialize=["M"])
def _act_quant_kernel(x, q, s, M, K, KG, s_xm, s_qm, s_sm, G: tl.constexpr, GB: tl.constexpr):
    m = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1) * GB + tl.arange(0, GB)                               # groups of this program
    cols = g[:, None] * G + tl.arange(0, G)[None, :]                           # [GB, G]
    ok = (g[:, None] < KG) & (cols < K)
    v = tl.load(x + m * s_xm + cols, mask=ok, other=0.0).to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(v), 1), _FLOOR)
    scale = tl.math.div_rn(amax, _MAX)
    qv = tl.math.div_rn(v, scale[:, None])
    qv = tl.minimum(tl.maximum(qv, -_MAX), _MAX).to(tl.float8e4nv)
    tl.store(q + m * s_qm + cols, qv.to(tl.uint8, bitcast=True), mask=ok)
    tl.store(s + m * s_sm + g, scale, mask=g < KG)


def quantize_activations(x2: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x2 [M, K] -> (e4m3 [M, K], fp32 scales [M, ceil(K / group)]): quant.fp8.quantize_activations on device."""
    M, K = x2.shape
    kg = triton.cdiv(K, group)
    q = torch.empty((M, K), dtype=FP8_DTYPE, device=x2.device)
    s = torch.empty((M, kg), dtype=torch.float32, device=x2.device)
    gb = max(1, min(triton.next_power_of_2(kg), 4096 // group))
    if M and K:
        _act_quant_kernel[(M, triton.cdiv(kg, gb))](x2, q.view(torch.uint8), s, M, K, kg, x2.stride(0), q.stride(0),
                                                    s.stride(0), G=group, GB=gb, num_warps=4)
    return q, s


@triton.jit(do_not_specialize=["M"])
def _w8a8_kernel(a, a_s, b, b_s, y, M, N, K, s_am, s_asm, s_bn, s_bsn, s_ym,
                 ROW_GROUP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                 GROUP_M: tl.constexpr, A8: tl.constexpr):
    """A8: a is e4m3 with scales a_s (W8A8); else a is x itself (fp32: weight-only, IEEE dots on the widened
    weight tile)."""
    pid = tl.program_id(0)
    grid_m = tl.cdiv(M, BM)
    grid_n = tl.cdiv(N, BN)
    width = GROUP_M * grid_n
    first_m = (pid // width) * GROUP_M
    size_m = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m
    rows = pid_m * BM + tl.arange(0, BM)
    cols = pid_n * BN + tl.arange(0, BN)
    row_ok = rows < M
    col_ok = cols < N
    kk = tl.arange(0, BK)
    ap = a + rows[:, None].to(tl.int64) * s_am + kk[None, :]
    bp = b + cols[None, :].to(tl.int64) * s_bn + kk[:, None]
    asp = a_s + rows.to(tl.int64) * s_asm
    bsp = b_s + (cols // ROW_GROUP).to(tl.int64) * s_bsn
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for j in range(tl.cdiv(K, BK)):
        k_ok = kk + j * BK < K
        bt = tl.load(bp + j * BK, mask=k_ok[:, None] & col_ok[None, :], other=0).to(tl.float8e4nv, bitcast=True)
        sb = tl.load(bsp + j, mask=col_ok, other=0.0)
        if A8:
            at = tl.load(ap + j * BK, mask=row_ok[:, None] & k_ok[None, :], other=0).to(tl.float8e4nv,
                                                                                          bitcast=True)
            sa = tl.load(asp + j, mask=row_ok, other=0.0)
            acc += tl.dot(at, bt) * sa[:, None] * sb[None, :]
        else:
            at = tl.load(ap + j * BK, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            acc += tl.dot(at, bt.to(at.dtype), input_precision="ieee") * sb[None, :]
    tl.store(y + rows[:, None].to(tl.int64) * s_ym + cols[None, :], acc.to(y.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


def check_w8a8(weight: BlockFp8Weight) -> str | None:
    """Why the W8A8 kernel cannot take this weight (None: it can)."""
    q = weight.qweight
    if q.dim() != 2 or q.dtype != FP8_DTYPE:
        return f"weight must be float8_e4m3fn [N, K], got {q.dtype} {tuple(q.shape)}"
    c = weight.col_group
    if c < MIN_GROUP or c & (c - 1):
        return f"column group {c} must be a power of two >= {MIN_GROUP}"
    return None


def w8a8_gemm(x: torch.Tensor, weight: BlockFp8Weight, config: W8A8Config | None = None) -> torch.Tensor:
    """x [..., K] @ weight^T -> [..., N] in x's dtype. bf16 / fp16 x: quantised per token group
    (quantize_activations), then the block-scaled fp8 GEMM (W8A8). fp32 x (the exactness runs): the same
    GEMM weight-only, the weight tile widened to fp32 (IEEE dots), so the product is the dequantised
    weight's. Raises ValueError for what check_w8a8 refuses."""
    why = check_w8a8(weight)
    check(why is None, "w8a8_gemm", why or "")
    q, s = weight.qweight, weight.scale
    N, K = q.shape
    check(x.shape[-1] == K, "w8a8_gemm", f"x {tuple(x.shape)} must have K = {K}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return y.reshape(*lead, N)
    G = weight.col_group
    a8 = x.dtype != torch.float32
    if a8:
        xq, xs = quantize_activations(x2, G)
        a, a_s, s_am, s_asm = xq.view(torch.uint8), xs, xq.stride(0), xs.stride(0)
    else:
        a, a_s, s_am, s_asm = x2, x2, x2.stride(0), 0
    cfg = config or default_w8a8_config(M, N, K, x.dtype)
    q, s = q.contiguous(), s.contiguous()
    grid = (triton.cdiv(M, cfg.block_m) * triton.cdiv(N, cfg.block_n),)
    _w8a8_kernel[grid](a, a_s, q.view(torch.uint8), s, y, M, N, K, s_am, s_asm, q.stride(0), s.stride(0),
                       y.stride(0), ROW_GROUP=weight.row_group, BM=cfg.block_m, BN=cfg.block_n, BK=G,
                       GROUP_M=cfg.group_m, A8=a8, num_warps=cfg.warps, num_stages=cfg.stages)
    return y.reshape(*lead, N)
