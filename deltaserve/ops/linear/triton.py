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

On Hopper the GEMV launches are programmatic dependents (PDL): a program asks L2 for the first columns
of its weight rows (constant: safe to read early), waits (griddepcontrol.wait) before its first real
load, then lets the next kernel launch (griddepcontrol.launch_dependents), so in a decode step's chain
of small kernels each one is resident, its first weights on their way, when its predecessor finishes
(a launch after the predecessor costs ~1 us, measured for the MoE GEMV).

Above 16 rows (32 for N <= SMALL_N) `linear` calls F.linear: the product turns compute-bound, and
cuBLAS, whose tensor-core GEMMs tie or beat ours there, is the right kernel. The tile rule
(`default_linear_config`) comes from benchmarks/linear_gemv.py on an H200 (docs/PERFORMANCE.md,
"Dense GEMV").

`rms_norm_linear` is a pre-norm sublayer's input projection, RMSNorm(x + residual) W^T, with the
residual add and the norm folded into the same kernels (their NORM variant) where that measured faster
than a norm launch before the GEMV: at M = 1 (`default_prenorm_config`), i.e. every decoder layer of a
batch-1 decode step launches no norm.

`rms_norm_linear_conv` is a GDN layer's input projection at a decode step with the causal conv update of
its q|k|v channels in the GEMV's epilogue (the program that produces a channel's projection holds all the
depthwise conv of that channel needs): SiLU(conv) stored instead of the projection, the window shifted;
gdn_decode(conv_applied=True) then touches no window. ops.fusion.gdn_in_proj runs it at decode batches of
CONV_FOLD_ROWS sequences.

`rms_norm_route` is an MoE block's router at one token: rms_norm_linear's kernel whose last program to
finish (an arrival counter) also does the routing (moe/triton_routing.py's math), so no routing kernel
follows the GEMV. Selectable, not a default (docs/PERFORMANCE.md, "MoE").

`gated_linear` is a gated sublayer's output projection: the attention output gate x * sigmoid(gate), or
the GDN output norm (per-head RMSNorm times silu / sigmoid of the gate), then the projection. Where
`default_gated_config` folds (the GDN norm at M = 1) it is one launch (`_gemv_gated_kernel`): each
program steps over K in whole heads, normalises and gates the x chunk in registers (x and the gate
re-read from L2 by every program, hence wider row blocks than the plain GEMV's), rounds it to x's dtype
as the two ops do, and multiplies its weight rows by it; elsewhere the gate op (norm) kernel, then
`linear`.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ..activation import triton as activation_triton
from ..conv1d import triton as conv_triton
from ..moe import triton_routing as route_ops
from ..norm import triton as norm_triton
from ..triton_common import ACTIVATION_DTYPES, check, check_same_device, pdl_launch, prefetch_l2, sigmoid, silu
from .reference import GATE_ACTIVATIONS

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
    pdl: bool = True            # programmatic dependent launch where the device has it (Hopper+)
    prefetch: int = 512         # with pdl: weight columns per row asked of L2 before the wait (0: none)


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
def _residual_sum(x, r, x_off, r_off, mask, HAS_RES: tl.constexpr):
    """x (+ r, the sum rounded to x's dtype as the reference's `x + residual` is) at the given offsets."""
    v = tl.load(x + x_off, mask=mask, other=0.0)
    if HAS_RES:
        v = (v.to(tl.float32) + tl.load(r + r_off, mask=mask, other=0.0).to(tl.float32)).to(x.dtype.element_ty)
    return v


@triton.jit
def _norm_weight(nw, k_idx, k_ok, ZC: tl.constexpr):
    """The norm's multiplier w' (1 + w zero-centred, else w) at k_idx, fp32."""
    w = tl.load(nw + k_idx, mask=k_ok, other=0.0).to(tl.float32)
    if ZC:
        w = w + 1.0
    return w


@triton.jit
def _prenorm_store(x, r, nw, h, s, rstd, M, K, s_xm, s_rm, BM: tl.constexpr, PK: tl.constexpr,
                   HAS_RES: tl.constexpr, ZC: tl.constexpr):
    """Write the normed rows h = (x + r) * rstd * w' (rounded once, as the reference's) and the sum s
    (both [M, K] contiguous): the other readers of the normed input, and the next residual."""
    ms = tl.arange(0, BM)
    m_ok = ms < M
    kk = tl.arange(0, PK)
    for k0 in range(0, K, PK):
        ks = k0 + kk
        ok = m_ok[:, None] & (ks < K)[None, :]
        v = _residual_sum(x, r, ms[:, None].to(tl.int64) * s_xm + ks[None, :],
                          ms[:, None].to(tl.int64) * s_rm + ks[None, :], ok, HAS_RES)
        if HAS_RES:
            tl.store(s + ms[:, None].to(tl.int64) * K + ks[None, :], v, mask=ok)
        hv = v.to(tl.float32) * rstd[:, None] * _norm_weight(nw, ks, ks < K, ZC)[None, :]
        tl.store(h + ms[:, None].to(tl.int64) * K + ks[None, :], hv.to(v.dtype), mask=ok)


@triton.jit
def _prefetch_weights(w, rows, row_ok, k_lo, k_hi, s_wn, BN: tl.constexpr, PF: tl.constexpr):
    """Ask L2 for the first PF columns of this program's weight rows (one request per 128-byte line):
    issued before griddepcontrol.wait, so they arrive while the kernel before us drains. Weights are
    constant, the one thing a programmatic dependent may read before its wait."""
    if PF > 0:
        cols = k_lo + tl.arange(0, PF // 64) * 64
        ptrs = w + rows[:, None].to(tl.int64) * s_wn + cols[None, :]
        prefetch_l2(ptrs, row_ok[:, None] & (cols < k_hi)[None, :])


@triton.jit
def _conv_prefetch(cst, cw, cidx, ch, tok, ok, CD, SLOTS, W: tl.constexpr):
    """Ask L2 for the window rows and taps the conv epilogue will load (a hint, no registers kept): issued
    before griddepcontrol.wait, from the slots found then (read at L2, clamped to the pool: a stale slot
    costs bandwidth, never a wrong value; the real slots are read after the wait)."""
    guess = tl.load(cidx + tok, mask=ok, other=-1, cache_modifier=".cg").to(tl.int64)
    cm = ok & (ch < CD)
    live = cm & (guess >= 0)
    win = cst + tl.minimum(tl.maximum(guess, 0), SLOTS - 1) * ((W - 1) * CD) + ch
    for i in tl.static_range(W - 1):
        prefetch_l2(win + i * CD, live)
    prefetch_l2(cw + ch * W, cm)


@triton.jit
def _conv_loads(cst, cw, slot, ch, ok, CD, W: tl.constexpr):
    """Loads of the conv epilogue (rms_norm_linear_conv) for output channels ch of tokens whose slots are
    `slot` (tensors that broadcast to the output tile; ok: the tile's valid entries): the conv-channel mask
    (ch < CD), the live mask (a conv channel of a token whose slot is not -1), the window pointers of row 0,
    the slot window's W-1 rows oldest first (zeros where not live) and the W taps (conv weight [CD, W])."""
    cm = ok & (ch < CD)
    slot = slot.to(tl.int64)
    live = cm & (slot >= 0)
    win = cst + slot * ((W - 1) * CD) + ch
    olds = ()
    for i in tl.static_range(W - 1):
        olds = olds + (tl.load(win + i * CD, mask=live, other=0.0),)
    taps = ()
    for i in tl.static_range(W):
        taps = taps + (tl.load(cw + ch * W + i, mask=cm, other=0.0),)
    return cm, live, win, olds, taps


@triton.jit
def _conv_epilogue(out, cm, live, win, olds, taps, CD, dtype: tl.constexpr, W: tl.constexpr):
    """The projection tile out (fp32) with its conv channels replaced by SiLU(depthwise causal conv) over
    [window rows, the projection rounded to dtype], and the window shifted to [rows 1.., that projection].
    The conv is gdn_decode's (triton_recurrent._conv_of): fp32 products of the inputs and taps added in tap
    order from zero, SiLU, one rounding to dtype, so its bits are the ones gdn_decode computes from the
    stored projection. Conv channels of padded tokens (slot -1) give zeros and leave the pool alone; the
    other channels (z, b, a) keep the projection."""
    xt = out.to(dtype)           # the stored projection: the conv's newest input and the window's new row
    acc = tl.zeros(out.shape, dtype=tl.float32)
    for i in tl.static_range(W):
        if i < W - 1:
            acc += olds[i].to(tl.float32) * taps[i].to(tl.float32)
        else:
            acc += xt.to(tl.float32) * taps[i].to(tl.float32)
    conv = silu(acc).to(dtype).to(tl.float32)
    tl.debug_barrier()           # every thread has read the old rows before any is overwritten
    for i in tl.static_range(W - 1):
        if i < W - 2:
            tl.store(win + i * CD, olds[i + 1], mask=live)
        else:
            tl.store(win + i * CD, xt.to(win.dtype.element_ty), mask=live)
    return tl.where(live, conv, tl.where(cm, 0.0, out))


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
    computing rstd first measured 0.6-2 us slower per call on an H200). The normed operand is thus not
    rounded to x's dtype as the two-launch path's is (a difference within one rounding of y). Program 0
    then writes the normed rows and the sum to h and s.

    CONV (rms_norm_linear_conv; no split K): output rows < CD are a GDN layer's conv channels, one token per
    row of x with its window in slot cidx[m] of the pool cst [S, CW-1, CD]; the epilogue (_conv_epilogue)
    stores their SiLU(conv) and shifts their window. The window and taps are loaded after the wait, before
    the weight stream, and held in registers through it (+24 registers at the 35B in_proj tiles: 96, 5
    programs per SM instead of 7, so the 772 programs no longer fit in one wave: docs/PERFORMANCE.md). With
    CONV_PF they are only asked of L2 before the wait (_conv_prefetch; with PDL) and loaded after the stream
    (the slots read right after the wait): the main loop keeps its registers, the tail gains an L2 round
    trip."""
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
            _conv_prefetch(cst, cw, cidx, rows[None, :], ms[:, None], c_ok, CD, CSLOTS, CW)
        _prefetch_weights(w, rows, row_ok, k_lo, k_hi, s_wn, BN, PF)
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
            c_cm, c_live, c_win, c_olds, c_taps = _conv_loads(cst, cw, c_slot, rows[None, :], c_ok, CD, CW)
    if BM == 1:
        acc = tl.zeros([BN, BK], dtype=tl.float32)
        ss = tl.zeros([BK], dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BK):
            k_ok = kk + k0 < k_hi
            wt = tl.load(wp + k0, mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
            if NORM:
                xv = _residual_sum(x, r, k0 + kk, k0 + kk, k_ok, HAS_RES).to(tl.float32)
                ss += xv * xv
                xv = xv * _norm_weight(nw, k0 + kk, k_ok, ZC)
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
                xt = _residual_sum(x, r, x_off + k0, r_off + k0, x_ok, HAS_RES).to(tl.float32)
                ss += tl.sum(xt * xt, 1)
                xt = xt * _norm_weight(nw, k0 + kk, k_ok, ZC)[None, :]
            else:
                xt = tl.load(x + x_off + k0, mask=x_ok, other=0.0).to(tl.float32)
            out += tl.sum(xt[:, None, :] * wt[None, :, :], 2)
        if NORM:
            rstd = tl.rsqrt(ss / K + eps)
    if NORM:
        out = out * rstd[:, None]
        if pid_n + pid_s == 0:
            _prenorm_store(x, r, nw, h, s, rstd, M, K, s_xm, s_rm, BM, PK, HAS_RES, ZC)
    if CONV:
        if CONV_PF:
            c_cm, c_live, c_win, c_olds, c_taps = _conv_loads(cst, cw, c_slot, rows[None, :], c_ok, CD, CW)
        out = _conv_epilogue(out, c_cm, c_live, c_win, c_olds, c_taps, CD, y.dtype.element_ty, CW)
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
    NORM the dot's operand is (x + r) w' rounded to x's dtype). NORM here measured ~2x slower than the
    two launches at M = 8 (the x tile, computed in registers, is not pipelined with the weight stream):
    only an explicit config selects it. CONV: as _gemv_fma_kernel's (without CONV_PF), on the transposed
    tile."""
    pid_n, pid_s = tl.program_id(0), tl.program_id(1)
    rows = pid_n * BN + tl.arange(0, BN)
    row_ok = rows < N
    k_lo = pid_s * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    if PDL:
        _prefetch_weights(w, rows, row_ok, k_lo, k_hi, s_wn, BN, PF)
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
        c_cm, c_live, c_win, c_olds, c_taps = _conv_loads(cst, cw, c_slot, rows[:, None], c_ok, CD, CW)
    acc = tl.zeros([BN, BM], dtype=tl.float32)
    ss = tl.zeros([BM], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BK):
        k_ok = kk + k0 < k_hi
        wt = tl.load(wp + k0, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        x_ok = k_ok[:, None] & m_ok[None, :]
        if NORM:
            xt = _residual_sum(x, r, x_off + k0, r_off + k0, x_ok, HAS_RES)
            xf = xt.to(tl.float32)
            ss += tl.sum(xf * xf, 0)
            xt = (xf * _norm_weight(nw, k0 + kk, k_ok, ZC)[:, None]).to(xt.dtype)
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
            _prenorm_store(x, r, nw, h, s, rstd, M, K, s_xm, s_rm, BM, PK, HAS_RES, ZC)
    if CONV:
        acc = _conv_epilogue(acc, c_cm, c_live, c_win, c_olds, c_taps, CD, y.dtype.element_ty, CW)
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


def _gemv(x2: torch.Tensor, weight: torch.Tensor, cfg: LinearConfig, prenorm: tuple | None = None,
          conv: tuple | None = None, window_prefetch: bool = False) -> torch.Tensor:
    """y [M, N] = x2 [M, K] @ weight^T by our kernels with tiles `cfg` (M, N, K >= 1). prenorm =
    (r2 or None, norm_weight, eps, zero_centered, h, s): the product is of RMSNorm(x2 + r2) (the kernels'
    NORM), and the normed rows and the sum are written to h and s ([M, K]). conv = (conv_weight [D, W],
    conv_state [S, W-1, D], state_indices [M]): y's first D columns get the one-token conv (the kernels'
    CONV epilogue, checked by the caller; window_prefetch: its CONV_PF form, CUDA-core kernel only)."""
    (M, K), N = x2.shape, weight.shape[0]
    _check_config(cfg, M)
    y = torch.empty((M, N), dtype=x2.dtype, device=x2.device)
    split = max(1, min(cfg.split_k, triton.cdiv(K, cfg.block_k)))
    k_per_split = triton.cdiv(triton.cdiv(K, split), cfg.block_k) * cfg.block_k
    split = triton.cdiv(K, k_per_split)        # no empty splits
    out = y if split == 1 else torch.empty((split, M, N), dtype=torch.float32, device=x2.device)
    s_ys = 0 if split == 1 else M * N
    grid = (triton.cdiv(N, cfg.block_n), split)
    bm = max(16, triton.next_power_of_2(M)) if cfg.dot else triton.next_power_of_2(M)
    if prenorm is None:
        norm_args, norm_kw = (x2, x2, y, y, 0, 0.0), dict(NORM=False, HAS_RES=False, ZC=False, PK=16)
    else:
        check(split == 1, "rms_norm_linear", f"config split_k={cfg.split_k}: the folded norm needs one program "
              "per row block over the whole of K")
        r2, nw, eps, zc, h, s = prenorm
        norm_args = (x2 if r2 is None else r2, nw, h, s, 0 if r2 is None else r2.stride(0), float(eps))
        # program 0's store pass over the rows takes ~2048 values at a time
        pk = min(triton.next_power_of_2(K), max(16, 2048 // bm))
        norm_kw = dict(NORM=True, HAS_RES=r2 is not None, ZC=bool(zc), PK=pk)
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
    pdl = dict(PDL=True, PF=pf, launch_pdl=True) if cfg.pdl and pdl_launch(x2.device) else {}
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
    _check_config(cfg, M)
    if M == 0 or N == 0:
        return torch.empty((*lead, N), dtype=x.dtype, device=x.device)
    if K == 0:
        return torch.zeros((*lead, N), dtype=x.dtype, device=x.device)
    return _gemv(x2, weight, cfg).reshape(*lead, N)


def _check_prenorm(op: str, x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                   weight: torch.Tensor) -> None:
    """rms_norm_linear's operand checks (also rms_norm_route's)."""
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


def default_prenorm_config(M: int, N: int, K: int) -> LinearConfig | None:
    """Tiles for rms_norm_linear with the norm folded into the GEMV, or None where the norm stays a launch
    of its own before `linear`. Folded only at M = 1 (the CUDA-core kernel, one program per row block):
    there it measured 1.4-1.7 us faster per call than the two launches on an H200 at the 35B-A3B shapes.
    The tensor-core kernel with the norm folded (M >= 2 at large N, and split K) measured ~2x slower
    than the two launches at M = 8 (docs/PERFORMANCE.md, "Dense GEMV"); M = 2..4 (the CUDA-core kernel at
    small N) is not measured yet."""
    return default_linear_config(M, N, K) if M == 1 else None


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
    y = _gemv(x2, weight, cfg, (r2, norm_weight, eps, zero_centered, h, h if s is None else s))
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


def default_conv_config(M: int, N: int, K: int) -> LinearConfig | None:
    """Tiles for rms_norm_linear_conv: the plain GEMV's (default_linear_config) without split K (the conv
    epilogue needs whole-K programs; the GDN input projections of the models have enough row blocks not to
    split: 35B-A3B 12352 rows), or None where F.linear runs (then the conv is a launch of its own)."""
    cfg = default_linear_config(M, N, K)
    return None if cfg is None else dataclasses.replace(cfg, split_k=1)


# Decode batches of CONV_FOLD_ROWS[0]..[1] sequences run the conv in the input projection (gdn_in_proj): the
# layer step at the 35B-A3B shape on an H200 was faster at 1, 4 and 8, a tie at 2, not measured above 8
# (benchmarks/gdn_decode_latency.py).
CONV_FOLD_ROWS = (1, 8)


def rms_norm_linear_conv(
    x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
    *, conv_weight: torch.Tensor, conv_state: torch.Tensor, state_indices: torch.Tensor, zero_centered: bool = True,
    config: LinearConfig | None = None, window_prefetch: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """See reference.rms_norm_linear_conv: a GDN layer's input projection at a one-token decode step with the
    causal conv update of its q|k|v channels in the GEMV's epilogue. Each program's output rows below D are
    conv channels: after its weight stream it convolves them with the slot's window rows (loaded before the
    stream), stores SiLU(conv) instead of the projection and shifts the window (_conv_epilogue); gdn_decode
    (conv_applied=True) is then the bare recurrence. The norm is folded as rms_norm_linear folds it (at
    M = 1 by default, or with an explicit `config`); otherwise the norm kernel runs first. Without tiles
    (default_conv_config None): rms_norm_linear, then the conv update kernel. `window_prefetch` (CUDA-core
    tiles; None, the default: wherever the tiles are CUDA-core ones, i.e. M = 1): the window rows and taps only
    asked of L2 before the stream and loaded after it (the kernel's CONV_PF: no registers held through the
    weight stream; the 35B in_proj at M = 1 15.43 us with it, 18.91 without, 15.52 with no conv at all)."""
    op = "rms_norm_linear_conv"
    _check_prenorm(op, x, residual, norm_weight, weight)
    N, K = weight.shape
    lead = x.shape[:-1]
    M = lead.numel()
    _check_conv(op, M, N, x, conv_weight, conv_state, state_indices)
    D = conv_weight.shape[0]
    cfg = config if config is not None else default_conv_config(M, N, K)
    if window_prefetch is None:      # the default: wherever it applies (measured faster at M = 1)
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
    _check_config(cfg, M)
    check(cfg.split_k == 1, op, f"config split_k={cfg.split_k}: the conv epilogue needs one program per row block "
          "over the whole of K")
    x2, r2 = x.reshape(M, K), None if residual is None else residual.reshape(M, K)
    conv = (conv_weight, conv_state, state_indices)
    if config is not None or default_prenorm_config(M, N, K) is not None:   # the norm folded in
        h = torch.empty((M, K), dtype=x.dtype, device=x.device)
        s = None if residual is None else torch.empty((M, K), dtype=x.dtype, device=x.device)
        y = _gemv(x2, weight, cfg, (r2, norm_weight, eps, zero_centered, h, h if s is None else s), conv,
                  window_prefetch)
        return y.reshape(*lead, N), h.view(*lead, K), x if s is None else s.view(*lead, K)
    if residual is None:
        h, s = norm_triton.rms_norm(x2, norm_weight, eps, zero_centered=zero_centered), x
    else:
        h, s = norm_triton.rms_norm(x2, norm_weight, eps, zero_centered=zero_centered, residual=r2)
        s = s.view(*lead, K)
    return _gemv(h, weight, cfg, conv=conv, window_prefetch=window_prefetch).reshape(*lead, N), h.view(*lead, K), s

# ---- the MoE router with the routing in its tail -------------------------------------------------

@triton.jit
def _gemv_norm_route_kernel(x, w, y, N, K, s_wn, r, nw, h, s, eps, counter, weights, ids, E,
                            BN: tl.constexpr, BK: tl.constexpr, HAS_RES: tl.constexpr, ZC: tl.constexpr,
                            PK: tl.constexpr, TOP_K: tl.constexpr, SLICES: tl.constexpr, KP: tl.constexpr,
                            EP: tl.constexpr, RENORM: tl.constexpr, KEYS: tl.constexpr,
                            PDL: tl.constexpr = False, PF: tl.constexpr = 0):
    """rms_norm_route at one token: _gemv_fma_kernel's NORM loop at BM = 1, operation for operation (the
    same logits bits), then each program counts itself in on `counter` after storing its logits; the last
    to arrive resets the counter and routes the token from all N logits, read back at L2
    (triton_routing._route_tile: the routing kernel's math). On Hopper the successor (the w13 GEMV) is
    released right after the wait, as the plain GEMV releases the routing kernel; its griddepcontrol.wait
    covers the whole grid, the tail included."""
    pid = tl.program_id(0)
    rows = pid * BN + tl.arange(0, BN)
    row_ok = rows < N
    if PDL:
        _prefetch_weights(w, rows, row_ok, 0, K, s_wn, BN, PF)
        gdc_wait()                   # x, r, the outputs and the counter belong to the kernels before us
        gdc_launch_dependents()      # the next kernel may become resident; it waits for us itself
    kk = tl.arange(0, BK)
    wp = w + rows[:, None].to(tl.int64) * s_wn + kk[None, :]
    acc = tl.zeros([BN, BK], dtype=tl.float32)
    ss = tl.zeros([BK], dtype=tl.float32)
    for k0 in range(0, K, BK):
        k_ok = kk + k0 < K
        wt = tl.load(wp + k0, mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        xv = _residual_sum(x, r, k0 + kk, k0 + kk, k_ok, HAS_RES).to(tl.float32)
        ss += xv * xv
        xv = xv * _norm_weight(nw, k0 + kk, k_ok, ZC)
        acc += wt * xv[None, :]
    out = tl.sum(acc, 1)[None, :]
    rstd = tl.rsqrt(tl.sum(ss, 0)[None] / K + eps)
    out = out * rstd[:, None]
    if pid == 0:
        _prenorm_store(x, r, nw, h, s, rstd, 1, K, K, K, 1, PK, HAS_RES, ZC)
    one = tl.arange(0, 1)
    tl.store(y + one[:, None] * N + rows[None, :], out.to(y.dtype.element_ty), mask=row_ok[None, :])
    tl.debug_barrier()               # every thread's logit stores precede the release below
    arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
    if arrived == tl.num_programs(0) - 1:    # the last program: all N logits are in L2
        tl.store(counter, 0)                 # for the next launch (stream-ordered; graph replays too)
        route_ops._route_tile(y, weights, ids, one, one < 1, E, N, TOP_K, SLICES, KP, EP, RENORM, True, KEYS)


@functools.cache
def _route_counter(device: torch.device) -> torch.Tensor:
    # A cache, as ops/gdn/triton_recurrent.py's and ops/attention/triton.py's counters: the op's signature
    # has no workspace, and zeroing a fresh one per call would add back a launch. Every launch leaves it
    # zero; launches on one device are stream-ordered (two must not run concurrently).
    return torch.zeros(1, dtype=torch.int32, device=device)


def rms_norm_route(
    x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
    top_k: int, renormalize: bool, *, shared_slices: int = 0, zero_centered: bool = True,
    config: LinearConfig | None = None, route_keys: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """An MoE block's router: rms_norm_linear, then topk_softmax on its logits -> (logits, normed,
    x + residual, topk_weights, topk_ids), as moe.reference.rms_norm_route. At one token with CUDA-core
    tiles without split K (default_prenorm_config, or `config`): one launch, _gemv_norm_route_kernel, the
    last of the GEMV's programs doing the routing (the routing kernel's launch and one kernel boundary
    leave a decode step's chain: router GEMV -> w13 -> w2). Otherwise rms_norm_linear, then
    triton_routing.topk_softmax. Either way the same choice and weight bits (the routing kernel's math,
    triton_routing._route_tile). `route_keys`: the tail's choice by one max-reduction per expert over int64
    keys (_route_tile's KEYS; the tail's tile spans all the GEMV's warps, so each reduction crosses warps;
    same result either way). Not a default anywhere yet: selected by the caller (benchmarks/
    attention_moe_ops.py --moe-decode times it; docs/PERFORMANCE.md, "MoE")."""
    op = "rms_norm_route"
    _check_prenorm(op, x, residual, norm_weight, weight)
    N, K = weight.shape
    # the routing's checks, on the logits' shape (a meta tensor: nothing computed yet)
    route_ops.check_routing(op, torch.empty((0, N), dtype=x.dtype, device="meta"), top_k, shared_slices)
    E = N - (1 if shared_slices else 0)
    lead = x.shape[:-1]
    M = lead.numel()
    cfg = config if config is not None else default_prenorm_config(M, N, K)
    if cfg is None or M != 1:
        logits, h, s = rms_norm_linear(x, residual, norm_weight, eps, weight, zero_centered=zero_centered,
                                       config=config)
        w_, ids = route_ops.topk_softmax(logits.reshape(M, N), top_k, renormalize, shared_slices=shared_slices)
        return logits, h, s, w_, ids
    _check_config(cfg, M)
    check(not cfg.dot and cfg.split_k == 1, op,
          f"the routing tail runs on the CUDA-core kernel without split K, got {cfg}")
    x2, r2 = x.reshape(1, K), None if residual is None else residual.reshape(1, K)
    width = top_k + shared_slices
    y = torch.empty((1, N), dtype=x.dtype, device=x.device)
    h = torch.empty((1, K), dtype=x.dtype, device=x.device)
    s = h if residual is None else torch.empty((1, K), dtype=x.dtype, device=x.device)
    weights = torch.empty((1, width), dtype=torch.float32, device=x.device)
    ids = torch.empty((1, width), dtype=torch.int64, device=x.device)
    pf = 0 if cfg.prefetch <= 0 else max(64, triton.next_power_of_2(min(cfg.prefetch, K)))
    pdl = dict(PDL=True, PF=pf, launch_pdl=True) if cfg.pdl and pdl_launch(x.device) else {}
    _gemv_norm_route_kernel[(triton.cdiv(N, cfg.block_n),)](
        x2, weight, y, N, K, weight.stride(0), x2 if r2 is None else r2, norm_weight, h, s, float(eps),
        _route_counter(x.device), weights, ids, E, BN=cfg.block_n, BK=cfg.block_k, HAS_RES=r2 is not None,
        ZC=bool(zero_centered), PK=min(triton.next_power_of_2(K), 2048), TOP_K=top_k, SLICES=shared_slices,
        KP=triton.next_power_of_2(width), EP=triton.next_power_of_2(E), RENORM=bool(renormalize),
        KEYS=bool(route_keys), num_warps=cfg.warps, num_stages=cfg.stages, **pdl)
    return (y.reshape(*lead, N), h.view(*lead, K), x if residual is None else s.view(*lead, K), weights, ids)


# ---- the gated output projection ------------------------------------------------------------------

@triton.jit
def _gemv_gated_kernel(x, g, nw, w, y, N, K, s_wn, eps,
                       BN: tl.constexpr, HB: tl.constexpr, HD: tl.constexpr, NORM: tl.constexpr,
                       SIGMOID: tl.constexpr, PDL: tl.constexpr = False, PF: tl.constexpr = 0):
    """y[n] = sum_k h[k] w[n, k] for one row of x (fp32 accumulation), h = act(g) * x, with NORM each head
    of HD values of x first scaled by its rsqrt(mean square + eps) and by nw; h rounded to x's dtype.
    A program owns BN weight rows and steps over K by HB whole heads ([BN, HB, HD] tiles), so the norm's
    statistics of a head are in the step that uses them."""
    pid = tl.program_id(0)
    rows = pid * BN + tl.arange(0, BN)
    row_ok = rows < N
    d = tl.arange(0, HD)
    if NORM:
        wn = tl.load(nw + d).to(tl.float32)  # a weight: may be read before the wait
    if PDL:
        _prefetch_weights(w, rows, row_ok, 0, K, s_wn, BN, PF)
        gdc_wait()                   # x and the gate belong to the kernels before us
        gdc_launch_dependents()
    kk = tl.arange(0, HB)[:, None] * HD + d[None, :]                      # [HB, HD]
    wp = w + rows[:, None, None].to(tl.int64) * s_wn + kk[None, :, :]
    acc = tl.zeros([BN, HB, HD], dtype=tl.float32)
    for k0 in range(0, K, HB * HD):
        k_ok = kk + k0 < K
        wt = tl.load(wp + k0, mask=row_ok[:, None, None] & k_ok[None, :, :], other=0.0).to(tl.float32)
        xv = tl.load(x + k0 + kk, mask=k_ok, other=0.0).to(tl.float32)
        gv = tl.load(g + k0 + kk, mask=k_ok, other=0.0).to(tl.float32)
        if NORM:
            xv = xv * tl.rsqrt(tl.sum(xv * xv, 1) / HD + eps)[:, None] * wn[None, :]
        if SIGMOID:
            xv = xv * sigmoid(gv)
        else:
            xv = xv * silu(gv)
        xv = xv.to(x.dtype.element_ty).to(tl.float32)   # the two-launch path's operand, rounded once
        acc += wt * xv[None, :, :]
    out = tl.sum(tl.sum(acc, 2), 1)
    tl.store(y + rows, out.to(y.dtype.element_ty), mask=row_ok)


# Rows up to which the GDN layer's step hands its gated norm to gated_linear (ops.fusion.gdn_out_proj, gdn_decode
# returning o before the norm): the fold below takes one row.
GATE_FOLD_MAX_ROWS = 1


def default_gated_config(M: int, N: int, K: int, head_dim: int | None) -> LinearConfig | None:
    """Tiles for gated_linear with the gate folded into the GEMV (head_dim: the norm's head size, None for
    a gate without norm), or None where the gate op runs as a launch of its own before `linear`. Measured
    on an H200 at the 35B-A3B shape, 4096 -> 2048, B = 1 (docs/PERFORMANCE.md, "Dense GEMV"):

    - with the norm (the GDN output): folded at M = 1. Every program re-reads x and the gate from L2
      (the same lines for all of them), so the plain GEMV's one-row tiles (2048 programs) made the fold
      5.6 us slower than the GEMV alone; 4 rows x 1024 columns at 3 stages (512 programs) made
      gdn_decode + out_proj 12.70 us against 14.13 unfolded. Where the plain tiles already hold >= 4 rows
      (N >= 2112: the 27B) they are kept (not timed with the fold).
    - without the norm (the attention output gate): folded at M = 1 on the same 4 x 1024 tiles, only where
      the plain tiles are one-row (the 35B): 7.83 us against 8.43 for sigmoid_mul + the GEMV (one-row tiles
      10.55, 2 x 2048 8.22, 8 x 512 9.06); elsewhere (the 27B) two launches, the fold untimed there.
    - never at M > 1 (the pre-norm fold measured ~2x slower there on the tensor-core kernel), nor for a
      head size that is not a power of two (a tile dimension)."""
    if M != 1 or (head_dim is not None and head_dim & (head_dim - 1)):
        return None
    cfg = default_linear_config(M, N, K)
    if cfg.block_n < 4:
        return LinearConfig(block_n=4, block_k=min(1024, triton.next_power_of_2(K)), warps=4, stages=3)
    return None if head_dim is None else cfg


def gated_linear(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, *, norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6, activation: str = "sigmoid", config: LinearConfig | None = None,
) -> torch.Tensor:
    """See reference.gated_linear. With tiles (default_gated_config: one row of x and a norm; or an explicit
    `config` with one row and no split K): one launch of _gemv_gated_kernel. Otherwise the gate op (sigmoid_mul,
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
    _check_config(cfg, M)
    check(M == 1 and not cfg.dot and cfg.split_k == 1, op,
          f"the folded gate takes one row of x on the CUDA-core kernel without split K, got {M} rows, {cfg}")
    if norm_weight is not None:
        check(D & (D - 1) == 0, op, f"the folded norm needs a power-of-two head size, got {D}")
        hd = D
    else:
        hd = min(cfg.block_k, 128)           # no heads: any split of the step into rows of the tile
    block_k = max(cfg.block_k, hd)           # whole heads per step
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    pf = 0 if cfg.prefetch <= 0 else max(64, triton.next_power_of_2(min(cfg.prefetch, K)))
    pdl = dict(PDL=True, PF=pf, launch_pdl=True) if cfg.pdl and pdl_launch(x.device) else {}
    _gemv_gated_kernel[(triton.cdiv(N, cfg.block_n),)](
        x.reshape(M, K), gate.reshape(M, K), x if norm_weight is None else norm_weight, weight, y, N, K,
        weight.stride(0), float(eps), BN=cfg.block_n, HB=block_k // hd, HD=hd, NORM=norm_weight is not None,
        SIGMOID=activation == "sigmoid", num_warps=cfg.warps, num_stages=cfg.stages, **pdl)
    return y.reshape(*lead, N)
