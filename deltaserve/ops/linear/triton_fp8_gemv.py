"""Triton GEMV for block-FP8 weights at decode (few rows of x): y = x W^T with W a BlockFp8Weight (ops/quant/
fp8.py), streaming the e4m3 weights (one byte each) and applying the block multipliers per K step.

A program owns BN weight rows and walks K in steps of BK = the weight's column group (128 at published shapes),
so each step needs one multiplier per row: its [BN, BK] tile is widened to fp32, the rows' dot products with the
M rows of x are taken in fp32 and scaled by the step's multipliers (scale[n // row_group, k_step]) before they
join the fp32 accumulator: sum over steps of s[n, j] * sum_k x[m, k] q[n, k], the dequantised product up to
summation order. No host reads, launch parameters from the shapes only (CUDA-graph capturable).

Not yet chosen by select_kernels (the FP8 path there is dequantise-then-dense): the fused pre-norm / gate /
conv epilogues of the bf16 GEMVs and the tuning per (N, K) are the next step (issue 28 item 4).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..quant.fp8 import BlockFp8Weight

MAX_ROWS = 16          # rows of x this kernel takes (decode batches); larger M belongs to a block-scaled GEMM


@triton.jit(do_not_specialize=["M"])
def _fp8_gemv_kernel(x, q, s, y, M, N, K, s_xm, s_qn, s_sn, s_ym,
                     ROW_GROUP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * BN + tl.arange(0, BN)
    row_ok = rows < N
    ms = tl.arange(0, BM)
    m_ok = ms < M
    ks = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    srow = rows // ROW_GROUP
    for j in range(0, tl.cdiv(K, BK)):
        cols = j * BK + ks
        col_ok = cols < K
        w = tl.load(q + rows[:, None].to(tl.int64) * s_qn + cols[None, :], mask=row_ok[:, None] & col_ok[None, :],
                    other=0).to(tl.float8e4nv, bitcast=True).to(tl.float32)                       # [BN, BK]
        xt = tl.load(x + ms[:, None] * s_xm + cols[None, :], mask=m_ok[:, None] & col_ok[None, :],
                     other=0.0).to(tl.float32)                                                   # [BM, BK]
        part = tl.sum(xt[:, None, :] * w[None, :, :], axis=2)                                    # [BM, BN]
        scale = tl.load(s + srow * s_sn + j, mask=row_ok, other=0.0)                             # [BN]
        acc += part * scale[None, :]
    tl.store(y + ms[:, None] * s_ym + rows[None, :], acc.to(y.dtype.element_ty),
             mask=m_ok[:, None] & row_ok[None, :])


def fp8_gemv(x: torch.Tensor, weight: BlockFp8Weight, *, block_n: int = 16) -> torch.Tensor:
    """x [..., K] (at most MAX_ROWS rows) @ weight^T -> [..., N] in x's dtype, fp32 accumulation."""
    q, s = weight.qweight, weight.scale
    if q.dim() != 2 or q.dtype != torch.float8_e4m3fn:
        raise ValueError(f"fp8_gemv: weight must be float8_e4m3fn [N, K], got {q.dtype} {tuple(q.shape)}")
    N, K = q.shape
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K)
    M = x2.shape[0]
    if x.shape[-1] != K or M > MAX_ROWS:
        raise ValueError(f"fp8_gemv: x {tuple(x.shape)} must have K = {K} and at most {MAX_ROWS} rows")
    bk = weight.col_group
    if bk < 16 or bk & (bk - 1):
        raise ValueError(f"fp8_gemv: column group {bk} must be a power of two >= 16")
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    q, s = q.contiguous(), s.contiguous()
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M:
        _fp8_gemv_kernel[(triton.cdiv(N, block_n),)](
            x2, q.view(torch.uint8), s, y, M, N, K, x2.stride(0), q.stride(0), s.stride(0), y.stride(0),
            ROW_GROUP=weight.row_group, BM=max(1, triton.next_power_of_2(M)), BN=block_n, BK=bk)
    return y.reshape(*lead, N)
