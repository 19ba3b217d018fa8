"""Triton GEMV kernels for few rows of x (decode): y = x W^T read at the memory rate, with the pre-norm
(RMSNorm(x + residual)) folded in front and a GDN layer's conv update behind (triton_folds.py), and the
launcher `gemv` that the ops in triton.py call.

With M rows of x and W [N, K] the work is 2 M N K flops for 2 N K bytes of weights: below a few dozen rows
the weights are the whole cost. Both kernels accumulate in fp32 (outputs differ from cuBLAS only by summation
order) and take every launch parameter from the shapes (no autotuning at call time, no host sync: CUDA-graph
capturable):

- `_gemv_fma_kernel` (CUDA cores): a program owns BN weight rows, walks K in BK-wide steps of 16-byte loads
  and keeps an fp32 [BN, BK] (M = 1) or [M, BN] partial sum; many small programs keep enough loads in flight
  to cover DRAM latency.
- `_gemv_dot_kernel` (tensor cores) on the swapped product y^T = W x^T: a program's [BN, BK] weight tile is
  the dot's left operand, x^T padded to 16 / 32 columns the right one, so the weight tile fills the dot's long
  side whatever M is; the weight stream is software-pipelined.

Shapes whose N gives too few programs to fill the GPU split K over SPLIT programs: each writes an fp32 partial
[SPLIT, M, N] and `_split_sum_kernel` sums them in a fixed order (deterministic: no atomics).

On Hopper the launches are programmatic dependents (PDL): a program asks L2 for the first columns of its
weight rows (constant: safe to read early), waits (griddepcontrol.wait) before its first real load, then lets
the next kernel launch (griddepcontrol.launch_dependents), so in a decode step's chain of small kernels each
one is resident, its first weights on their way, when its predecessor finishes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ..triton_common import check, pdl_launch, prefetch_l2
from .config import LinearConfig
from .triton_folds import conv_epilogue, conv_loads, conv_prefetch, norm_multiplier, prenorm_store, residual_sum


@triton.jit
def prefetch_weights(w, rows, row_ok, k_lo, k_hi, s_wn, BN: tl.constexpr, PF: tl.constexpr):
    """Ask L2 for the first PF columns of this program's weight rows (one request per 128-byte line):
    issued before griddepcontrol.wait, so they arrive while the kernel before us drains. Weights are
    constant, the one thing a programmatic dependent may read before its wait."""
    if PF > 0:
        cols = k_lo + tl.arange(0, PF // 64) * 64
        ptrs = w + rows[:, None].to(tl.int64) * s_wn + cols[None, :]
        prefetch_l2(ptrs, row_ok[:, None] & (cols < k_hi)[None, :])


@triton.jit(do_not_specialize=["M", "s_ys"])
def _gemv_fma_kernel(x, w, y, M, N, K, k_per_split, s_xm, s_wn, s_ym, s_ys,
                     r, nw, h, s, s_rm, eps, cw, cst, cidx, CD, CSLOTS,
                     BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                     NORM: tl.constexpr, HAS_RES: tl.constexpr, ZC: tl.constexpr, PK: tl.constexpr,
                     PDL: tl.constexpr = False, PF: tl.constexpr = 0, CONV: tl.constexpr = False,
                     CW: tl.constexpr = 4, CONV_PF: tl.constexpr = False):
    """y[s, m, n] = sum over this program's K range of x[m, k] w[n, k] (fp32); s = program_id(1).

    NORM (rms_norm_linear; no split K): x is RMSNorm(x + r) with weight nw. The main loop multiplies the
    unnormalised (x + r) w' and accumulates the rows' sum of squares alongside, and the output is scaled
    by rstd at the end: nothing stands between a program's start and its weight stream (a prologue
    computing rstd first was slower: `benchmarks/linear_gemv.py --prenorm`). The normed operand is thus not
    rounded to x's dtype as the two-launch path's is (a difference within one rounding of y). Program 0
    then writes the normed rows and the sum to h and s.

    CONV (rms_norm_linear_conv; no split K): output rows < CD are a GDN layer's conv channels, one token per
    row of x with its window in slot cidx[m] of the pool cst [S, CW-1, CD]; the epilogue (conv_epilogue)
    stores their SiLU(conv) and shifts their window. Without CONV_PF the window and taps are loaded after
    the wait, before the weight stream, and held in registers through it. With CONV_PF (the default on this
    kernel) they are only asked of L2 before the wait (conv_prefetch; with PDL) and loaded after the stream
    (the slots read right after the wait): the main loop keeps its registers (at the 35B in_proj tiles the
    held window cost 24 registers and a second wave of programs), the tail gains an L2 round trip."""
    pid_n, pid_s = tl.program_id(0), tl.program_id(1)
    rows = pid_n * BN + tl.arange(0, BN)
    row_ok = rows < N
    k_lo = pid_s * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    ms = tl.arange(0, BM)
    m_ok = ms < M
    c_ok = m_ok[:, None] & row_ok[None, :]
    if PDL:
        if CONV and CONV_PF:
            conv_prefetch(cst, cw, cidx, rows[None, :], ms[:, None], c_ok, CD, CSLOTS, CW)
        prefetch_weights(w, rows, row_ok, k_lo, k_hi, s_wn, BN, PF)
        gdc_wait()                   # x, r and the outputs' memory belong to the kernels before us
        gdc_launch_dependents()      # the next kernel may become resident; it waits for us itself
    kk = tl.arange(0, BK)
    wp = w + rows[:, None].to(tl.int64) * s_wn + kk[None, :]
    x_off = ms[:, None].to(tl.int64) * s_xm + kk[None, :]
    r_off = ms[:, None].to(tl.int64) * s_rm + kk[None, :]
    if CONV:
        if CONV_PF:   # read now, used after the stream
            c_slot = tl.load(cidx + ms[:, None], mask=m_ok[:, None], other=-1)
        else:
            c_slot = tl.load(cidx + ms[:, None], mask=c_ok, other=-1)
            c_cm, c_live, c_win, c_olds, c_taps = conv_loads(cst, cw, c_slot, rows[None, :], c_ok, CD, CW)
    if BM == 1:
        acc = tl.zeros([BN, BK], dtype=tl.float32)
        ss = tl.zeros([BK], dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BK):
            k_ok = kk + k0 < k_hi
            wt = tl.load(wp + k0, mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
            if NORM:
                xv = residual_sum(x, r, k0 + kk, k0 + kk, k_ok, HAS_RES).to(tl.float32)
                ss += xv * xv
                xv = xv * norm_multiplier(nw, k0 + kk, k_ok, ZC)
            else:
                xv = tl.load(x + k0 + kk, mask=k_ok, other=0.0).to(tl.float32)
            acc += wt * xv[None, :]
        out = tl.sum(acc, 1)[None, :]
        if NORM:
            rstd = tl.rsqrt(tl.sum(ss, 0)[None] / K + eps)
    else:
        out = tl.zeros([BM, BN], dtype=tl.float32)
        ss = tl.zeros([BM], dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BK):
            k_ok = kk + k0 < k_hi
            wt = tl.load(wp + k0, mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
            x_ok = m_ok[:, None] & k_ok[None, :]
            if NORM:
                xt = residual_sum(x, r, x_off + k0, r_off + k0, x_ok, HAS_RES).to(tl.float32)
                ss += tl.sum(xt * xt, 1)
                xt = xt * norm_multiplier(nw, k0 + kk, k_ok, ZC)[None, :]
            else:
                xt = tl.load(x + x_off + k0, mask=x_ok, other=0.0).to(tl.float32)
            out += tl.sum(xt[:, None, :] * wt[None, :, :], 2)
        if NORM:
            rstd = tl.rsqrt(ss / K + eps)
    if NORM:
        out = out * rstd[:, None]
        if pid_n + pid_s == 0:
            prenorm_store(x, r, nw, h, s, rstd, M, K, s_xm, s_rm, BM, PK, HAS_RES, ZC)
    if CONV:
        if CONV_PF:
            c_cm, c_live, c_win, c_olds, c_taps = conv_loads(cst, cw, c_slot, rows[None, :], c_ok, CD, CW)
        out = conv_epilogue(out, c_cm, c_live, c_win, c_olds, c_taps, CD, y.dtype.element_ty, CW)
    yp = y + pid_s.to(tl.int64) * s_ys + ms[:, None].to(tl.int64) * s_ym + rows[None, :]
    tl.store(yp, out.to(y.dtype.element_ty), mask=m_ok[:, None] & row_ok[None, :])


@triton.jit(do_not_specialize=["M", "s_ys"])
def _gemv_dot_kernel(x, w, y, M, N, K, k_per_split, s_xm, s_wn, s_ym, s_ys,
                     r, nw, h, s, s_rm, eps, cw, cst, cidx, CD, CSLOTS,
                     BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr,
                     NORM: tl.constexpr, HAS_RES: tl.constexpr, ZC: tl.constexpr, PK: tl.constexpr,
                     PDL: tl.constexpr = False, PF: tl.constexpr = 0, CONV: tl.constexpr = False,
                     CW: tl.constexpr = 4):
    """As _gemv_fma_kernel, as acc[BN, BM] += W tile [BN, BK] @ x^T tile [BK, BM] on tensor cores (with
    NORM the dot's operand is (x + r) w' rounded to x's dtype; no default selects NORM here: the x tile,
    computed in registers, is not pipelined with the weight stream). CONV: as _gemv_fma_kernel's (without
    CONV_PF), on the transposed tile."""
    pid_n, pid_s = tl.program_id(0), tl.program_id(1)
    rows = pid_n * BN + tl.arange(0, BN)
    row_ok = rows < N
    k_lo = pid_s * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    if PDL:
        prefetch_weights(w, rows, row_ok, k_lo, k_hi, s_wn, BN, PF)
        gdc_wait()                   # x, r and the outputs' memory belong to the kernels before us
        gdc_launch_dependents()      # the next kernel may become resident; it waits for us itself
    kk = tl.arange(0, BK)
    ms = tl.arange(0, BM)
    m_ok = ms < M
    wp = w + rows[:, None].to(tl.int64) * s_wn + kk[None, :]
    x_off = ms[None, :].to(tl.int64) * s_xm + kk[:, None]
    r_off = ms[None, :].to(tl.int64) * s_rm + kk[:, None]
    if CONV:
        c_ok = row_ok[:, None] & m_ok[None, :]
        c_slot = tl.load(cidx + ms[None, :], mask=c_ok, other=-1)
        c_cm, c_live, c_win, c_olds, c_taps = conv_loads(cst, cw, c_slot, rows[:, None], c_ok, CD, CW)
    acc = tl.zeros([BN, BM], dtype=tl.float32)
    ss = tl.zeros([BM], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BK):
        k_ok = kk + k0 < k_hi
        wt = tl.load(wp + k0, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        x_ok = k_ok[:, None] & m_ok[None, :]
        if NORM:
            xt = residual_sum(x, r, x_off + k0, r_off + k0, x_ok, HAS_RES)
            xf = xt.to(tl.float32)
            ss += tl.sum(xf * xf, 0)
            xt = (xf * norm_multiplier(nw, k0 + kk, k_ok, ZC)[:, None]).to(xt.dtype)
        else:
            xt = tl.load(x + x_off + k0, mask=x_ok, other=0.0)
        if IEEE:
            acc = tl.dot(wt, xt, acc, input_precision="ieee")
        else:
            acc = tl.dot(wt, xt, acc)
    if NORM:
        rstd = tl.rsqrt(ss / K + eps)
        acc = acc * rstd[None, :]
        if pid_n + pid_s == 0:
            prenorm_store(x, r, nw, h, s, rstd, M, K, s_xm, s_rm, BM, PK, HAS_RES, ZC)
    if CONV:
        acc = conv_epilogue(acc, c_cm, c_live, c_win, c_olds, c_taps, CD, y.dtype.element_ty, CW)
    yp = y + pid_s.to(tl.int64) * s_ys + ms[None, :].to(tl.int64) * s_ym + rows[:, None]
    tl.store(yp, acc.to(y.dtype.element_ty), mask=row_ok[:, None] & m_ok[None, :])


@triton.jit(do_not_specialize=["MN", "s_ps"])
def _split_sum_kernel(part, y, MN, s_ps, SPLIT: tl.constexpr, B: tl.constexpr, PDL: tl.constexpr = False):
    """y = sum over s of part[s] (fp32, s in order), rounded once."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    i = tl.program_id(0) * B + tl.arange(0, B)
    ok = i < MN
    acc = tl.zeros([B], dtype=tl.float32)
    for s in tl.static_range(SPLIT):
        acc += tl.load(part + s * s_ps + i, mask=ok, other=0.0)
    tl.store(y + i, acc.to(y.dtype.element_ty), mask=ok)


def check_config(cfg: LinearConfig, M: int) -> None:
    """Refuse tiles the kernels cannot run with M rows of x."""
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


def gemv(x2: torch.Tensor, weight: torch.Tensor, cfg: LinearConfig, prenorm: tuple | None = None,
         conv: tuple | None = None, window_prefetch: bool = False) -> torch.Tensor:
    """y [M, N] = x2 [M, K] @ weight^T by our kernels with tiles `cfg` (M, N, K >= 1). prenorm =
    (r2 or None, norm_weight, eps, zero_centered, h, s): the product is of RMSNorm(x2 + r2) (the kernels'
    NORM), and the normed rows and the sum are written to h and s ([M, K]). conv = (conv_weight [D, W],
    conv_state [S, W-1, D], state_indices [M]): y's first D columns get the one-token conv (the kernels'
    CONV epilogue, checked by the caller; window_prefetch: its CONV_PF form, CUDA-core kernel only)."""
    (M, K), N = x2.shape, weight.shape[0]
    check_config(cfg, M)
    y = torch.empty((M, N), dtype=x2.dtype, device=x2.device)
    split = max(1, min(cfg.split_k, triton.cdiv(K, cfg.block_k)))
    k_per_split = triton.cdiv(triton.cdiv(K, split), cfg.block_k) * cfg.block_k
    split = triton.cdiv(K, k_per_split)        # no empty splits
    out = y if split == 1 else torch.empty((split, M, N), dtype=torch.float32, device=x2.device)
    s_ys = 0 if split == 1 else M * N
    grid = (triton.cdiv(N, cfg.block_n), split)
    bm = max(16, triton.next_power_of_2(M)) if cfg.dot else triton.next_power_of_2(M)
    if prenorm is None:
        norm_args, norm_kw = (x2, x2, y, y, 0, 0.0), {"NORM": False, "HAS_RES": False, "ZC": False, "PK": 16}
    else:
        check(split == 1, "rms_norm_linear", f"config split_k={cfg.split_k}: the folded norm needs one program "
              "per row block over the whole of K")
        r2, nw, eps, zc, h, s = prenorm
        norm_args = (x2 if r2 is None else r2, nw, h, s, 0 if r2 is None else r2.stride(0), float(eps))
        # program 0's store pass over the rows takes ~2048 values at a time
        pk = min(triton.next_power_of_2(K), max(16, 2048 // bm))
        norm_kw = {"NORM": True, "HAS_RES": r2 is not None, "ZC": bool(zc), "PK": pk}
    if conv is None:
        conv_args = (y, y, y, 0, 1)              # never touched without CONV
    else:
        check(split == 1, "rms_norm_linear_conv", f"config split_k={cfg.split_k}: the conv epilogue needs one "
              "program per row block over the whole of K")
        check(not (window_prefetch and cfg.dot), "rms_norm_linear_conv", "window_prefetch applies to the "
              "CUDA-core kernel only (config dot=False)")
        cw, cst, cidx = conv
        conv_args = (cw, cst, cidx, cw.shape[0], max(cst.shape[0], 1))
        norm_kw = dict(norm_kw, CONV=True, CW=cw.shape[1], **({"CONV_PF": True} if window_prefetch else {}))
    args = (x2, weight, out, M, N, K, k_per_split, x2.stride(0), weight.stride(0), N, s_ys, *norm_args, *conv_args)
    pf = 0 if cfg.prefetch <= 0 else max(64, triton.next_power_of_2(min(cfg.prefetch, k_per_split)))
    pdl = {"PDL": True, "PF": pf, "launch_pdl": True} if cfg.pdl and pdl_launch(x2.device) else {}
    if cfg.dot:
        _gemv_dot_kernel[grid](*args, BM=bm, BN=cfg.block_n, BK=cfg.block_k, IEEE=x2.dtype == torch.float32,
                               num_warps=cfg.warps, num_stages=cfg.stages, **norm_kw, **pdl)
    else:
        _gemv_fma_kernel[grid](*args, BM=bm, BN=cfg.block_n, BK=cfg.block_k,
                               num_warps=cfg.warps, num_stages=cfg.stages, **norm_kw, **pdl)
    if split > 1:
        b = 1024
        _split_sum_kernel[(triton.cdiv(M * N, b),)](out, y, M * N, M * N, SPLIT=split, B=b, num_warps=4,
                                                    **({k: v for k, v in pdl.items() if k != "PF"}))
    return y
