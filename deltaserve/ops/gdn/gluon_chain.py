"""The chunked prefill's state kernel (the chain over a sequence's chunks) in Gluon, for Hopper (sm_90).

The products and outputs of `triton_chain._chain_tma_kernel` on the chunk layout (W, P per chunk zero-padded to
64 rows, the padded K copy, the decay factors Cb / Lb, q read in place), behind the prep's buffers for a Gluon
chain (ChunkConfig.chain "gluon"; U as its factor's limbs). Per chunk, with S [K, BV] fp32 in registers:
    V_new = U - W S              (two bf16 limbs of S: W S_hi + W S_lo, fp32 accumulation)
    O     = (Q S_hi) e^G rq + P bf16(V_new)
    S    <- e^{G_last} S + K^T (V_new d)   (two limbs of V_new d), d = e^{G_last - G} rk
the "bf16x2" precision of the Triton kernels (every operand that carries the state is split into two bf16
limbs).

What Gluon buys over `tl.dot` (docs/PERFORMANCE.md):
- every warpgroup MMA is asynchronous and waited only where its result is needed, so the output products
  (Q S, P V_new) run in the shadow of the chain's own;
- warp specialisation: the columns of a state are independent recurrences, so a program's BV columns are
  split over two consumer warpgroups (BV / 2 each) fed by one TMA warp through a two-stage ring of
  ready / empty barriers, which also carries the decay factors (no global load on a consumer's path);
- U = hi V + lo V is formed here from the prep's two bf16 limbs of T diag(beta) and the chunk's v rows (the
  products the Triton prep's bf16x2 U makes, off the state's dependency chain), and whole chunks' K rows come
  from k itself (K_FROM_INPUT; a partial last chunk's from the prep's zero-padded copy);
- W and K^T, each the A operand of two products (one per limb), are read from shared memory into registers
  once: the products wait on shared-memory bandwidth more than on the tensor cores;
- a chunk's outputs are stored while the next chunk's first products run (a store in flight holds up the
  next shared-memory fence);
- a whole chunk's outputs leave through a TMA store of their shared-memory copy
  (whole 32-byte sectors, in the async proxy, so the next fence does not wait for them) instead of pointer
  stores from the accumulator layout (16-byte half sectors); a sequence's partial last chunk keeps the masked
  pointer store (the tile would overwrite the next sequence's rows).
"""

from __future__ import annotations

import functools
import os

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

CHUNK = 64
# (K, V) head dims and bf16 activations only: the layouts below are written for 128-wide tiles
DIMS = (128, 128)
BVS = (32,)  # state columns per program (two consumer warpgroups of 16)
STAGES = 2  # the ring's depth
CONSUMER_REGS = 232  # registers per consumer thread (setmaxnreg; the producer warp keeps 40)
SMEM_LIMIT = 232448  # bytes of shared memory one block may use on sm_90 (227 KiB)
SMEM_SLACK = 1024  # the compiler's padding beyond `smem_bytes` (sm_90 compiles: 392 - 520 B)


def supported(device: torch.device) -> bool:
    """Whether the Gluon chain can run here: a CUDA device of compute capability 9.0 (wgmma, TMA,
    setmaxnreg), not the Triton interpreter."""
    return (device.type == "cuda" and os.environ.get("TRITON_INTERPRET", "0") != "1"
            and torch.cuda.get_device_capability(device) == (9, 0))


@gluon.jit
def _load_stage(descs, bufs, bar, s, c, c0, bos, L, hv, hk, col, HK, HV, K: gl.constexpr, V: gl.constexpr,
                BT: gl.constexpr, NU: gl.constexpr, K_FROM_INPUT: gl.constexpr, pred):
    """TMA copies of chunk c (of a sequence of L tokens) into ring stage s, signalling `bar`: W, K, Q, P, the two
    limbs of U's factor, the NU column blocks of the chunk's v rows from `col`, the chunk's d / e^G rq rows and the
    row of e^{G_last} of its chunk (nothing when not pred).
    K_FROM_INPUT: a whole chunk's K rows from k itself, a partial last chunk's from the prep's zero-padded copy."""
    w_desc, u_desc, k_desc, q_desc, p_desc, c_desc, l_desc, v_desc, kr_desc = descs
    w_s, k_s, q_s, p_s, u_s, c_s, l_s, v_s = bufs
    BVC: gl.constexpr = v_desc.block_type.shape[1]
    LC: gl.constexpr = l_desc.block_type.shape[1]  # the e^{G_last} box: LC heads of 32 // LC chunks (128 bytes)
    NL: gl.constexpr = l_desc.block_type.shape[0] * LC
    nbytes: gl.constexpr = (3 * BT * K + 3 * BT * BT + NU * BT * BVC) * 2 + (2 * BT + NL) * 4
    ch = c0 + c
    hrow = ch * HV + hv
    mbarrier.expect(bar, nbytes, pred=pred)
    tma.async_copy_global_to_shared(w_desc, [hrow * BT, 0], bar, w_s.index(s), pred=pred)
    if K_FROM_INPUT:
        whole = L - c * BT >= BT
        tma.async_copy_global_to_shared(kr_desc, [bos + c * BT, hk * K], bar, k_s.index(s), pred=pred & whole)
        tma.async_copy_global_to_shared(k_desc, [(ch * HK + hk) * BT, 0], bar, k_s.index(s),
                                        pred=pred & (L - c * BT < BT))
    else:
        tma.async_copy_global_to_shared(k_desc, [(ch * HK + hk) * BT, 0], bar, k_s.index(s), pred=pred)
    tma.async_copy_global_to_shared(q_desc, [bos + c * BT, hk * K], bar, q_s.index(s), pred=pred)
    tma.async_copy_global_to_shared(p_desc, [hrow * BT, 0], bar, p_s.index(s), pred=pred)
    tma.async_copy_global_to_shared(u_desc, [hrow * BT, 0], bar, u_s.index(2 * s), pred=pred)
    tma.async_copy_global_to_shared(u_desc, [hrow * BT, BT], bar, u_s.index(2 * s + 1), pred=pred)
    for h in gl.static_range(NU):
        tma.async_copy_global_to_shared(v_desc, [bos + c * BT, hv * V + col + h * BVC], bar,
                                        v_s.index(s * NU + h), pred=pred)
    tma.async_copy_global_to_shared(c_desc, [hrow * 2, 0], bar, c_s.index(s), pred=pred)
    tma.async_copy_global_to_shared(l_desc, [ch, hv - hv % LC], bar, l_s.index(s), pred=pred)


@gluon.jit
def _store_rows(x, o, t0, left, hv, HV, rows, ov, V: gl.constexpr):
    """x ([BT, BV], output dtype) into rows t0 + i (i < left) of o ([T, HV, V]), head hv, columns ov."""
    tok = (t0 + rows).to(gl.int64)
    gl.store(o + tok[:, None] * (HV * V) + hv * V + ov[None, :], x, mask=(rows < left)[:, None] & (ov[None, :] >= 0))


@gluon.jit
def _issue_u(u_hi, u_lo, vs, left, rows, BT: gl.constexpr, BVC: gl.constexpr, acc_l: gl.constexpr):
    """U = hi V + lo V of a chunk from its ring stage, issued asynchronously, the v rows
    past the sequence (left < BT: they are the next sequence's, and 0 x inf = NaN) zeroed first."""
    if left < BT:
        x = vs.load(acc_l)
        vs.store(gl.where((rows < left)[:, None], x, gl.zeros_like(x)))
        fence_async_shared()
    u = warpgroup_mma(u_hi, vs, gl.zeros([BT, BVC], gl.float32, acc_l), is_async=True)
    return warpgroup_mma(u_lo, vs, u, is_async=True)


@gluon.jit
def _chunk_step(S, w_t, k_t, q_t, p_t, u, d, eq, decay, sh_s, sl_s, vn_s, dh_s, dl_s, prev, o, t0, left, hv, HV,
                rows, ov, V: gl.constexpr, BT: gl.constexpr, K: gl.constexpr, BV: gl.constexpr, acc_l: gl.constexpr,
                O_TILES: gl.constexpr, o_desc, o_buf, o_col):
    """One chunk of one warpgroup's chain on its [K, BV] state columns (module docstring): returns the new
    state and the chunk's [BT, BV] outputs. Every product it issues is waited for before it returns.
    The previous chunk's outputs (`prev`, already in the output dtype, rows t0 .. t0 + left of the sequence,
    nothing when left <= 0) are stored once this chunk's first products are issued: a store still in flight at
    a shared-memory fence holds the fence up, and here it has the W products' time to drain.
    W and K^T (each the A operand of two products, one per limb) are read from shared memory into registers
    once, instead of once per product (shared-memory bandwidth is what the products wait on). u is the
    accumulator of U's products, issued just before this step and waited for with W S (issuing them a chunk ahead,
    behind the previous chunk's products, measured slower on the H200). `prev` (then always a whole chunk: only a
    sequence's last chunk can be partial, and `_chain_columns` stores that one) is copied into o_buf (one of
    O_TILES shared-memory tiles per warpgroup) with the state's limbs, under the same fence, and leaves by a TMA
    store once the first products are issued; the store that read o_buf last (O_TILES chunks ago) is waited for
    first."""
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_l, k_width=2)
    w_t = w_t.load(a_l)
    zero_v = gl.zeros([BT, BV], gl.float32, acc_l)
    zero_s = gl.zeros([K, BV], gl.float32, acc_l)
    hi = S.to(gl.bfloat16)
    tma.store_wait(O_TILES - 1)
    o_buf.store(prev)
    sh_s.store(hi)
    sl_s.store((S - hi.to(gl.float32)).to(gl.bfloat16))
    fence_async_shared()
    a_v = warpgroup_mma(w_t, sh_s, zero_v, is_async=True)
    a_v = warpgroup_mma(w_t, sl_s, a_v, is_async=True)
    a_o = warpgroup_mma(q_t, sh_s, zero_v, is_async=True)
    if left > 0:
        tma.async_copy_shared_to_global(o_desc, [t0, o_col], o_buf)
    u, a_v = warpgroup_mma_wait(num_outstanding=1, deps=(u, a_v))  # U and W S done; Q S may still run

    vn = u - a_v
    vd = vn * d[:, None]
    dh = vd.to(gl.bfloat16)
    vn_s.store(vn.to(gl.bfloat16))
    dh_s.store(dh)
    dl_s.store((vd - dh.to(gl.float32)).to(gl.bfloat16))
    fence_async_shared()
    kt = k_t.permute((1, 0)).load(a_l)
    a_s = warpgroup_mma(kt, dh_s, zero_s, is_async=True)
    a_s = warpgroup_mma(kt, dl_s, a_s, is_async=True)
    a_p = warpgroup_mma(p_t, vn_s, zero_v, is_async=True)
    a_o, a_s = warpgroup_mma_wait(num_outstanding=1, deps=(a_o, a_s))  # the chain's product; P V_new may run
    S = S * decay + a_s
    a_p = warpgroup_mma_wait(num_outstanding=0, deps=(a_p, ))
    return S, a_o * eq[:, None] + a_p


@gluon.jit
def _chain_columns(HALF: gl.constexpr, NU: gl.constexpr, STAGES: gl.constexpr, bufs, scratch, ready, empty, o,
                   ssm, cu, idx, has_init, HV, K: gl.constexpr, V: gl.constexpr, BT: gl.constexpr,
                   O_TILES: gl.constexpr, o_desc, o_s):
    """One consumer warpgroup's chain over its sequence's chunks on state columns [col + HALF * BVC, + BVC) of the
    program's (sequence, value head): waits for each ring stage, runs `_chunk_step`, releases the stage to the
    producer (`empty`) and stores the chunk's outputs, then the final state. U = hi V + lo V from the stage's limbs
    of U's factor and the chunk's v rows (a partial last chunk's rows past the sequence zeroed first: they are the
    next sequence's, and 0 x inf = NaN). Whole chunks' outputs leave by TMA stores (o_desc: o as [T, HV * V] rows,
    [BT, BVC] tiles) from this warpgroup's O_TILES shared-memory tiles o_s[HALF * O_TILES + c % O_TILES]; a
    sequence's partial last chunk takes the masked pointer store (o_desc's tile would cover the next sequence's
    rows)."""
    w_s, k_s, q_s, p_s, u_s, c_s, l_s, v_s = bufs
    sh_s, sl_s, vn_s, dh_s, dl_s = scratch
    BVC: gl.constexpr = v_s.type.shape[2]
    LC: gl.constexpr = l_s.type.shape[2]
    NL: gl.constexpr = l_s.type.shape[1] * LC  # the stage's e^{G_last} box, flat: this head's at hv % LC
    acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                    instr_shape=[16, BVC, 16])
    rows_l: gl.constexpr = gl.SliceLayout(1, acc_l)
    cols_l: gl.constexpr = gl.SliceLayout(0, acc_l)
    one_l: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    flat_l: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
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
    col = j * (NU * BVC)
    ok = gl.arange(0, K, layout=rows_l)
    ov = col + HALF * BVC + gl.arange(0, BVC, layout=cols_l)
    o_col = hv * V + col + HALF * BVC  # the first of this warpgroup's columns in o's [T, HV * V] rows
    rows = gl.arange(0, BT, layout=rows_l)
    mine = gl.arange(0, NL, layout=one_l) == hv % LC
    sp = ssm + slot * (HV * K * V) + hv * (K * V) + ok[:, None] * V + ov[None, :]
    S = gl.load(sp, mask=(ok[:, None] >= 0) & (ov[None, :] >= 0) & (live & init), other=0.0)
    prev = gl.zeros([BT, BVC], o.dtype.element_ty, acc_l)  # the outputs not stored yet (none before chunk 0)
    for c in range(nch):
        s = c % STAGES
        mbarrier.wait(ready.index(s), (c // STAGES) & 1)
        u = _issue_u(u_s.index(2 * s), u_s.index(2 * s + 1), v_s.index(s * NU + HALF), L - c * BT, rows, BT, BVC,
                     acc_l)
        cf = c_s.index(s)._reinterpret(gl.float32, [2 * BT], flat_l)  # unswizzled: plain row-major rows
        d = cf.slice(0, BT).load(rows_l)
        eq = cf.slice(BT, BT).load(rows_l)
        decay = gl.sum(gl.where(mine, l_s.index(s)._reinterpret(gl.float32, [NL], flat_l).load(one_l), 0.0), axis=0)
        S, out = _chunk_step(S, w_s.index(s), k_s.index(s), q_s.index(s), p_s.index(s), u, d, eq, decay,
                             sh_s.index(HALF), sl_s.index(HALF), vn_s.index(HALF), dh_s.index(HALF),
                             dl_s.index(HALF), prev, o, bos + (c - 1) * BT, L - (c - 1) * BT + (c == 0) * (-L - BT),
                             hv, HV, rows, ov, V, BT, K, BVC, acc_l, O_TILES, o_desc,
                             o_s.index(HALF * O_TILES + c % O_TILES), o_col)
        # the stage's generic reads (U, factors) were ordered by the step's first fence and its products are
        # complete: release it to the producer
        mbarrier.arrive(empty.index(s), count=1)
        prev = gl.where(live, out, 0.0).to(o.dtype.element_ty)
    last = (nch > 0) * (L - (nch - 1) * BT)  # the last chunk's rows (0: no chunk)
    if last == BT:  # a whole chunk: its TMA tile holds only this sequence's rows
        o_last = o_s.index(HALF * O_TILES + nch % O_TILES)
        tma.store_wait(O_TILES - 1)
        o_last.store(prev)
        fence_async_shared()
        tma.async_copy_shared_to_global(o_desc, [bos + (nch - 1) * BT, o_col], o_last)
    else:
        _store_rows(prev, o, bos + (nch - 1) * BT, last, hv, HV, rows, ov, V)
    tma.store_wait(0)  # the tiles are read before the program's shared memory goes
    gl.store(sp, S, mask=(ok[:, None] >= 0) & (ov[None, :] >= 0) & (live & (L > 0)))


@gluon.jit
def _ws_load(descs, bufs, ready, empty, cu, coff, HK, HV, R: gl.constexpr, K: gl.constexpr, V: gl.constexpr,
             BT: gl.constexpr, STAGES: gl.constexpr, K_FROM_INPUT: gl.constexpr, NU: gl.constexpr = 2):
    """The producer: chunk after chunk, once every consumer released a stage, its copies (NU column blocks of v's
    rows, one per consumer; `gluon_chain_t` uses it too)."""
    j = gl.program_id(0)
    nh = gl.program_id(1)
    n = nh // HV
    hv = nh % HV
    bos = gl.load(cu + n)
    L = gl.load(cu + n + 1) - bos
    nch = gl.cdiv(L, BT)
    c0 = gl.load(coff + n)
    BVC: gl.constexpr = descs[7].block_type.shape[1]
    for c in range(nch):
        s = c % STAGES
        mbarrier.wait(empty.index(s), ((c // STAGES) & 1) ^ 1)  # a fresh barrier passes phase 1 at once
        _load_stage(descs, bufs, ready.index(s), s, c, c0, bos, L, hv, hv // R, j * (NU * BVC), HK, HV, K, V, BT, NU,
                    K_FROM_INPUT, True)


@gluon.jit
def _chain_kernel(w_desc, u_desc, k_desc, q_desc, p_desc, c_desc, l_desc, v_desc, kr_desc, o_desc, o, ssm, cu, coff,
                  idx, has_init, HK, HV, R: gl.constexpr, K: gl.constexpr, V: gl.constexpr, BT: gl.constexpr,
                  STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr, K_FROM_INPUT: gl.constexpr,
                  O_TILES: gl.constexpr, num_warps: gl.constexpr):
    """The program's 2 * BVC columns split over two consumer warpgroups (`_chain_columns`, HALF 0 / 1) fed by a
    producer warp (`_ws_load`) through ready / empty barriers. U from its factor's limbs (u_desc, [64, 64] bf16
    tiles) and v's rows (v_desc, [64, BVC] bf16 tiles). K_FROM_INPUT: whole chunks' K rows from k (kr_desc; k_desc
    otherwise, unused). Whole chunks' outputs by TMA stores through o_desc ([BT, BVC] tiles of o's [T, HV * V] rows)
    from O_TILES shared-memory tiles per warpgroup (2: a tile is rewritten two chunks after its store was issued;
    1 where shared memory is short)."""
    NU: gl.constexpr = 2
    BVC: gl.constexpr = v_desc.block_type.shape[1]
    s_lay: gl.constexpr = gl.NVMMASharedLayout.get_default_for([K, BVC], gl.bfloat16)
    v_lay: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BT, BVC], gl.bfloat16)
    u_buf = gl.allocate_shared_memory(gl.bfloat16, [STAGES * 2, BT, BT], u_desc.layout)
    v_buf = gl.allocate_shared_memory(gl.bfloat16, [STAGES * NU, BT, BVC], v_desc.layout)
    bufs = (gl.allocate_shared_memory(gl.bfloat16, [STAGES, BT, K], w_desc.layout),
            gl.allocate_shared_memory(gl.bfloat16, [STAGES, BT, K], k_desc.layout),
            gl.allocate_shared_memory(gl.bfloat16, [STAGES, BT, K], q_desc.layout),
            gl.allocate_shared_memory(gl.bfloat16, [STAGES, BT, BT], p_desc.layout),
            u_buf,
            gl.allocate_shared_memory(gl.float32, [STAGES, 2, BT], c_desc.layout),
            gl.allocate_shared_memory(gl.float32, [STAGES] + l_desc.block_type.shape, l_desc.layout),
            v_buf)
    # per consumer: the S limbs (B operand of W S and Q S), bf16(V_new) and the limbs of V_new d
    scratch = (gl.allocate_shared_memory(gl.bfloat16, [NU, K, BVC], s_lay),
               gl.allocate_shared_memory(gl.bfloat16, [NU, K, BVC], s_lay),
               gl.allocate_shared_memory(gl.bfloat16, [NU, BT, BVC], v_lay),
               gl.allocate_shared_memory(gl.bfloat16, [NU, BT, BVC], v_lay),
               gl.allocate_shared_memory(gl.bfloat16, [NU, BT, BVC], v_lay))
    o_s = gl.allocate_shared_memory(gl.bfloat16, [NU * O_TILES, BT, BVC], o_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)
    descs = (w_desc, u_desc, k_desc, q_desc, p_desc, c_desc, l_desc, v_desc, kr_desc)
    gl.warp_specialize([
        (_chain_columns, (0, 2, STAGES, bufs, scratch, ready, empty, o, ssm, cu, idx, has_init, HV, K, V,
                          BT, O_TILES, o_desc, o_s)),
        (_chain_columns, (1, 2, STAGES, bufs, scratch, ready, empty, o, ssm, cu, idx, has_init, HV, K, V,
                          BT, O_TILES, o_desc, o_s)),
        (_ws_load, (descs, bufs, ready, empty, cu, coff, HK, HV, R, K, V, BT, STAGES, K_FROM_INPUT)),
    ], [4, 1], [CONSUMER_REGS, 40])
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))
        mbarrier.invalidate(empty.index(i))


def heads_supported(hv: int) -> bool:
    """Whether the chain's TMA box of e^{G_last} (`lb_box`) fits hv value heads: Lb's [chunks, hv] fp32 rows
    16-byte aligned and the box exactly 128 bytes, as TMA needs of each ring stage's shared-memory address (a
    64-byte box at 16 heads put every second stage off that alignment: "misaligned address" on the H200)."""
    return hv % 4 == 0 and (hv >= 32 or 32 % hv == 0)


def lb_box(hv: int) -> list[int]:
    """The TMA box over Lb [chunks, hv] that a ring stage holds: 32 heads of one chunk, or, with fewer heads,
    all of them for 32 // hv chunks (only the first row is read)."""
    return [32 // min(hv, 32), min(hv, 32)]


@functools.cache
def shared_layout(block: tuple[int, ...], dtype) -> gl.NVMMASharedLayout:
    """The default NVMMA shared layout of a TMA box, built once per (box, dtype): building it costs ~15 us of host
    time, and every prefill step needs ~16 per GDN layer."""
    return gl.NVMMASharedLayout.get_default_for(list(block), dtype)


def _desc(t: torch.Tensor, block: list[int], dtype) -> TensorDescriptor:
    return TensorDescriptor.from_tensor(t, block, shared_layout(tuple(block), dtype))


def _rows_desc(x: torch.Tensor, cols: int) -> TensorDescriptor:
    """x [T, H, D] (heads contiguous, rows 16-byte aligned) read as [T, H * D] rows, [64, cols] tiles."""
    x2 = x.reshape(x.shape[0], -1)
    return TensorDescriptor(x2, list(x2.shape), [x2.stride(0), 1], [CHUNK, cols],
                            shared_layout((CHUNK, cols), gl.bfloat16))


def chain_descriptors(q: torch.Tensor, bufs: dict, bvc: int) -> tuple:
    """Host TMA descriptors of the chain's inputs from the prep's buffers for a Gluon chain (addresses and shapes
    only: CUDA-graph safe): U's factor as [64, 64] limb tiles, v's rows (bufs["v"]) as [64, bvc] tiles (the eighth)
    and, with bufs["k"] (whole chunks' K rows from k), k's rows as [64, K] tiles (the ninth; the K copy's
    otherwise)."""
    K = q.shape[2]
    HV = bufs["Lb"].shape[1]
    return (_desc(bufs["Wb"], [CHUNK, K], gl.bfloat16),
            _desc(bufs["Ub"], [CHUNK, CHUNK], gl.bfloat16),
            _desc(bufs["Kb"], [CHUNK, K], gl.bfloat16),
            _rows_desc(q, K),
            _desc(bufs["Pb"], [CHUNK, CHUNK], gl.bfloat16),
            _desc(bufs["Cb"].reshape(-1, CHUNK), [2, CHUNK], gl.float32),
            _desc(bufs["Lb"], lb_box(HV), gl.float32),
            _rows_desc(bufs["v"], bvc),
            _rows_desc(bufs["k"], K) if "k" in bufs else _desc(bufs["Kb"], [CHUNK, K], gl.bfloat16))


def smem_bytes(bv: int, o_tiles: int, stages: int = STAGES) -> int:
    """Shared memory of `_chain_kernel` at head dims DIMS, as it allocates it (the ring's stages, each consumer's
    scratch, o_tiles output tiles per consumer, the barriers), without the compiler's alignment padding."""
    K = DIMS[0]
    nu = 2
    bvc = bv // nu
    u = 2 * CHUNK * CHUNK * 2 + nu * CHUNK * bvc * 2
    stage = 3 * CHUNK * K * 2 + CHUNK * CHUNK * 2 + u + 2 * CHUNK * 4 + 32 * 4
    scratch = nu * (2 * K * bvc * 2 + 3 * CHUNK * bvc * 2)
    return stages * (stage + 16) + scratch + nu * o_tiles * CHUNK * bvc * 2


def output_tiles(bv: int, stages: int = STAGES) -> int:
    """Shared-memory output tiles per consumer for the TMA output stores: 2 (double-buffered by chunk parity) where
    they fit in SMEM_LIMIT, else 1, else 0 (no room)."""
    fits = [t for t in (2, 1) if smem_bytes(bv, t, stages) + SMEM_SLACK <= SMEM_LIMIT]
    return fits[0] if fits else 0


def launch_chain(q: torch.Tensor, o: torch.Tensor, bufs: dict, cu_seqlens: torch.Tensor, ssm_state: torch.Tensor,
                 state_indices: torch.Tensor, has_init: torch.Tensor, bv: int) -> None:
    """The chain on the chunk layout's prep buffers for a Gluon chain (`triton_prep.launch_prep`: U's factor limbs,
    bufs["v"], and bufs["k"] where whole chunks' K rows come from k), bv state columns per program, o contiguous
    (as the op allocates it)."""
    T, HK, K = q.shape
    HV, V = o.shape[1:]
    N = state_indices.shape[0]
    if "v" not in bufs or bv not in BVS or not o.is_contiguous():
        raise ValueError(f"the Gluon chain needs the prep buffers of a Gluon chain, bv in {BVS} and a contiguous "
                         f"output, got buffers {sorted(bufs)}, bv={bv}, output strides {o.stride()}")
    bvc = bv // 2
    descs = chain_descriptors(q, bufs, bvc)
    _chain_kernel[(V // bv, N * HV)](
        *descs, _rows_desc(o, bvc), o, ssm_state, cu_seqlens, bufs["coff"], state_indices, has_init, HK, HV,
        R=HV // HK, K=K, V=V, BT=CHUNK, STAGES=STAGES, CONSUMER_REGS=CONSUMER_REGS, K_FROM_INPUT="k" in bufs,
        O_TILES=output_tiles(bv), num_warps=4, maxnreg=168)
