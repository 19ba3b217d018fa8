"""The chunked prefill's chain with the state transposed and held in registers (Gluon, Hopper sm_90).

Same inputs as `gluon_chain` (the chunk layout's prep buffers for a Gluon chain: W, P, U's factor limbs, v's rows,
the decay factors; K rows from k or the padded copy), same products and precision (every operand that carries
the state in two bf16 limbs), computed transposed. A consumer warpgroup owns 64 state columns as X = S^T
[64, K] fp32 in registers, so every product that carries the state has it (or V_new) as the register A operand
and a chunk tile from the ring as the shared-memory B operand:
    V_new^T = V^T hi^T + V^T lo^T + (-X)_hi W^T + (-X)_lo W^T   (A: the v tile, transposed view, then -X's limbs;
                                                                 B: U's factor limbs transposed, then W^T)
    O^T     = -((-X)_hi Q^T) e^G rq + bf16(V_new^T) P^T
    X      <- e^{G_last} X + (V_new d)^T_hi K + (V_new d)^T_lo K,   d = e^{G_last - G} rk
The state never goes through shared memory (no store + proxy fence between the products of a step, as the
untransposed chain needs for its B operands) and the products are 64 x 64 / 64 x 128 tiles instead of
64 x 16 / 128 x 16. A wgmma's M is 64, so a consumer has 64 columns: a program is one (64 * NC columns,
sequence, value head), NC consumers fed through `gluon_chain`'s ring by its producer (`_ws_load`, here the default
partition, whose warps give their registers to the consumers).

V_new^T accumulates in U^T's registers, from the limbs of -X (negation is exact, so -X_hi Q^T is -(X_hi Q^T) bit
for bit): with U^T and X W^T in two accumulators ptxas had too few registers to pipeline the products and waited
for every wgmma before issuing the next (advisory C7512; tests/ops/test_gdn_gluon_chain_t.py now fails on it).
Pipelined, the chain alone is 1.06-1.20x faster with two consumers and 1.38x with one.

With two consumers (128 columns per program) its step is ~3.0-3.8 us against the untransposed chain's 1.8-1.9 for 32
columns, with one (64 columns) ~2.1-2.3 against 2.4-2.6 for the untransposed chain's 64: the one-consumer form
replaces the untransposed chain at 64 columns, the two-consumer form pays where (sequence, value head) programs fill
the SMs, and 32-column untransposed programs stay the fastest where one long sequence is the critical path; where
each is taken is `dispatch.chain_step_estimate`'s call (docs/PERFORMANCE.md).
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

from . import gluon_chain as gc

CHUNK = gc.CHUNK
COLS = 64  # state columns per consumer warpgroup (a wgmma's M)
BVS = (64, 128)  # state columns per program: one or two consumers


@gluon.jit
def _consumer(HALF: gl.constexpr, NC: gl.constexpr, STAGES: gl.constexpr, bufs, o_s, ready, empty, o, o_desc, ssm, cu,
              idx, has_init, HV, K: gl.constexpr, V: gl.constexpr, BT: gl.constexpr):
    """One consumer: state columns [j * NC * 64 + HALF * 64, + 64) of the program's (sequence, value head)."""
    w_s, k_s, q_s, p_s, u_s, c_s, l_s, v_s = bufs
    C: gl.constexpr = 64
    acc64: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16])
    acc128: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 128, 16])
    a64: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc64, k_width=2)
    a128: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc128, k_width=2)
    tok_l: gl.constexpr = gl.SliceLayout(0, acc64)  # along a [64 columns, 64 tokens] tile's tokens
    one_l: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    flat_l: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    blk: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])  # [tokens, columns] rows for pointer stores
    LC: gl.constexpr = l_s.type.shape[2]
    NL: gl.constexpr = l_s.type.shape[1] * LC
    j = gl.program_id(0)
    nh = gl.program_id(1)
    n = nh // HV
    hv = nh % HV
    bos = gl.load(cu + n)
    L = gl.load(cu + n + 1) - bos
    slot = gl.load(idx + n).to(gl.int64)
    live = slot >= 0
    init = gl.load(has_init + n) != 0
    nch = gl.cdiv(L, BT)
    col = j * (NC * C) + HALF * C
    oc = gl.arange(0, C, layout=gl.SliceLayout(1, acc128))
    ok = gl.arange(0, K, layout=gl.SliceLayout(0, acc128))
    # X[c, k] = S[k, col + c]
    sp = ssm + slot * (HV * K * V) + hv * (K * V) + ok[None, :] * V + (col + oc)[:, None]
    smask = (ok[None, :] >= 0) & (oc[:, None] >= 0)
    X = gl.load(sp, mask=smask & (live & init), other=0.0)
    mine = gl.arange(0, NL, layout=one_l) == hv % LC
    rows_b = gl.arange(0, BT, layout=gl.SliceLayout(1, blk))
    cols_b = gl.arange(0, C, layout=gl.SliceLayout(0, blk))
    toks = gl.arange(0, BT, layout=tok_l)
    zero64 = gl.zeros([C, BT], gl.float32, acc64)
    for c in range(nch):
        s = c % STAGES
        left = L - c * BT
        mbarrier.wait(ready.index(s), (c // STAGES) & 1)
        vs = v_s.index(s * NC + HALF)
        if left < BT:  # the v rows past the sequence are the next sequence's (0 x inf = NaN): zeroed
            xv = vs.load(blk)
            vs.store(gl.where((rows_b < left)[:, None], xv, gl.zeros_like(xv)))
            fence_async_shared()
        vt = vs.permute((1, 0))  # [64 columns, 64 tokens]
        vn = warpgroup_mma(vt, u_s.index(2 * s).permute((1, 0)), zero64, is_async=True)
        vn = warpgroup_mma(vt, u_s.index(2 * s + 1).permute((1, 0)), vn, is_async=True)
        # the limbs of -X, so that V_new^T = U^T - X W^T accumulates in U^T's registers (a second accumulator left
        # too few registers for ptxas to pipeline the products: it serialised every wgmma)
        xh = (-X).to(gl.bfloat16)
        xl = (-X - xh.to(gl.float32)).to(gl.bfloat16)
        xh_a = gl.convert_layout(xh, a64)
        xl_a = gl.convert_layout(xl, a64)
        wt = w_s.index(s).permute((1, 0))  # [K, 64 tokens]
        vn = warpgroup_mma(xh_a, wt, vn, is_async=True)
        vn = warpgroup_mma(xl_a, wt, vn, is_async=True)
        qs = warpgroup_mma(xh_a, q_s.index(s).permute((1, 0)), zero64, is_async=True)  # -(X_hi Q^T), exactly
        cf = c_s.index(s)._reinterpret(gl.float32, [2 * BT], flat_l)
        d = cf.slice(0, BT).load(tok_l)
        eq = cf.slice(BT, BT).load(tok_l)
        decay = gl.sum(gl.where(mine, l_s.index(s)._reinterpret(gl.float32, [NL], flat_l).load(one_l), 0.0), axis=0)
        vn, qs = warpgroup_mma_wait(num_outstanding=0, deps=(vn, qs))
        vd = vn * d[None, :]
        dh = vd.to(gl.bfloat16)
        dl = (vd - dh.to(gl.float32)).to(gl.bfloat16)
        X = X * decay
        X = warpgroup_mma(gl.convert_layout(dh, a128), k_s.index(s), X, is_async=True)
        X = warpgroup_mma(gl.convert_layout(dl, a128), k_s.index(s), X, is_async=True)
        pv = warpgroup_mma(gl.convert_layout(vn.to(gl.bfloat16), a64), p_s.index(s).permute((1, 0)), zero64,
                           is_async=True)
        X, pv = warpgroup_mma_wait(num_outstanding=0, deps=(X, pv))
        mbarrier.arrive(empty.index(s), count=1)  # every product that read the stage is complete
        out = gl.where(live, -qs * eq[None, :] + pv, 0.0).to(o.dtype.element_ty)  # O^T [64 columns, 64 tokens]
        ob = o_s.index(HALF * 2 + c % 2)
        tma.store_wait(1)  # the store that read this tile (two chunks ago) is done
        ob.permute((1, 0)).store(out)
        fence_async_shared()
        if left >= BT:
            tma.async_copy_shared_to_global(o_desc, [bos + c * BT, hv * V + col], ob)
        else:
            ot = ob.load(blk)
            tok = (bos + c * BT + rows_b).to(gl.int64)
            gl.store(o + tok[:, None] * (HV * V) + hv * V + col + cols_b[None, :], ot,
                     mask=(rows_b < left)[:, None] & (cols_b[None, :] >= 0))
    tma.store_wait(0)
    gl.store(sp, X, mask=smask & (live & (L > 0)))


@gluon.jit
def _chain_t_kernel(w_desc, u_desc, k_desc, q_desc, p_desc, c_desc, l_desc, v_desc, kr_desc, o_desc, o, ssm, cu, coff,
                    idx, has_init, HK, HV, R: gl.constexpr, K: gl.constexpr, V: gl.constexpr, BT: gl.constexpr,
                    STAGES: gl.constexpr, NC: gl.constexpr, K_FROM_INPUT: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                    num_warps: gl.constexpr):
    bufs = (gl.allocate_shared_memory(gl.bfloat16, [STAGES, BT, K], w_desc.layout),
            gl.allocate_shared_memory(gl.bfloat16, [STAGES, BT, K], k_desc.layout),
            gl.allocate_shared_memory(gl.bfloat16, [STAGES, BT, K], q_desc.layout),
            gl.allocate_shared_memory(gl.bfloat16, [STAGES, BT, BT], p_desc.layout),
            gl.allocate_shared_memory(gl.bfloat16, [STAGES * 2, BT, BT], u_desc.layout),
            gl.allocate_shared_memory(gl.float32, [STAGES, 2, BT], c_desc.layout),
            gl.allocate_shared_memory(gl.float32, [STAGES] + l_desc.block_type.shape, l_desc.layout),
            gl.allocate_shared_memory(gl.bfloat16, [STAGES * NC, BT, 64], v_desc.layout))
    o_s = gl.allocate_shared_memory(gl.bfloat16, [NC * 2, BT, 64], o_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=NC)
    descs = (w_desc, u_desc, k_desc, q_desc, p_desc, c_desc, l_desc, v_desc, kr_desc)
    # the producer is the default partition (its 4 warps give their registers to the consumers, which hold the
    # state and every product's accumulator)
    if NC == 2:
        gl.warp_specialize([
            (gc._ws_load, (descs, bufs, ready, empty, cu, coff, HK, HV, R, K, V, BT, STAGES, K_FROM_INPUT, NC)),
            (_consumer, (0, NC, STAGES, bufs, o_s, ready, empty, o, o_desc, ssm, cu, idx, has_init, HV, K, V, BT)),
            (_consumer, (1, NC, STAGES, bufs, o_s, ready, empty, o, o_desc, ssm, cu, idx, has_init, HV, K, V, BT)),
        ], [4, 4], [CONSUMER_REGS, CONSUMER_REGS])
    else:
        gl.warp_specialize([
            (gc._ws_load, (descs, bufs, ready, empty, cu, coff, HK, HV, R, K, V, BT, STAGES, K_FROM_INPUT, NC)),
            (_consumer, (0, NC, STAGES, bufs, o_s, ready, empty, o, o_desc, ssm, cu, idx, has_init, HV, K, V, BT)),
        ], [4], [CONSUMER_REGS])
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))
        mbarrier.invalidate(empty.index(i))


CONSUMER_REGS = 232  # registers per consumer thread (setmaxnreg): the state, its limbs and the accumulators


def maxnreg(consumers: int) -> int:
    """The kernel's register cap: what the producer's 4 warps and the consumers share out (65,536 per SM)."""
    return 168 if consumers == 2 else 248


def launch_chain_t(q: torch.Tensor, o: torch.Tensor, bufs: dict, cu_seqlens: torch.Tensor, ssm_state: torch.Tensor,
                   state_indices: torch.Tensor, has_init: torch.Tensor, consumers: int = 2, stages: int = 2) -> None:
    """The transposed chain on the chunk layout's prep buffers for a Gluon chain: 64 * consumers state columns per
    program."""
    T, HK, K = q.shape
    HV, V = o.shape[1:]
    N = state_indices.shape[0]
    if "v" not in bufs:
        raise ValueError("the transposed chain needs the prep buffers of a Gluon chain (U's factor limbs, v's rows)")
    if consumers not in (1, 2) or V != COLS * 2 or not o.is_contiguous():
        raise ValueError(f"the transposed chain takes 1 or 2 consumers, V = {COLS * 2} and a contiguous output, got "
                         f"{consumers}, V = {V}, output strides {o.stride()}")
    descs = gc.chain_descriptors(q, bufs, COLS)
    bv = COLS * consumers
    _chain_t_kernel[(V // bv, N * HV)](
        *descs, gc._rows_desc(o, COLS), o, ssm_state, cu_seqlens, bufs["coff"], state_indices, has_init, HK, HV,
        R=HV // HK, K=K, V=V, BT=CHUNK, STAGES=stages, NC=consumers, K_FROM_INPUT="k" in bufs,
        CONSUMER_REGS=CONSUMER_REGS,
        num_warps=4, maxnreg=maxnreg(consumers))
