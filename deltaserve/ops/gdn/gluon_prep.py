"""The chunked prefill's prep kernel in Gluon, for Hopper (sm_90): per (chunk, value head) the q / k norms, G,
P, the UT inverse T, W, U's factor limbs and the decay factors, into the chunk layout's buffers, the same bits as
the Triton prep it replaces (`triton_prep._prep_wide_kernel` behind a Gluon chain) on every buffer (H200: every
case of tests/ops/test_gdn_gluon_prep.py bit-identical).

Why Gluon for the same arithmetic: every product is an asynchronous warpgroup MMA waited for only where its result
is used, k's and q's tiles are in flight together, so the scalar work (gates, the G scan, the decay tile) runs in
the shadow of the loads and the tensor cores (H200, CUDA-graph replay: 1 x 32768 17.3 -> 14.0 ns/token,
benchmarks/gdn_kernels.py "ours: prep kernel").

How it keeps Triton's bits: the layouts are the ones Triton chose for `_prep_wide_kernel` (its TTGIR at 4 warps,
maxnreg 168): NVMMA v3 accumulators, register A operands of k_width 2 for the inverse and W, 128-byte swizzled
shared tiles, and the 1-D BlockedLayout([1], [32], [4], [0]) of g / G (the scan's association order depends on
it); the elementwise expressions are written in the same order (the same roundings and FMA contractions, e.g.
Pm = (Q K^T * rq) * E, A = (K K^T * (beta rk)) * E). Differences with no effect on values: A is rounded to fp16
once (fp16(where(m, A, 0)) = where(m, fp16(A), 0)); beta along columns is the row slice's beta moved there (Triton
loads it again); output tiles reuse dead shared memory (W in q's tile, U's limbs in the inverse's operand tiles).

Two program bodies, as the Triton kernel: a chunk whose 64 rows all belong to its sequence reads k / q by TMA
with no row masks (with GATES this matters: LLVM contracts the gate's product into the scan's first addition
there, as in Triton's TMA body); a sequence's partial last chunk and the grid's padding programs fill the same
tiles by masked pointer loads (zeros past the sequence: a TMA tile would carry the next sequence's rows, and
0 x inf is NaN), so one launch covers every chunk.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ..triton_common import next_pow2
from .gluon_chain import shared_layout

CHUNK = 64
DIMS = (128, 128)  # (K, V): the layouts are written for 128-wide k / q rows
LOG2E = gl.constexpr(1.4426950408889634)


@gluon.jit
def _add(a, b):
    return a + b


@gluon.jit
def _softplus(x):
    """triton_common.softplus (the same expression)."""
    y = gl.exp(-gl.abs(x))
    u = 1.0 + y
    log1p = gl.where(u == 1.0, y, gl.log(u) * (y / gl.where(u == 1.0, 1.0, u - 1.0)))
    return gl.where(x > 20.0, x, gl.maximum(x, 0.0) + log1p)


@gluon.jit
def _sigmoid(x):
    return 1.0 / (1.0 + gl.exp(-x))


@gluon.jit
def _gate_col(g, beta, s_g_t, s_b_t, A_log, dt_bias, t0, rows, left, hv, GATES: gl.constexpr, WHOLE: gl.constexpr):
    """`triton_prep._gates` in the layout of `rows`: (g, beta) of the chunk's rows for head hv, zeros from row
    `left` on. WHOLE (every row in the sequence): no masks, as in the Triton kernel's TMA body after LLVM proved
    them true there (its branch condition left >= 64): this matters with GATES, where LLVM then contracts the
    gate's product into the scan's first addition (an FMA in the TMA body, not in the pointer body: sm_90 PTX)."""
    tok = (t0 + rows).to(gl.int64)
    if WHOLE:
        av = gl.load(g + tok * s_g_t + hv).to(gl.float32)
        bv = gl.load(beta + tok * s_b_t + hv).to(gl.float32)
    else:
        m = rows < left
        av = gl.load(g + tok * s_g_t + hv, mask=m, other=0.0).to(gl.float32)
        bv = gl.load(beta + tok * s_b_t + hv, mask=m, other=0.0).to(gl.float32)
    if GATES:
        gv = -gl.exp(gl.load(A_log + hv).to(gl.float32)) * _softplus(av + gl.load(dt_bias + hv).to(gl.float32))
        bv = _sigmoid(bv)
    else:
        gv = av
    if not WHOLE:
        gv = gl.where(m, gv, 0.0)
        bv = gl.where(m, bv, 0.0)
    return gv, bv


@gluon.jit
def _join_mask(ri, rj, s: gl.constexpr):
    """triton_ut.join_mask: rows in the lower s-half, columns in the upper s-half of each diagonal 2s-block."""
    i = ri[:, None]
    j = rj[None, :]
    return ((i ^ j) < 2 * s) & ((i & s) != 0) & ((j & s) == 0)


@gluon.jit
def _level(X, A, ri, rj, x_s, c_s, s: gl.constexpr, mma: gl.constexpr, BT: gl.constexpr):
    """One doubling level of triton_ut.ut_inverse_wide ("fp16"): X <- X - fp16(fp16(X) fp16(C)) fp16(X), C the
    level's join blocks of A, here already in fp16 (A is live across the whole inverse: half the registers)."""
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    x16 = X.to(gl.float16)
    x_s.store(x16)
    c_s.store(gl.where(_join_mask(ri, rj, s), A, 0.0))  # fp16(where(m, A, 0)) = where(m, fp16(A), 0)
    fence_async_shared()
    zero = gl.zeros([BT, BT], gl.float32, mma)
    xc = warpgroup_mma(gl.convert_layout(x16, a_l), c_s, zero, is_async=True)
    xc = warpgroup_mma_wait(num_outstanding=0, deps=(xc, ))
    y = warpgroup_mma(gl.convert_layout(xc.to(gl.float16), a_l), x_s, zero, is_async=True)
    y = warpgroup_mma_wait(num_outstanding=0, deps=(y, ))
    return X - y


@gluon.jit
def _fill_rows(dst, ptr, t0, left, s_t, off, BT: gl.constexpr, K: gl.constexpr, ld_l: gl.constexpr):
    """Rows t0 .. t0 + BT of a [T, ., K] projection (zeros from row `left` on) into the shared tile dst, by masked
    pointer loads (`triton_ut.load_chunk_rows`: int64 chunk base, int32 offsets inside it)."""
    r = gl.arange(0, BT, layout=gl.SliceLayout(1, ld_l))
    c = gl.arange(0, K, layout=gl.SliceLayout(0, ld_l))
    base = ptr + t0.to(gl.int64) * s_t + off
    x = gl.load(base + r[:, None] * s_t + c[None, :], mask=(r < left)[:, None] & (c[None, :] >= 0), other=0.0)
    dst.store(x)


@gluon.jit(do_not_specialize=["N"])
def _prep_kernel(k_desc, q_desc, w_desc, u_desc, p_desc, kb_desc, k, q, s_k_t, s_k_h, s_q_t, s_q_h,
                 g, beta, s_g_t, s_b_t, A_log, dt_bias, coff, cu, N, Cb, Lb, scale, HK, HV,
                 R: gl.constexpr, K: gl.constexpr, BT: gl.constexpr, BLOCK_N: gl.constexpr, L2NORM: gl.constexpr,
                 GATES: gl.constexpr, HEADS_FIRST: gl.constexpr, K_FROM_INPUT: gl.constexpr,
                 num_warps: gl.constexpr):
    """One program per (chunk, value head) over the grid of `_prep_wide_kernel` (cdiv(T, 64) + N chunks, the
    padding programs past the last chunk storing what the Triton kernel stores there): norms, gates, G, P, A, the
    fp16 wide UT inverse T, W = (T diag(beta e^G rk)) K (bf16x2: two bf16 limbs of T' against the exact bf16 K),
    U's factor T diag(beta) as two bf16 limbs, the decay factors (Cb, Lb) and, where the chain needs it, the
    zero-padded K copy (every chunk unless K_FROM_INPUT; a sequence's partial last chunk always). Two bodies, as
    the Triton kernel: a whole chunk's (TMA loads, no row masks) and a partial / padding chunk's (masked pointer
    loads)."""
    gl.static_assert(num_warps == 4, "one warpgroup per program")
    p = gl.program_id(1 if HEADS_FIRST else 0)
    hv = gl.program_id(0 if HEADS_FIRST else 1)
    one_l: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    # locate_chunk (triton_common): sequence n, chunk p - cstart inside it; padding programs get n = N, bos = eos = 0
    offs = gl.arange(0, BLOCK_N, layout=one_l)
    mn = offs < N
    cend = gl.load(coff + offs + 1, mask=mn, other=0)
    n = gl.sum(((cend <= p) & mn).to(gl.int32), 0)
    valid = n < N
    cstart = gl.load(coff + n, mask=valid, other=0)
    bos = gl.load(cu + n, mask=valid, other=0)
    eos = gl.load(cu + n + 1, mask=valid, other=0)
    t0 = bos + (p - cstart) * BT
    left = eos - t0

    f16_lay: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BT, BT], gl.float16)
    k_s = gl.allocate_shared_memory(gl.bfloat16, [BT, K], k_desc.layout)
    q_s = gl.allocate_shared_memory(gl.bfloat16, [BT, K], q_desc.layout)  # later W's output tile
    p_s = gl.allocate_shared_memory(gl.bfloat16, [BT, BT], p_desc.layout)
    x_s = gl.allocate_shared_memory(gl.float16, [BT, BT], f16_lay)  # later U's hi limb
    c_s = gl.allocate_shared_memory(gl.float16, [BT, BT], f16_lay)  # later U's lo limb
    bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(bars.index(0), count=1)
    mbarrier.init(bars.index(1), count=1)
    tiles = (k_s, q_s, p_s, x_s, c_s, bars)
    # all 64 rows in the sequence: TMA (a partial chunk's tile would carry the next sequence's rows, and 0 x inf)
    if left >= BT:
        _prep_body(k_desc, q_desc, w_desc, u_desc, p_desc, kb_desc, k, q, s_k_t, s_k_h, s_q_t, s_q_h, g, beta,
                   s_g_t, s_b_t, A_log, dt_bias, Cb, Lb, scale, HK, HV, p, hv, t0, left, tiles, R, K, BT, L2NORM,
                   GATES, K_FROM_INPUT, True)
    else:
        _prep_body(k_desc, q_desc, w_desc, u_desc, p_desc, kb_desc, k, q, s_k_t, s_k_h, s_q_t, s_q_h, g, beta,
                   s_g_t, s_b_t, A_log, dt_bias, Cb, Lb, scale, HK, HV, p, hv, t0, left, tiles, R, K, BT, L2NORM,
                   GATES, K_FROM_INPUT, False)
    mbarrier.invalidate(bars.index(0))
    mbarrier.invalidate(bars.index(1))


@gluon.jit
def _prep_body(k_desc, q_desc, w_desc, u_desc, p_desc, kb_desc, k, q, s_k_t, s_k_h, s_q_t, s_q_h, g, beta,
               s_g_t, s_b_t, A_log, dt_bias, Cb, Lb, scale, HK, HV, p, hv, t0, left, tiles, R: gl.constexpr,
               K: gl.constexpr, BT: gl.constexpr, L2NORM: gl.constexpr, GATES: gl.constexpr, K_FROM_INPUT: gl.constexpr,
               WHOLE: gl.constexpr):
    """The program of chunk rows t0 .. t0 + 64 (`left` of them in the sequence) and value head hv (`_prep_kernel`);
    WHOLE: left >= 64 (k / q by TMA, no row masks), else masked pointer loads (zeros past the sequence)."""
    k_s, q_s, p_s, x_s, c_s, bars = tiles
    hk = hv // R
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BT, 16])
    mma1: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, K, 16])
    row_l: gl.constexpr = gl.SliceLayout(1, mma)
    col_l: gl.constexpr = gl.SliceLayout(0, mma)
    one_l: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    ld_l: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
    a1_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma1, k_width=2)

    if WHOLE:
        mbarrier.expect(bars.index(0), BT * K * 2)
        tma.async_copy_global_to_shared(k_desc, [t0, hk * K], bars.index(0), k_s)
        mbarrier.expect(bars.index(1), BT * K * 2)
        tma.async_copy_global_to_shared(q_desc, [t0, hk * K], bars.index(1), q_s)
    else:
        _fill_rows(k_s, k, t0, left, s_k_t, hk * s_k_h, BT, K, ld_l)
        _fill_rows(q_s, q, t0, left, s_q_t, hk * s_q_h, BT, K, ld_l)
        fence_async_shared()

    # the gates while the tiles are in flight: g / G in the 1-D layout of Triton's scan, beta in the row slice
    rg = gl.arange(0, BT, layout=one_l)
    ri = gl.arange(0, BT, layout=row_l)
    rj = gl.arange(0, BT, layout=col_l)
    gv, _b0 = _gate_col(g, beta, s_g_t, s_b_t, A_log, dt_bias, t0, rg, left, hv, GATES, WHOLE)
    _g1, bt_r = _gate_col(g, beta, s_g_t, s_b_t, A_log, dt_bias, t0, ri, left, hv, GATES, WHOLE)

    if WHOLE:
        mbarrier.wait(bars.index(0), 0)
    zero = gl.zeros([BT, BT], gl.float32, mma)
    kt = k_s.permute((1, 0))
    KK = warpgroup_mma(k_s, kt, zero, is_async=True)
    if WHOLE:
        mbarrier.wait(bars.index(1), 0)
    QQ = warpgroup_mma(q_s, q_s.permute((1, 0)), zero, is_async=True)
    QK = warpgroup_mma(q_s, kt, zero, is_async=True)
    KK = warpgroup_mma_wait(num_outstanding=2, deps=(KK, ))
    eye = ri[:, None] == rj[None, :]
    if L2NORM:
        rk = gl.rsqrt(gl.sum(gl.where(eye, KK, 0.0), axis=1) + 1e-6)
    else:
        rk = gl.zeros([BT], gl.float32, row_l) + 1.0
    G = gl.associative_scan(gv, 0, _add)
    lcol = gl.log2(rk)
    G2 = G * LOG2E
    G2r = gl.convert_layout(G2, row_l)
    ge = ri[:, None] >= rj[None, :]
    E = gl.exp2(gl.where(ge, G2r[:, None] - gl.convert_layout(G2r - lcol, col_l)[None, :], float("-inf")))
    QQ = warpgroup_mma_wait(num_outstanding=1, deps=(QQ, ))
    if L2NORM:
        rq = gl.rsqrt(gl.sum(gl.where(eye, QQ, 0.0), axis=1) + 1e-6) * scale
    else:
        rq = (gl.zeros([BT], gl.float32, row_l) + 1.0) * scale

    # the chunk layout's factors (triton_prep._store_chunk_factors)
    ch = p.to(gl.int64) * HV + hv
    g_last = gl.sum(gl.where(rg == BT - 1, G, 0.0), 0)
    d = gl.convert_layout(gl.exp(g_last - G), row_l) * rk
    if not WHOLE:
        d = gl.where(ri < left, d, 0.0)
    gl.store(Cb + ch * (2 * BT) + rg, gl.convert_layout(d, one_l))
    gl.store(Cb + ch * (2 * BT) + BT + rg, gl.convert_layout(gl.convert_layout(gl.exp(G), row_l) * rq, one_l))
    gl.store(Lb + ch, gl.exp(g_last))

    hrow = (p * HV + hv) * BT
    QK = warpgroup_mma_wait(num_outstanding=0, deps=(QK, ))
    Pm = QK * rq[:, None] * E
    p_s.store(Pm.to(gl.bfloat16))  # leaves with the other tiles at the end (see there)

    A = gl.where(ri[:, None] > rj[None, :], KK * (bt_r * rk)[:, None] * E, 0.0)
    X = gl.where(eye, 1.0, -gl.where(_join_mask(ri, rj, 1), A, 0.0))
    A = A.to(gl.float16)
    X = _level(X, A, ri, rj, x_s, c_s, 2, mma, BT)
    X = _level(X, A, ri, rj, x_s, c_s, 4, mma, BT)
    X = _level(X, A, ri, rj, x_s, c_s, 8, mma, BT)
    X = _level(X, A, ri, rj, x_s, c_s, 16, mma, BT)
    X = _level(X, A, ri, rj, x_s, c_s, 32, mma, BT)

    # W = (T diag(beta e^G rk)) K, T' in two bf16 limbs (lo first: tl.dot(hi, b, tl.dot(lo, b)))
    Tw = X * gl.convert_layout(bt_r * gl.exp2(G2r) * rk, col_l)[None, :]
    hi = Tw.to(gl.bfloat16)
    lo = (Tw - hi.to(gl.float32)).to(gl.bfloat16)
    W = warpgroup_mma(gl.convert_layout(lo, a1_l), k_s, gl.zeros([BT, K], gl.float32, mma1), is_async=True)
    W = warpgroup_mma(gl.convert_layout(hi, a1_l), k_s, W, is_async=True)
    # U's factor T diag(beta) as two bf16 limbs, into the inverse's operand tiles (its last products are done)
    # beta along columns: Triton loads (and with GATES activates) it again in that layout, the same values; moved
    # here from the row layout, it holds 2 registers across the inverse instead of 16
    Tu = X * gl.convert_layout(bt_r, col_l)[None, :]
    uh = Tu.to(gl.bfloat16)
    ul = (Tu - uh.to(gl.float32)).to(gl.bfloat16)
    uh_s = x_s._reinterpret(gl.bfloat16, [BT, BT], u_desc.layout)
    ul_s = c_s._reinterpret(gl.bfloat16, [BT, BT], u_desc.layout)
    uh_s.store(uh)
    ul_s.store(ul)
    W = warpgroup_mma_wait(num_outstanding=0, deps=(W, ))
    q_s.store(W.to(gl.bfloat16))  # q's tile is dead (Q Q^T, Q K^T done)
    # Every TMA store is issued here, at the end, with nothing that allocates shared memory between them and the
    # wait: the compiler's allocator reuses a buffer's memory after the buffer's last use in the program (here the
    # store that reads it), so a tile stored earlier (P) could be overwritten by a later allocation (A's tile,
    # layout-conversion scratch) while the TMA engine still reads it.
    fence_async_shared()
    tma.async_copy_shared_to_global(p_desc, [hrow, 0], p_s)
    tma.async_copy_shared_to_global(u_desc, [hrow, 0], uh_s)
    tma.async_copy_shared_to_global(u_desc, [hrow, BT], ul_s)
    tma.async_copy_shared_to_global(w_desc, [hrow, 0], q_s)
    # the chain's zero-padded K rows (a copy of the tile), by one value head of each key head: every chunk's, or
    # with K_FROM_INPUT (the chain reads whole chunks from k) a partial chunk's only
    if not (K_FROM_INPUT and WHOLE):
        if hv % R == 0:
            tma.async_copy_shared_to_global(kb_desc, [(p * HK + hk) * BT, 0], k_s)
    tma.store_wait(0)  # the tiles are read before the program's shared memory goes


def _nvmma_desc(x: torch.Tensor, shape: list[int], strides: list[int], block: list[int], dtype) -> TensorDescriptor:
    return TensorDescriptor(x, shape, strides, block, shared_layout(tuple(block), dtype))


def _rows(x: torch.Tensor) -> TensorDescriptor:
    """x [T, H, D] read as [T, H * D] rows (heads contiguous, 16-byte aligned rows), [64, D] tiles."""
    return _nvmma_desc(x, [x.shape[0], x.shape[1] * x.shape[2]], [x.stride(0), 1], [CHUNK, x.shape[2]], gl.bfloat16)


def _whole(x: torch.Tensor, cols: int) -> TensorDescriptor:
    return _nvmma_desc(x, list(x.shape), [x.stride(0), 1], [CHUNK, cols], gl.bfloat16)


def prep_descriptors(q: torch.Tensor, k: torch.Tensor, bufs: dict) -> tuple:
    """The prep's TMA descriptors (host-built, addresses and shapes only: CUDA-graph safe): k / q rows, W / U-limb /
    P / K-copy output tiles."""
    return (_rows(k), _rows(q), _whole(bufs["Wb"], k.shape[2]), _whole(bufs["Ub"], CHUNK), _whole(bufs["Pb"], CHUNK),
            _whole(bufs["Kb"], k.shape[2]))


def covers(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, l2norm: bool, tma_rows) -> bool:
    """Whether this kernel runs the call: bf16 at head dims DIMS, the in-kernel q / k L2 norms (without them the
    Triton prep takes a tf32 inverse, not ported) and q / k / v rows TMA can read (`tma_rows`)."""
    return (q.dtype == torch.bfloat16 and (q.shape[2], v.shape[2]) == DIMS and l2norm
            and all(tma_rows(x) for x in (q, k, v)))


def launch_prep(q: torch.Tensor, k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, gates_in_kernel: bool,
                A_log: torch.Tensor | None, dt_bias: torch.Tensor | None, scale: float, cu_seqlens: torch.Tensor,
                N: int, bufs: dict, k_in_chain: bool, heads_first: bool, maxnreg: int) -> None:
    """Fill the chunk layout's prep buffers (`triton_prep.launch_prep`: Wb, Ub as U's factor limbs, Pb, Kb, Cb,
    Lb, coff) over the Triton prep's grid: (value heads, chunks) heads-first up to 65535 chunks, else (chunks,
    value heads). k_in_chain: the K copy only for partial / padding chunks."""
    _, HK, K = q.shape
    HV = g.shape[1]
    C = bufs["Lb"].shape[0]
    dummy = bufs["Lb"]
    _prep_kernel[(HV, C) if heads_first else (C, HV)](
        *prep_descriptors(q, k, bufs), k, q, k.stride(0), k.stride(1), q.stride(0), q.stride(1),
        g, beta, g.stride(0), beta.stride(0), A_log if gates_in_kernel else dummy,
        dt_bias if gates_in_kernel else dummy, bufs["coff"], cu_seqlens, N, bufs["Cb"], bufs["Lb"], float(scale),
        HK, HV, R=HV // HK, K=K, BT=CHUNK, BLOCK_N=max(16, next_pow2(N)), L2NORM=True, GATES=bool(gates_in_kernel),
        HEADS_FIRST=heads_first, K_FROM_INPUT=bool(k_in_chain), num_warps=4,
        **({"maxnreg": maxnreg} if maxnreg else {}))
