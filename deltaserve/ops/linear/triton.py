"""Triton dense projection for few rows (decode): y = x W^T read at the memory rate (same signature as
reference.py, plus an optional launch `config`).

With M rows of x (tokens) and W [N, K], the work is 2 M N K flops for 2 N K bytes of weights: below a few
dozen rows the weights are the whole cost, and cuBLAS's GEMV-shaped kernels read them at 40-100 % of the
copy rate on an H200 (worst on the small-N shapes). Up to GEMV_MAX_M rows this module runs one of two
kernels, both fp32-accumulating (outputs differ from cuBLAS only by summation order), both with every
launch parameter fixed by the shapes (no autotuning at call time, no host sync: CUDA-graph capturable):

- `_gemv_fma_kernel` (M = 1, and M <= 4 at small N): CUDA cores. A program owns BN weight rows, walks
  K in BK-wide steps of 16-byte loads and keeps an fp32 [BN, BK] (M = 1) or [M, BN] partial sum; many
  small programs keep enough loads in flight to cover DRAM latency.
- `_gemv_dot_kernel` (the other M): tensor cores on the swapped product y^T = W x^T: a program's
  [BN, BK] weight tile is the dot's left operand, x^T padded to 16 / 32 columns the right one, so the
  weight tile fills the dot's long side whatever M is; the weight stream is software-pipelined.

Shapes whose N gives too few programs to fill the GPU split K over SPLIT programs: each writes an fp32
partial [SPLIT, M, N] and a second launch sums the partials in a fixed order (deterministic: no atomics).

Above 16 rows (32 for N <= SMALL_N) `linear` calls F.linear: the product turns compute-bound, and
cuBLAS, whose tensor-core GEMMs tie or beat ours there, is the right kernel. The tile rule
(`default_linear_config`) comes from benchmarks/linear_gemv.py on an H200 (docs/PERFORMANCE.md,
"Dense GEMV").
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ..triton_common import ACTIVATION_DTYPES, check, check_same_device

GEMV_MAX_M = 32          # rows of x up to which our kernels can run (M > 16 only for N <= SMALL_N)
SMALL_N = 4096           # N up to which M = 17..32 still beats cuBLAS (its small-N tiles leave SMs idle)
NUM_SMS = 132            # H200; only sizes the split-K rule


@dataclasses.dataclass(frozen=True)
class LinearConfig:
    """Launch parameters of one small-M product: `dot` picks the tensor-core kernel, `block_n` weight rows
    and `block_k` reduction columns per step, `split_k` programs per row block (1: no split)."""

    block_n: int = 8
    block_k: int = 512
    warps: int = 4
    stages: int = 3
    dot: bool = False
    split_k: int = 1


def default_linear_config(M: int, N: int, K: int) -> LinearConfig | None:
    """Tiles for an M x K by K x N product, or None where F.linear (cuBLAS) is used. A rule distilled
    from the H200 sweeps of benchmarks/linear_gemv.py (docs/PERFORMANCE.md, "Dense GEMV"):

    - M = 1: CUDA cores, 16 rows x 256 columns per step at 4 stages for K <= 2048, 8 x 512 at 3 stages
      for longer K; where that gives under two programs per SM (N < 2112), whole-row steps (2048 columns
      x 4 rows, 8 warps; 4096 x 1 row for longer K).
    - M = 2..4 with N <= 1024: CUDA cores, 2 rows x 2048 columns (the router: 64-row blocks would leave
      the GPU idle).
    - otherwise tensor cores, 64 weight rows x 128 columns, 4 stages; K split in 4 where the 64-row
      blocks are fewer than the SMs (N < 8448), 256-column steps at 3 stages for K > 8192.
    - cuBLAS where it already reads at >= 96 % of the copy rate and ours did not beat it: M >= 2 with
      K >= 4096 and N >= 24576 (the 27B MLP gate/up), and above 16 rows unless N <= SMALL_N.
    """
    if M < 1 or M > GEMV_MAX_M or (M > 16 and N > SMALL_N):
        return None
    kp = triton.next_power_of_2(max(K, 16))
    if M == 1:
        if triton.cdiv(N, 8) >= 2 * NUM_SMS:
            if K <= 2048:
                return LinearConfig(block_n=16, block_k=min(256, kp), warps=4, stages=4)
            return LinearConfig(block_n=8, block_k=min(512, kp), warps=4, stages=3)
        if K <= 2048:
            return LinearConfig(block_n=4, block_k=min(2048, kp), warps=8, stages=1)
        return LinearConfig(block_n=1, block_k=min(4096, kp), warps=4, stages=1)
    if M <= 4 and N <= 1024:
        return LinearConfig(block_n=2, block_k=min(2048, kp), warps=4, stages=1)
    if K >= 4096 and N >= 24576:
        return None
    if K > 8192:
        return LinearConfig(block_n=64, block_k=256, warps=4, stages=3, dot=True)
    split = 4 if triton.cdiv(N, 64) < NUM_SMS else 1
    return LinearConfig(block_n=64, block_k=128, warps=4, stages=4, dot=True, split_k=split)


@triton.jit
def _gemv_fma_kernel(x, w, y, M, N, K, k_per_split, s_xm, s_wn, s_ym, s_ys,
                     BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """y[s, m, n] = sum over this program's K range of x[m, k] w[n, k] (fp32); s = program_id(1)."""
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    row_ok = rows < N
    k_lo = tl.program_id(1) * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    kk = tl.arange(0, BK)
    wp = w + rows[:, None].to(tl.int64) * s_wn + kk[None, :]
    ms = tl.arange(0, BM)
    m_ok = ms < M
    xp = x + ms[:, None].to(tl.int64) * s_xm + kk[None, :]
    if BM == 1:
        acc = tl.zeros([BN, BK], dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BK):
            k_ok = kk + k0 < k_hi
            wt = tl.load(wp + k0, mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
            xv = tl.load(x + k0 + kk, mask=k_ok, other=0.0).to(tl.float32)
            acc += wt * xv[None, :]
        out = tl.sum(acc, 1)[None, :]
    else:
        out = tl.zeros([BM, BN], dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BK):
            k_ok = kk + k0 < k_hi
            wt = tl.load(wp + k0, mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
            xt = tl.load(xp + k0, mask=m_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
            out += tl.sum(xt[:, None, :] * wt[None, :, :], 2)
    yp = y + tl.program_id(1).to(tl.int64) * s_ys + ms[:, None].to(tl.int64) * s_ym + rows[None, :]
    tl.store(yp, out.to(y.dtype.element_ty), mask=m_ok[:, None] & row_ok[None, :])


@triton.jit
def _gemv_dot_kernel(x, w, y, M, N, K, k_per_split, s_xm, s_wn, s_ym, s_ys,
                     BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr):
    """As _gemv_fma_kernel, as acc[BN, BM] += W tile [BN, BK] @ x^T tile [BK, BM] on tensor cores."""
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    row_ok = rows < N
    k_lo = tl.program_id(1) * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    kk = tl.arange(0, BK)
    ms = tl.arange(0, BM)
    m_ok = ms < M
    wp = w + rows[:, None].to(tl.int64) * s_wn + kk[None, :]
    xp = x + ms[None, :].to(tl.int64) * s_xm + kk[:, None]
    acc = tl.zeros([BN, BM], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BK):
        k_ok = kk + k0 < k_hi
        wt = tl.load(wp + k0, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        xt = tl.load(xp + k0, mask=k_ok[:, None] & m_ok[None, :], other=0.0)
        if IEEE:
            acc = tl.dot(wt, xt, acc, input_precision="ieee")
        else:
            acc = tl.dot(wt, xt, acc)
    yp = y + tl.program_id(1).to(tl.int64) * s_ys + ms[None, :].to(tl.int64) * s_ym + rows[:, None]
    tl.store(yp, acc.to(y.dtype.element_ty), mask=row_ok[:, None] & m_ok[None, :])


@triton.jit
def _split_sum_kernel(part, y, MN, s_ps, SPLIT: tl.constexpr, B: tl.constexpr):
    """y = sum over s of part[s] (fp32, s in order), rounded once."""
    i = tl.program_id(0) * B + tl.arange(0, B)
    ok = i < MN
    acc = tl.zeros([B], dtype=tl.float32)
    for s in tl.static_range(SPLIT):
        acc += tl.load(part + s * s_ps + i, mask=ok, other=0.0)
    tl.store(y + i, acc.to(y.dtype.element_ty), mask=ok)


def _check_config(cfg: LinearConfig, M: int) -> None:
    op = "linear"
    for name in ("block_n", "block_k", "warps"):
        v = getattr(cfg, name)
        check(v >= 1 and v & (v - 1) == 0, op, f"config {name}={v} must be a power of two")
    check(cfg.stages >= 1 and cfg.split_k >= 1, op,
          f"config stages={cfg.stages}, split_k={cfg.split_k} must be >= 1")
    if cfg.dot:
        check(cfg.block_n >= 16 and cfg.block_k >= 16, op,
              f"config dot=True needs block_n, block_k >= 16, got {cfg.block_n}, {cfg.block_k}")
        check(M <= 64, op, f"config dot=True supports at most 64 rows of x, got {M}")
    else:
        check(M <= 16, op, f"config dot=False supports at most 16 rows of x, got {M}")


def linear(x: torch.Tensor, weight: torch.Tensor, *, config: LinearConfig | None = None) -> torch.Tensor:
    """See reference.linear. Up to GEMV_MAX_M rows of x (or any M with an explicit `config`): our GEMV
    kernels; otherwise F.linear, cuBLAS being the right choice for compute-bound products."""
    op = "linear"
    check(weight.dim() == 2, op, f"weight must be [N, K], got {tuple(weight.shape)}")
    N, K = weight.shape
    check(x.dim() >= 1 and x.shape[-1] == K, op, f"x must be [..., {K}] for weight {tuple(weight.shape)}, "
          f"got {tuple(x.shape)}")
    check(x.dtype in ACTIVATION_DTYPES, op, f"unsupported dtype {x.dtype} (expected one of {ACTIVATION_DTYPES})")
    check(weight.dtype == x.dtype, op, f"x and weight must share a dtype, got {x.dtype} and {weight.dtype}")
    check(x.stride(-1) == 1 or x.shape[-1] <= 1, op,
          f"x must be contiguous in its last dim (strides {tuple(x.stride())})")
    check(weight.stride(-1) == 1 or K <= 1, op,
          f"weight must be contiguous in its last dim (strides {tuple(weight.stride())})")
    check_same_device(op, x, weight)
    lead = x.shape[:-1]
    M = lead.numel()
    x2 = x.reshape(M, K)                       # a view when the leading dims merge (rows may be strided)
    cfg = config if config is not None else default_linear_config(M, N, K)
    if cfg is None:
        return F.linear(x, weight)
    _check_config(cfg, M)
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return y.reshape(*lead, N)
    if K == 0:
        return y.zero_().reshape(*lead, N)
    split = max(1, min(cfg.split_k, triton.cdiv(K, cfg.block_k)))
    k_per_split = triton.cdiv(triton.cdiv(K, split), cfg.block_k) * cfg.block_k
    split = triton.cdiv(K, k_per_split)        # no empty splits
    out = y if split == 1 else torch.empty((split, M, N), dtype=torch.float32, device=x.device)
    s_ys = 0 if split == 1 else M * N
    grid = (triton.cdiv(N, cfg.block_n), split)
    if cfg.dot:
        bm = max(16, triton.next_power_of_2(M))
        _gemv_dot_kernel[grid](x2, weight, out, M, N, K, k_per_split, x2.stride(0), weight.stride(0), N, s_ys,
                               BM=bm, BN=cfg.block_n, BK=cfg.block_k, IEEE=x.dtype == torch.float32,
                               num_warps=cfg.warps, num_stages=cfg.stages)
    else:
        _gemv_fma_kernel[grid](x2, weight, out, M, N, K, k_per_split, x2.stride(0), weight.stride(0), N, s_ys,
                               BM=triton.next_power_of_2(M), BN=cfg.block_n, BK=cfg.block_k,
                               num_warps=cfg.warps, num_stages=cfg.stages)
    if split > 1:
        b = 1024
        _split_sum_kernel[(triton.cdiv(M * N, b),)](out, y, M * N, M * N, SPLIT=split, B=b, num_warps=4)
    return y.reshape(*lead, N)
