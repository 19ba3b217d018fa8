"""Triton GEMV for block-FP8 weights at decode (few rows of x): y = x W^T with W a BlockFp8Weight (ops/quant/
fp8.py), streaming the e4m3 weights (one byte each) and applying the block multipliers per K step; x stays in
its dtype (weight-only quantisation: the decode product is the dequantised weight's, up to summation order).

A program owns BN weight rows and walks K in steps of BK = the weight's column group (128 at published shapes),
so each step needs one multiplier per row: its [BN, BK] tile is widened in registers, the rows' dot products
with the M rows of x are taken in fp32 and scaled by the step's multipliers (scale[n // row_group, k_step])
before they join the fp32 accumulator: sum over steps of s[n, j] * sum_k x[m, k] q[n, k].
Three forms: one row of x (`_fp8_gemv_m1_kernel`: Fp8GemvConfig.k_groups column groups per step, the fp32
partial kept elementwise, reduced once); CUDA-core FMAs over M rows (fp32 x); the swapped tensor-core
product W tile [BN, BK] (widened to x's dtype, exact: e4m3 fits bf16 / fp16) @ x^T [BK, >= 16] (M = 2..16,
Fp8GemvConfig.dot).
No host reads, launch parameters from the shapes only (CUDA-graph capturable). Chosen by ops/linear/
triton_fp8.py for M <= MAX_ROWS; larger M takes the W8A8 GEMM (triton_fp8_gemm.py).
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from ..quant.fp8 import BlockFp8Weight
from .triton_gemv import _split_sum_kernel

MAX_ROWS = 16          # rows of x this kernel takes (decode batches); larger M belongs to the W8A8 GEMM


@dataclasses.dataclass(frozen=True)
class Fp8GemvConfig:
    """block_n weight rows per program; dot: the tensor-core form (M = 2..16); k_groups (M = 1): column groups
    per K step (the step's [block_n, k_groups * col_group] tile feeds an fp32 partial of the same shape, scaled
    elementwise, reduced once at the end)."""

    block_n: int = 16
    warps: int = 4
    stages: int = 4
    dot: bool = False
    k_groups: int = 1
    split_k: int = 1             # M > 1: programs per row block over K (fp32 partials, summed in order)


def default_fp8_gemv_config(M: int, N: int, K: int, dtype: torch.dtype) -> Fp8GemvConfig:
    """From `benchmarks/fp8_ops.py --gemv --sweep` on an H200 at the decode projections (K = 2048 / 4096).
    M = 1: CUDA cores, 4 column groups per step; 16 rows a program from N = 8192 (in_proj_qkvz 13.6 -> 12.4 us,
    in_proj_qkv 10.2 -> 8.3), 4 rows between (in_proj_z 6.2 -> 6.0), 4 rows x 16 groups below (out_proj, the
    shared expert: the bf16 GEMV's shape, config.default_linear_config). fp32 x with M > 1: CUDA cores, 8 rows.
    M = 2..16 bf16 / fp16: tensor cores, 64 rows, K split so ~2 programs run per SM (half the time of 16-row
    blocks at every decode shape: in_proj_qkvz 34 -> 16 us, out_proj 16 -> 10)."""
    if M == 1:
        if N >= 8192:
            return Fp8GemvConfig(block_n=16, warps=4, stages=3, k_groups=4)
        if N > 2048:
            return Fp8GemvConfig(block_n=4, warps=4, stages=3, k_groups=4)
        return Fp8GemvConfig(block_n=4, warps=8, stages=2, k_groups=16)
    if dtype == torch.float32:
        return Fp8GemvConfig(block_n=8, warps=4, stages=3)
    split = max(1, min(8, triton.cdiv(256, triton.cdiv(N, 64))))      # ~256 programs: ~2 per SM
    return Fp8GemvConfig(block_n=64, warps=4, stages=4, dot=True, split_k=split)


@triton.jit
def _fp8_gemv_m1_kernel(x, q, s, y, N, K, KG, s_qn, s_sn,
                        ROW_GROUP: tl.constexpr, BN: tl.constexpr, G: tl.constexpr, GS: tl.constexpr):
    """One row of x: y[n] = sum_k x[k] q[n, k] s[n // ROW_GROUP, k // G], GS column groups of G per step."""
    pid = tl.program_id(0)
    rows = pid * BN + tl.arange(0, BN)
    row_ok = rows < N
    gi = tl.arange(0, GS)
    ci = tl.arange(0, G)
    cols = gi[:, None] * G + ci[None, :]                                                     # [GS, G]
    qp = q + rows[:, None, None].to(tl.int64) * s_qn + cols[None, :, :]
    sp = s + (rows // ROW_GROUP)[:, None].to(tl.int64) * s_sn + gi[None, :]
    acc = tl.zeros((BN, GS, G), dtype=tl.float32)
    for j in range(tl.cdiv(KG, GS)):
        k0 = j * GS * G
        g_ok = j * GS + gi < KG
        k_ok = (k0 + cols < K) & g_ok[:, None]
        w = tl.load(qp + k0, mask=row_ok[:, None, None] & k_ok[None, :, :], other=0).to(tl.float8e4nv, bitcast=True)
        xv = tl.load(x + k0 + cols, mask=k_ok, other=0.0).to(tl.float32)                     # [GS, G]
        sc = tl.load(sp + j * GS, mask=row_ok[:, None] & g_ok[None, :], other=0.0)          # [BN, GS]
        acc += (w.to(tl.float32) * sc[:, :, None]) * xv[None, :, :]
    out = tl.sum(tl.sum(acc, 2), 1)
    tl.store(y + rows, out.to(y.dtype.element_ty), mask=row_ok)


@triton.jit(do_not_specialize=["M", "s_ys"])
def _fp8_gemv_kernel(x, q, s, y, M, N, K, s_xm, s_qn, s_sn, s_ym, groups_per_split, s_ys,
                     ROW_GROUP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                     DOT: tl.constexpr):
    """Program (row block, split s) sums the column groups s * groups_per_split .. (s + 1) * groups_per_split
    - 1 into y + s * s_ys (one split: y itself; more: fp32 partials that _split_sum_kernel adds in order)."""
    pid = tl.program_id(0)
    pid_s = tl.program_id(1)
    rows = pid * BN + tl.arange(0, BN)
    row_ok = rows < N
    ms = tl.arange(0, BM)
    m_ok = ms < M
    ks = tl.arange(0, BK)
    srow = rows // ROW_GROUP
    qp = q + rows[:, None].to(tl.int64) * s_qn + ks[None, :]
    if DOT:
        acc = tl.zeros((BN, BM), dtype=tl.float32)
        xp = x + ms[None, :].to(tl.int64) * s_xm + ks[:, None]
    else:
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        xp = x + ms[:, None].to(tl.int64) * s_xm + ks[None, :]
    for j in range(pid_s * groups_per_split, tl.minimum(tl.cdiv(K, BK), (pid_s + 1) * groups_per_split)):
        col_ok = j * BK + ks < K
        w = tl.load(qp + j * BK, mask=row_ok[:, None] & col_ok[None, :], other=0).to(tl.float8e4nv, bitcast=True)
        scale = tl.load(s + srow * s_sn + j, mask=row_ok, other=0.0)                             # [BN]
        if DOT:
            xt = tl.load(xp + j * BK, mask=col_ok[:, None] & m_ok[None, :], other=0.0)          # [BK, BM]
            acc += tl.dot(w.to(xt.dtype), xt) * scale[:, None]
        else:
            xt = tl.load(xp + j * BK, mask=m_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
            part = tl.sum(xt[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)                 # [BM, BN]
            acc += part * scale[None, :]
    y = y + pid_s.to(tl.int64) * s_ys
    if DOT:
        tl.store(y + ms[None, :] * s_ym + rows[:, None], acc.to(y.dtype.element_ty),
                 mask=row_ok[:, None] & m_ok[None, :])
    else:
        tl.store(y + ms[:, None] * s_ym + rows[None, :], acc.to(y.dtype.element_ty),
                 mask=m_ok[:, None] & row_ok[None, :])


def check_fp8_gemv(weight: BlockFp8Weight) -> str | None:
    """Why the FP8 GEMV cannot take this weight (None: it can)."""
    q = weight.qweight
    if q.dim() != 2 or q.dtype != torch.float8_e4m3fn:
        return f"weight must be float8_e4m3fn [N, K], got {q.dtype} {tuple(q.shape)}"
    bk = weight.col_group
    if bk < 16 or bk & (bk - 1):
        return f"column group {bk} must be a power of two >= 16"
    return None


def fp8_gemv(x: torch.Tensor, weight: BlockFp8Weight, config: Fp8GemvConfig | None = None) -> torch.Tensor:
    """x [..., K] (at most MAX_ROWS rows) @ weight^T -> [..., N] in x's dtype, fp32 accumulation."""
    why = check_fp8_gemv(weight)
    if why is not None:
        raise ValueError(f"fp8_gemv: {why}")
    q, s = weight.qweight, weight.scale
    N, K = q.shape
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K)
    M = x2.shape[0]
    if x.shape[-1] != K or M > MAX_ROWS:
        raise ValueError(f"fp8_gemv: x {tuple(x.shape)} must have K = {K} and at most {MAX_ROWS} rows")
    cfg = config or default_fp8_gemv_config(M, N, K, x.dtype)
    if cfg.dot and (x.dtype == torch.float32 or cfg.block_n < 16):
        raise ValueError(f"fp8_gemv: config dot=True needs bf16 / fp16 x and block_n >= 16, got {x.dtype}, {cfg}")
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    q, s = q.contiguous(), s.contiguous()
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 1 and N and not cfg.dot:
        if cfg.k_groups < 1 or cfg.k_groups & (cfg.k_groups - 1):
            raise ValueError(f"fp8_gemv: config k_groups={cfg.k_groups} must be a power of two")
        kg = triton.cdiv(K, weight.col_group)
        _fp8_gemv_m1_kernel[(triton.cdiv(N, cfg.block_n),)](
            x2, q.view(torch.uint8), s, y, N, K, kg, q.stride(0), s.stride(0), ROW_GROUP=weight.row_group,
            BN=cfg.block_n, G=weight.col_group, GS=max(1, min(cfg.k_groups, triton.next_power_of_2(kg))),
            num_warps=cfg.warps, num_stages=cfg.stages)
    elif M and N:
        if cfg.split_k < 1:
            raise ValueError(f"fp8_gemv: config split_k={cfg.split_k} must be >= 1")
        kg = triton.cdiv(K, weight.col_group)
        per_split = triton.cdiv(kg, min(cfg.split_k, max(kg, 1)))
        split = triton.cdiv(kg, per_split) if kg else 1
        out = y if split == 1 else torch.empty((split, M, N), dtype=torch.float32, device=x.device)
        bm = max(16, triton.next_power_of_2(M)) if cfg.dot else triton.next_power_of_2(M)
        _fp8_gemv_kernel[(triton.cdiv(N, cfg.block_n), split)](
            x2, q.view(torch.uint8), s, out, M, N, K, x2.stride(0), q.stride(0), s.stride(0), N, per_split, M * N,
            ROW_GROUP=weight.row_group, BM=bm, BN=cfg.block_n, BK=weight.col_group, DOT=cfg.dot,
            num_warps=cfg.warps, num_stages=cfg.stages)
        if split > 1:
            _split_sum_kernel[(triton.cdiv(M * N, 1024),)](out, y, M * N, M * N, SPLIT=split, B=1024, num_warps=4)
    return y.reshape(*lead, N)
