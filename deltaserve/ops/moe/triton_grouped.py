"""Triton MoE grouped-GEMM path (batches past the GEMV path), for dense experts (triton.py) and block-FP8
ones (triton_fp8.py): the assignments aligned by expert (triton_align.py), then

1. w13 GEMM: per (block, slice of I) program, gate and up products of the gathered token rows with the
   block's expert, SiLU(gate) * up in the epilogue, one rounding to the activation dtype -> [rows, I].
2. w2 GEMM: per (block, slice of H) program, the expert outputs, written in assignment order -> [A, H]:
   rounded to the activation dtype (as the reference's per-expert matmul is), fp32 for FP8 experts (as
   their reference keeps them).
3. Combine: y_t = sum_j w[t, j] * out[t * top_k + j], fp32 in a fixed order, rounded once. No atomics.

One pair of GEMM kernels serves both; the constexpr FP8 adds the e4m3 loads (widened, exactly, to the
activation dtype for the dot) and one fp32 multiplier per weight row on each K step's partial product (the
step is one column group), and compiles away for dense experts.

Experts that get no tokens cost nothing: no block refers to them. fp32 inputs use IEEE dots.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..quant.fp8 import BlockFp8Weight
from ..triton_common import silu
from .config import MoeConfig
from .triton_align import align_by_expert


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _load_weight(p, mask, dtype: tl.constexpr, FP8: tl.constexpr):
    """A weight tile for the dot: dense as stored (the activation dtype), FP8 as e4m3 bytes (a uint8 view)
    widened to `dtype`. Call it with mask= by keyword, as tl.load is called: Triton builds keyword arguments
    first, so the dense kernels' IR keeps the op order of a direct tl.load."""
    if FP8:
        return tl.load(p, mask=mask, other=0).to(tl.float8e4nv, bitcast=True).to(dtype)
    else:
        return tl.load(p, mask=mask, other=0.0)


@triton.jit(do_not_specialize=["A"])
def _w13_kernel(x, w13, s13, inter, sorted_ids, block_expert, A, H, I, s_x, s_we, s_wn, s_se, s_sn,
                TOP_K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr,
                FP8: tl.constexpr, RG: tl.constexpr):
    """FP8: w13 holds e4m3 bytes and s13 their fp32 multipliers [E, cdiv(2I, RG), cdiv(H, BK)] (strides
    s_se, s_sn), BK being the column group. Dense: s13 is not read (any pointer; strides 0, RG 1)."""
    blk = tl.program_id(0)
    e = tl.load(block_expert + blk).to(tl.int64)
    if e >= 0:
        rows = blk * BM + tl.arange(0, BM)
        a_idx = tl.load(sorted_ids + rows)
        row_ok = a_idx < A
        tok = (a_idx // TOP_K).to(tl.int64)
        cols = tl.program_id(1) * BN + tl.arange(0, BN)
        col_ok = cols < I
        kk = tl.arange(0, BK)
        xp = x + tok[:, None] * s_x + kk[None, :]
        wg = w13 + e * s_we + cols[None, :].to(tl.int64) * s_wn + kk[:, None]
        wu = wg + I * s_wn
        if FP8:
            sg = s13 + e * s_se + (cols // RG).to(tl.int64) * s_sn
            su = s13 + e * s_se + ((cols + I) // RG).to(tl.int64) * s_sn
        acc_g = tl.zeros([BM, BN], dtype=tl.float32)
        acc_u = tl.zeros([BM, BN], dtype=tl.float32)
        for k0 in range(0, H, BK):
            k_ok = kk + k0 < H
            xa = tl.load(xp + k0, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            bg = _load_weight(wg + k0, mask=k_ok[:, None] & col_ok[None, :], dtype=xa.dtype, FP8=FP8)
            bu = _load_weight(wu + k0, mask=k_ok[:, None] & col_ok[None, :], dtype=xa.dtype, FP8=FP8)
            if FP8:
                acc_g += _dot(xa, bg, IEEE) * tl.load(sg + k0 // BK, mask=col_ok, other=0.0)[None, :]
                acc_u += _dot(xa, bu, IEEE) * tl.load(su + k0 // BK, mask=col_ok, other=0.0)[None, :]
            else:
                acc_g += _dot(xa, bg, IEEE)
                acc_u += _dot(xa, bu, IEEE)
        h = silu(acc_g) * acc_u
        tl.store(inter + rows[:, None].to(tl.int64) * I + cols[None, :], h.to(inter.dtype.element_ty),
                 mask=row_ok[:, None] & col_ok[None, :])


@triton.jit(do_not_specialize=["A"])
def _w2_kernel(inter, w2, s2, y, sorted_ids, block_expert, A, H, I, s_we, s_wn, s_se, s_sn,
               BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr, FP8: tl.constexpr,
               RG: tl.constexpr):
    """FP8 and s2 [E, cdiv(H, RG), cdiv(I, BK)] as in _w13_kernel. The outputs are stored in y's dtype."""
    blk = tl.program_id(0)
    e = tl.load(block_expert + blk).to(tl.int64)
    if e >= 0:
        rows = blk * BM + tl.arange(0, BM)
        a_idx = tl.load(sorted_ids + rows)
        row_ok = a_idx < A
        cols = tl.program_id(1) * BN + tl.arange(0, BN)
        col_ok = cols < H
        kk = tl.arange(0, BK)
        hp = inter + rows[:, None].to(tl.int64) * I + kk[None, :]
        wp = w2 + e * s_we + cols[None, :].to(tl.int64) * s_wn + kk[:, None]
        if FP8:
            sp = s2 + e * s_se + (cols // RG).to(tl.int64) * s_sn
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        for k0 in range(0, I, BK):
            k_ok = kk + k0 < I
            ha = tl.load(hp + k0, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            b = _load_weight(wp + k0, mask=k_ok[:, None] & col_ok[None, :], dtype=ha.dtype, FP8=FP8)
            if FP8:
                acc += _dot(ha, b, IEEE) * tl.load(sp + k0 // BK, mask=col_ok, other=0.0)[None, :]
            else:
                acc += _dot(ha, b, IEEE)
        tl.store(y + a_idx[:, None].to(tl.int64) * H + cols[None, :], acc.to(y.dtype.element_ty),
                 mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _combine_kernel(y, weights, out, H, s_w, s_o, TOP_K: tl.constexpr, BH: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BH + tl.arange(0, BH)
    ok = cols < H
    acc = tl.zeros([BH], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        w = tl.load(weights + t * s_w + j).to(tl.float32)
        acc += w * tl.load(y + (t * TOP_K + j) * H + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out + t * s_o + cols, acc.to(out.dtype.element_ty), mask=ok)


def _gemm_weight(w: torch.Tensor | BlockFp8Weight, block_k: int) -> tuple:
    """A grouped-GEMM kernel's weight arguments (weight, scale, scale strides, RG, BK): a block-FP8 weight as
    its e4m3 bytes and multipliers, its column group the K step; a dense one as itself, also passed as the
    (unread) scale pointer."""
    if isinstance(w, BlockFp8Weight):
        return w.qweight.view(torch.uint8), w.scale, w.scale.stride(0), w.scale.stride(1), w.row_group, w.col_group
    return w, w, 0, 0, 1, block_k


def grouped_moe(x: torch.Tensor, w13: torch.Tensor | BlockFp8Weight, w2: torch.Tensor | BlockFp8Weight,
                topk_weights: torch.Tensor, topk_ids: torch.Tensor, cfg: MoeConfig) -> torch.Tensor:
    """fused_moe on checked inputs (triton.fused_moe, or triton_fp8.fp8_fused_moe with block-FP8 w13 and w2)
    with the grouped GEMMs' tiles `cfg` (block-FP8 experts: K steps of their column groups, not cfg's)."""
    fp8 = isinstance(w13, BlockFp8Weight)
    T, H = x.shape
    E, inter = w13.shape[0], w2.shape[-1]
    q13, s13, s13_e, s13_n, rg13, bk1 = _gemm_weight(w13, cfg.block_k1)
    q2, s2, s2_e, s2_n, rg2, bk2 = _gemm_weight(w2, cfg.block_k2)
    top_k = topk_ids.shape[1]
    A = T * top_k
    sorted_ids, block_expert = align_by_expert(topk_ids, E, cfg.block_m)
    nb = block_expert.shape[0]
    ieee = x.dtype == torch.float32
    inter_act = torch.empty((nb * cfg.block_m, inter), dtype=x.dtype, device=x.device)
    _w13_kernel[(nb, triton.cdiv(inter, cfg.block_n1))](
        x, q13, s13, inter_act, sorted_ids, block_expert, A, H, inter, x.stride(0), q13.stride(0), q13.stride(1),
        s13_e, s13_n, TOP_K=top_k, BM=cfg.block_m, BN=cfg.block_n1, BK=bk1, IEEE=ieee, FP8=fp8, RG=rg13,
        num_warps=cfg.warps1, num_stages=cfg.stages)
    # FP8 experts' outputs stay fp32 until the combine, as their reference keeps them
    y = torch.empty((A, H), dtype=torch.float32 if fp8 else x.dtype, device=x.device)
    _w2_kernel[(nb, triton.cdiv(H, cfg.block_n2))](
        inter_act, q2, s2, y, sorted_ids, block_expert, A, H, inter, q2.stride(0), q2.stride(1), s2_e, s2_n,
        BM=cfg.block_m, BN=cfg.block_n2, BK=bk2, IEEE=ieee, FP8=fp8, RG=rg2, num_warps=cfg.warps2,
        num_stages=cfg.stages)
    out = torch.empty((T, H), dtype=x.dtype, device=x.device)
    bh = min(1024, triton.next_power_of_2(H))
    _combine_kernel[(T, triton.cdiv(H, bh))](y, topk_weights, out, H, topk_weights.stride(0), out.stride(0),
                                              TOP_K=top_k, BH=bh, num_warps=4)
    return out
