"""Triton MoE grouped-GEMM path (batches past the GEMV path): the assignments aligned by expert
(triton_align.py), then

1. w13 GEMM: per (block, slice of I) program, gate and up products of the gathered token rows with the
   block's expert, SiLU(gate) * up in the epilogue, one rounding to the activation dtype -> [rows, I].
2. w2 GEMM: per (block, slice of H) program, the expert outputs, rounded to the activation dtype (as the
   reference's per-expert matmul is) and written in assignment order -> [A, H].
3. Combine: y_t = sum_j w[t, j] * out[t * top_k + j], fp32 in a fixed order, rounded once. No atomics.

Experts that get no tokens cost nothing: no block refers to them. fp32 inputs use IEEE dots.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..triton_common import silu
from .config import MoeConfig
from .triton_align import align_by_expert


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit(do_not_specialize=["A"])
def _w13_kernel(x, w13, inter, sorted_ids, block_expert, A, H, I, s_x, s_we, s_wn,
                TOP_K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr):
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
        acc_g = tl.zeros([BM, BN], dtype=tl.float32)
        acc_u = tl.zeros([BM, BN], dtype=tl.float32)
        for k0 in range(0, H, BK):
            k_ok = kk + k0 < H
            xa = tl.load(xp + k0, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            bg = tl.load(wg + k0, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            bu = tl.load(wu + k0, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            acc_g += _dot(xa, bg, IEEE)
            acc_u += _dot(xa, bu, IEEE)
        h = silu(acc_g) * acc_u
        tl.store(inter + rows[:, None].to(tl.int64) * I + cols[None, :], h.to(inter.dtype.element_ty),
                 mask=row_ok[:, None] & col_ok[None, :])


@triton.jit(do_not_specialize=["A"])
def _w2_kernel(inter, w2, y, sorted_ids, block_expert, A, H, I, s_we, s_wn,
               BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr):
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
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        for k0 in range(0, I, BK):
            k_ok = kk + k0 < I
            ha = tl.load(hp + k0, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(wp + k0, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
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


def grouped_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor, cfg: MoeConfig) -> torch.Tensor:
    """fused_moe on checked inputs (triton.fused_moe) with the grouped GEMMs' tiles `cfg`."""
    T, H = x.shape
    E, inter = w13.shape[0], w2.shape[-1]
    top_k = topk_ids.shape[1]
    A = T * top_k
    sorted_ids, block_expert = align_by_expert(topk_ids, E, cfg.block_m)
    nb = block_expert.shape[0]
    ieee = x.dtype == torch.float32
    inter_act = torch.empty((nb * cfg.block_m, inter), dtype=x.dtype, device=x.device)
    _w13_kernel[(nb, triton.cdiv(inter, cfg.block_n1))](
        x, w13, inter_act, sorted_ids, block_expert, A, H, inter, x.stride(0), w13.stride(0), w13.stride(1),
        TOP_K=top_k, BM=cfg.block_m, BN=cfg.block_n1, BK=cfg.block_k1, IEEE=ieee,
        num_warps=cfg.warps1, num_stages=cfg.stages)
    y = torch.empty((A, H), dtype=x.dtype, device=x.device)
    _w2_kernel[(nb, triton.cdiv(H, cfg.block_n2))](
        inter_act, w2, y, sorted_ids, block_expert, A, H, inter, w2.stride(0), w2.stride(1),
        BM=cfg.block_m, BN=cfg.block_n2, BK=cfg.block_k2, IEEE=ieee, num_warps=cfg.warps2, num_stages=cfg.stages)
    out = torch.empty((T, H), dtype=x.dtype, device=x.device)
    bh = min(1024, triton.next_power_of_2(H))
    _combine_kernel[(T, triton.cdiv(H, bh))](y, topk_weights, out, H, topk_weights.stride(0), out.stride(0),
                                              TOP_K=top_k, BH=bh, num_warps=4)
    return out
