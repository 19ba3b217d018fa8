"""Triton chunked prefill of the gated delta rule (same signature as reference.chunk_gated_delta_rule),
in two launches (FLA: five + fills):

1. `_chunk_prep_tc_kernel` ("prep"), one program per (chunk of 64 tokens, value head), on whole-chunk
   tiles: the q/k inverse norms, the gates (optionally from their pre-activations), the chunk-local
   cumulative log decay G, P = scale * (Q^ K^T * exp(G_i - G_j)) on and below the diagonal (zeros
   above), A = strictly_lower(diag(beta) K^ K^T * exp(G_i - G_j)) and the UT transform T = (I + A)^-1,
   which never leaves registers: W = T diag(beta exp(G) rk) K (stored in the state kernel's operand
   dtype) and U = T diag(beta) V (stored fp32). The inverse is formed by recursive doubling, every step
   X <- X - X C X (C: the block of A joining two inverse blocks of size s into one of 2s; no power
   series, so nothing grows and cancels): levels 1-8 on the four 16 x 16 diagonal blocks as one batched
   exact-fp32 problem, the 32- and 64-wide joins as tensor-core products (tf32, ChunkConfig.merge_prec).
   W and U take T as two bf16 limbs (~16 mantissa bits) against the exact bf16 rows of K and V
   (wu_prec "bf16x2"; FLA rounds T, W and U to bf16), optionally in column slices (wu_cols). The L2
   norms are never materialised on q and k:
   the raw rows are exact dot operands and the norms scale the products.
   ChunkConfig.solve = "subst" keeps the earlier prep: a solve kernel (16 x 16 diagonal blocks by
   forward substitution, merges by tensor-core products) storing T, then `_chunk_wu_kernel` (split_prep)
   or 16-row W/U blocks in the solve kernel; 1.3-1.6x slower in total.
2. `_chunk_state_kernel`, one program per (sequence, value head, V-slice), walks the sequence's chunks
   in order with the fp32 state slice S in registers. Two dependent products per chunk:
     V_new = U - W S;   S <- exp(G_last) S + K^T (exp(G_last - G) * rk * V_new)
   and, off that chain, O = exp(G) * rq * scale * (Q S) + P V_new. The initial state is read from the
   pool slot (or zero) and the final state written back in place. ChunkConfig.state_t runs the same
   recurrence on S^T (`_chunk_state_t_kernel`): the state-dependent operands become register A operands.

Default for bf16 at head dims 128 (session 7, `default_chunk_config`): the prep forms T by the whole-tile
inverse in fp16 products with the lean factors (`triton_ut`; ChunkConfig ut / ut_prec / lean) and stores its
products per chunk, zero-padded (ChunkConfig.layout "chunk"), and `_chunk_state_tma_kernel` reads them through
TMA descriptors. Elsewhere the block inverse and the token layout above. The GPU refuses bf16 / fp16 at head
dims outside DEVICE_VERIFIED_DIMS (non-finite outputs on the H200 at 16 / 32).

3. Optional (ChunkConfig.split_output, FLA's chunk_fwd_h / chunk_fwd_o split; not the default): the state
   kernel keeps only the chain (`_chunk_state_split_kernel`) and stores, per chunk, the state it started
   the chunk with (h_c, [cdiv(T, 64) + N, HV, K, V], indexed by the chunk's global index) and V_new
   ([T, HV, V]), both in the dtype the output products round them to (bf16 for bf16 / bf16x2), and
   `_chunk_out_kernel`, one program per (chunk, value head, ChunkConfig.bv_out columns), computes
   O = exp(G) * rq * (Q h_c) + P V_new from them: the same products of the same operands as kernel 2.

Operand precision of kernel 2 (ChunkConfig.prec), always with fp32 accumulation and an fp32 state:
"bf16x2" (default for bf16 activations) splits the fp32 operands of the state chain (S in W S, V_new in
K^T V_new) into two bf16 limbs (hi + lo, ~16 mantissa bits) against the bf16 W / K, on bf16 tensor cores
at twice the MMA count; the output products (Q S, P V_new) use one limb (the output is bf16). "bf16"
rounds S and V_new to bf16 once (FLA's precision); "tf32" and "ieee" (exact fp32, the fp32-activation
default) keep W and P in fp32.

Loads that feed products carry only row masks (constant along the contiguous dimension): P is stored
with explicit zeros above the diagonal instead of being masked element-wise on load. (An earlier bf16
state kernel with a third in-loop product and triangle-masked tile loads computed wrong values on the
H200 while exact under the interpreter; this structure is verified there, docs/PERFORMANCE.md.)

Exactness: no contribution is truncated; chunks never cross sequence boundaries; padding rows are
masked before any exp so no inf or NaN can arise. Host work is shape-only (grid bounds from T and N),
so the op is CUDA-graph capturable: the chunk -> (sequence, chunk) map is computed inside the prep.
"""

from __future__ import annotations

import dataclasses
import types

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from ..triton_common import (
    check, check_head_dim, check_index, check_last_contiguous, check_pool, check_same_device, chunk_offsets,
    locate_chunk, next_pow2, sigmoid, softplus,
)
from . import gluon_chain, gluon_chain_t, gluon_prep
from .reference import check_max_seqlen
from .triton_ut import LOG2E, decay_tile, load_chunk_rows, rstd_from_gram, ut_inverse_wide

CHUNK = 64
PRECISIONS = ("bf16x2", "bf16", "tf32", "ieee")
MERGE_PRECISIONS = ("tf32x3", "tf32", "ieee")
SOLVES = ("tc", "subst")
DIAG_PRECISIONS = ("ieee", "tf32")
UT_FORMS = ("blocks", "wide")
UT_PRECISIONS = ("fp16", "tf32")
LAYOUTS = ("token", "chunk")
# The chain (state kernel) behind the chunk layout: "triton" (`_chunk_state_tma_kernel`) or "gluon"
# (`gluon_chain`, Hopper only: asynchronous wgmma, warp-specialised, bf16 at head dims 128, bv 32 or 64).
CHAINS = ("triton", "gluon", "gluon_t")
# (K, V) head dims at which the chunk layout's TMA state kernel and the prep's whole-tile inverse / lean
# factors are verified on the H200 (session 7: bitwise equal to the token layout at 128; at K = 16 / V = 32
# the TMA kernel's compiled products were wrong there and a wide-inverse prep faulted, while both are exact
# under the interpreter), so CUDA devices refuse the others.
CHUNK_LAYOUT_DIMS = ((128, 128),)
# Head dims at which the bf16 / fp16 chunked prefill is verified on the H200 (session 7: at 16 and 32 its
# outputs were non-finite there, already at the session's start, while exact under the interpreter; 64 and
# 128 pass the device tests). CUDA devices refuse the others (fp32 activations, all fp32 FMA products,
# passed at 16 / 32); triton_registry falls back to the reference op for such models at load.
DEVICE_VERIFIED_DIMS = (64, 128)


@dataclasses.dataclass(frozen=True)
class ChunkConfig:
    """Launch and precision choices of the chunked prefill.

    bv: state columns per program of the state kernel; warps_* / stages_state: launch shapes; prec:
    operand precision of the state kernel's products (module docstring), one of PRECISIONS.
    solve: "tc" forms the whole prep (P, the UT inverse by tensor-core doubling, W, U) in one kernel
    (`_chunk_prep_tc_kernel`, warps_tc); "subst" is the earlier forward-substitution solve kernel, whose
    layout the next two fields choose: split_prep: W and U formed by a second prep kernel from the
    stored inverse (whole-chunk tensor-core products) instead of from 16-row blocks in the solve kernel;
    p_in_wu: P formed there too. merge_prec: precision of the inverse's off-diagonal block products
    ("tf32x3" ~ fp32, or "tf32" as FLA). The 16 x 16 diagonal blocks are always exact fp32 (forward
    substitution, or the batched doubling products in fp32 FMA). wu_prec (tc, bf16 activations): W and U
    as "bf16x2" (T in two bf16 limbs against the exact bf16 K / V rows) or "tf32" (one tf32 rounding of
    both); maxnreg_tc: register cap of the tc kernel (0: the compiler's choice); wu_cols: columns per
    W / U product of the tc kernel (0: all of K / V in one product; 64 halves its accumulators and shared
    memory, so a register cap of 168 spills less); diag_prec: precision of the batched 16 x 16
    diagonal-block doubling of the inverse ("ieee" exact fp32 FMA, or "tf32" tensor cores, as the joins);
    state_t: the transposed state kernel (`_chunk_state_t_kernel`: S^T and V_new^T as register A operands).
    ut (tc prep, UT_FORMS): "blocks" forms the inverse as above (batched 16 x 16 diagonal blocks, then
    the joins); "wide" runs every doubling level on the whole 64 x 64 tile (`triton_ut.ut_inverse_wide`:
    one layout, no block extraction or reassembly) with ut_prec products (UT_PRECISIONS: "fp16"
    operands, exact-range with the in-kernel key norms, else "tf32"; exact fp32 for fp32 activations).
    lean (tc prep): the q and k norms from the diagonals of the Q Q^T and K K^T products (in the products'
    layout; the key norms folded into the decay tile's exponent), G by a scan, the decays by exp2, int32
    row offsets for the loads (`triton_ut`), instead of row sums, a masked 64 x 64 row sum and exp.
    split_output (FLA's chunk_fwd_h / chunk_fwd_o split; untransposed state kernel only): the state kernel
    (`_chunk_state_split_kernel`) keeps only the chain V_new = U - W S, S <- ... and stores, per chunk, the
    state it started the chunk with (h_c) and V_new, in the dtype the default kernel's output products round
    them to (bf16 for the bf16 / bf16x2 precisions, else fp32), so the outputs are the same products of the
    same operands; `_chunk_out_kernel`, one program per (chunk, value head, bv_out columns; warps_out
    warps), then forms O = e^G rq (Q h_c) + P V_new fully in parallel.
    layout (LAYOUTS): "token" stores the prep's products per token ([T, HV, ...], read with row masks by the
    state kernel); "chunk" stores them per chunk, zero-padded to 64 rows ([chunks, HV, 64, ...], plus a
    zero-padded copy of K and the per-row decay factors), so that `_chunk_state_tma_kernel` reads whole
    tiles through TMA descriptors: no masks, no per-element address arithmetic in the chain.
    hoist (lean tc prep with the wide inverse and full-width W / U, PREP8): every global load of a prep program
    (k, q, the gates, v) issued before its first product, instead of each before its use.
    heads_first (tc prep, PREP8): the prep's grid is (value heads, chunks) instead of (chunks, value heads), so
    the programs of one chunk run together and re-read its q / k rows and gate lines from L2; for at most
    65535 chunks (the grid's second dimension), else the usual order.
    tma_load (hoist prep, PREP8 "tma-r168", sessions 8-9): the k / q / v tiles of a prep program arrive by TMA
    straight into shared memory (no register round trip), for row strides / bases TMA accepts (16-byte aligned,
    contiguous heads), else the pointer loads; and only in chunks whose 64 rows all belong to the sequence: a
    sequence's partial last chunk takes the pointer loads (zeros past its end), since TMA's tile would carry the
    next sequence's rows into the products, where a zero weight does not remove an inf / NaN (0 x inf), so one
    request's non-finite activations could reach another's W / U (tests/ops/test_gdn_isolation.py).
    tma_store (hoist prep): in the chunk layout, W, U and P leave through TMA stores from their accumulators'
    shared-memory copies instead of a shared-memory layout change to coalesced stores (the token layout's
    rows are strided and masked: pointer stores there).
    chain (layout "chunk", CHAINS): the state kernel behind the chunk layout: "triton" or "gluon"
    (`gluon_chain.launch_chain`: the same products, the state bit for bit; bv / 2 columns per consumer
    warpgroup; session 8: 23.4-24.3 / 18.2-19.9 ns/token at 1 x 32768 / 4 x 8192 against 30.9 / 26.8), or
    "gluon_t" (`gluon_chain_t.launch_chain_t`, u_in_chain and o_tma only: the same products with the state
    transposed in registers, bv / 64 consumers of 64 columns; fp32 rounding away from the others, final states
    within ~1e-5 of their largest entry, the 8k error against the fp32 recurrence the same; session 14: at 64 columns
    faster than "gluon" at 64 at every batch measured, at 128 the fastest where (sequence, value head) programs fill
    the SMs).
    u_in_chain (hoist prep, chunk layout, bf16x2): the prep stores U's factor T diag(beta) as two bf16 limbs
    (16 KB per chunk and value head) instead of U in fp32 (32 KB) and does not read v; the chain forms
    U = hi V + lo V from them and the chunk's rows of v (two more tensor-core products per chunk, off the
    state's dependency chain): the same products as the prep's bf16x2 U, ~16 KB per token less HBM traffic.
    k_in_chain (TMA prep, chunk layout): the chain reads a whole chunk's K rows from k itself (TMA, as it reads q)
    instead of the prep's zero-padded copy, which the prep then writes only for a sequence's partial last chunk
    (where k's tile would carry the next sequence's rows): a pointer load and a 16 KB store per chunk and key head
    less in the prep. Where the prep cannot read k by TMA (ChunkConfig.tma_load's conditions) it has no effect.
    o_tma (chain "gluon"): the chain stores a whole chunk's outputs by TMA from a shared-memory copy of the tile
    (whole sectors, in the async proxy, so the next shared-memory fence does not wait for them) instead of pointer
    stores from the accumulator layout (ncu, 1 x 32768: half of their sectors excessive); a sequence's partial last
    chunk keeps the masked pointer store (the tile would overwrite the next sequence's rows). Same values bit for
    bit; 2 shared-memory tiles per consumer where they fit (bv 32), else 1 (bv 64 with u_in_chain).
    gluon_prep (a device that runs the Gluon chain): the prep is the Gluon kernel (`gluon_prep`: the same buffers
    bit for bit, its products asynchronous) wherever it covers the call: the TMA prep with u_in_chain (tma_load,
    tma_store, u_in_chain) and `gluon_prep.covers` (bf16 at head dims 128, the in-kernel q / k L2 norms, q / k / v
    rows TMA can read); elsewhere the Triton prep runs, whose values these are.
    """

    bv: int = 32
    warps_prep: int = 2
    warps_state: int = 4
    stages_state: int = 0
    prec: str = "bf16x2"
    split_prep: bool = True
    warps_wu: int = 4
    p_in_wu: bool = False
    merge_prec: str = "tf32"
    solve: str = "tc"
    warps_tc: int = 4
    wu_prec: str = "bf16x2"
    maxnreg_tc: int = 0
    wu_cols: int = 0
    diag_prec: str = "ieee"
    ut: str = "blocks"
    ut_prec: str = "fp16"
    lean: bool = False
    state_t: bool = False
    split_output: bool = False
    bv_out: int = 64
    warps_out: int = 4
    layout: str = "token"
    hoist: bool = False
    heads_first: bool = False
    tma_load: bool = False
    tma_store: bool = False
    chain: str = "triton"
    u_in_chain: bool = False
    k_in_chain: bool = False
    o_tma: bool = False
    gluon_prep: bool = False

    def state_stages(self) -> int:
        """Pipeline depth of the state kernel; 0 means 3 with bf16 operand tiles and slices of <= 32
        columns, else 2 (3 stages of fp32 W / P tiles, of 64-column slices, or of the u_in_chain inputs (U's
        factor limbs and v's rows: 246,904 B at 32 columns, run S12-F) exceed the H200's 227 KiB of shared
        memory). One stage (no pipelining) is refused for the untransposed kernel: on the H200 it computed wrong
        values (32 columns) or faulted (16 columns), session-4 run 1. (The Gluon chain keeps its own ring.)"""
        return self.stages_state or (3 if self.prec.startswith("bf16") and self.bv <= 32 and not self.u_in_chain
                                     else 2)


# Whole-op candidates for the bf16 default, named as the benchmark and the GPU tests report them. The first
# five take the prep with W / U in 64-column slices under a 168-register cap (3 programs per SM
# instead of 2) and the transposed state kernel (S^T and V_new^T as register operands); the bv32 / bv16
# ones are for one long sequence (narrow slices are what fills the SMs), bv64 / bv128 for batches with
# >= 128 (sequence, value head) pairs; "cand-bv64-cols64" is that prep with the untransposed bv64 kernel.
# Session 5 (H200, 1 x 32768, same run): default 77.4 ns/token, cand-t-bv32 112.3, cand-t-bv32-w8 91.5,
# cand-t-bv16 109.8, so none is the default there (the transposed kernel's mma.sync products, 176 per warp
# and chunk at 4 warps, lose to the untransposed kernel's wgmma); the batch ones are not timed yet.
CANDIDATES = types.MappingProxyType({
    "cand-t-bv32": ChunkConfig(wu_cols=64, maxnreg_tc=168, state_t=True, bv=32, stages_state=3),
    "cand-t-bv32-w8": ChunkConfig(wu_cols=64, maxnreg_tc=168, state_t=True, bv=32, warps_state=8, stages_state=3),
    "cand-t-bv16": ChunkConfig(wu_cols=64, maxnreg_tc=168, state_t=True, bv=16, stages_state=3),
    "cand-t-bv64": ChunkConfig(wu_cols=64, maxnreg_tc=168, state_t=True, bv=64, stages_state=2),
    "cand-t-bv128-w8": ChunkConfig(wu_cols=64, maxnreg_tc=168, state_t=True, bv=128, warps_state=8,
                                   stages_state=2),
    "cand-bv64-cols64": ChunkConfig(wu_cols=64, maxnreg_tc=168, bv=64),
    # Session 6: each verified prep variant with the DEFAULT state kernel of the shape's class (untransposed;
    # bv32 with 3 stages for one sequence, bv64 with 2 for batches; "cand-bv64-cols64" above is the batch
    # form of cols64-r168): the register cap alone, the 64-column W / U slices under 168 or 128 registers,
    # and the slices with the tf32 diagonal blocks. Session 6 (H200, same run; default 77.3 / 72.8 ns/token at
    # 1 x 32768 / 4 x 8192): all slower, the capped preps' spills cost more than the third or fourth program
    # per SM gains (prep alone 38.4 default, r168 45.0, cols64-r168 41.6, +diag tf32 39.6, cols64-r128 49.2);
    # whole op cand-cols64-r168-dtf32 78.3 / 74.3, the closest. r168 and the slices change no arithmetic
    # (results bitwise equal to the default prep's on the device).
    "cand-r168": ChunkConfig(maxnreg_tc=168),
    "cand-cols64-r168": ChunkConfig(wu_cols=64, maxnreg_tc=168),
    "cand-cols64-r128": ChunkConfig(wu_cols=64, maxnreg_tc=128),
    "cand-cols64-r168-dtf32": ChunkConfig(wu_cols=64, maxnreg_tc=168, diag_prec="tf32"),
    "cand-bv64-r168": ChunkConfig(maxnreg_tc=168, bv=64),
    "cand-bv64-cols64-r128": ChunkConfig(wu_cols=64, maxnreg_tc=128, bv=64),
    "cand-bv64-cols64-r168-dtf32": ChunkConfig(wu_cols=64, maxnreg_tc=168, diag_prec="tf32", bv=64),
    # Session 6 (chunk7), not timed yet: the default prep with FLA's split of the state kernel
    # (split_output): the chain alone (h_c and V_new stored in bf16, the operands the default's output
    # products round to, so the outputs are the same products) plus the parallel output kernel, with
    # bv_out columns per output program (64: 2 programs per (chunk, head); 128: one, q and P read once).
    # sm_90 compile (benchmarks/gdn_compile_check.py, 4 warps unless named): chain bv32 s3 220 regs / 129 KiB
    # smem (1 program per SM, 128 programs at 1 x 32768, as the default's 255 regs / 202 KiB), bv16 s2 160 /
    # 77 KiB (2 per SM: 256 programs in one wave), bv64 s2 255 + 34 spill stores / 113 KiB, bv64 w8 s3 243 /
    # 161 KiB no spills, bv32 s2 210 / 89 KiB (2 per SM); output kernel bv_out 64: 62 regs / 48 KiB, 128: 114 /
    # 72 KiB; all wgmma.
    "cand-bv32-split": ChunkConfig(split_output=True, bv=32),
    "cand-bv16-split": ChunkConfig(split_output=True, bv=16, stages_state=2),
    "cand-bv32-split-o128": ChunkConfig(split_output=True, bv=32, bv_out=128),
    "cand-bv64-split": ChunkConfig(split_output=True, bv=64),
    "cand-bv64-split-w8": ChunkConfig(split_output=True, bv=64, warps_state=8, stages_state=3),
    "cand-bv32s2-split": ChunkConfig(split_output=True, bv=32, stages_state=2),
    # Session 7: the chunk layout (W, U, P, K per chunk, zero-padded, read by the state kernel through TMA
    # descriptors; the same products as the default). sm_90 compile: bv32 s3 182 regs / 206 KiB smem, 986
    # SASS instructions in the chunk loop against the default kernel's 1187 (ncu, session 7: the default's
    # loop is issue-bound at one warp per scheduler, 21 % of it IMAD, mostly load addressing); bv64 s2 255
    # regs + 5 spill stores / 164 KiB; bv32 s2 186 / 140 KiB.
    "cand-chunk-bv32": ChunkConfig(layout="chunk", bv=32),
    "cand-chunk-bv32s2": ChunkConfig(layout="chunk", bv=32, stages_state=2),
    "cand-chunk-bv64": ChunkConfig(layout="chunk", bv=64),
})
# Session 7 (prep7): the prep's arithmetic in fewer instructions, each on the default state kernel of the shape
# (the benchmark times "prep7 <name>: prep kernel" alone and "ours prep7 <name>" whole, with the shape's default
# config and these prep fields, PREP7_FIELDS). sm_90 SASS per warp, chunk layout (benchmarks/gdn_compile_check.py):
# default prep 5969 instructions, 250 registers (2 programs per SM), 1200 FFMA; wide-fp16-lean 3065 / 243;
# wide-tf32-lean 4107 / 231 (its register operands re-laid out by shuffles); wide-fp16-nolean 4654 / 237;
# lean-blocks 4642 / 240; under 168 registers (3 per SM): wide-fp16-lean 3288 with 17 spill stores (the beta
# column held across the inverse, stored and loaded once), with 64-column W / U slices 3262 with 30. H200 (run
# prep7-1, docs/PERFORMANCE.md), prep alone at 1 x 32768: default 39.7 ns/token, wide-fp16-lean 26.3,
# wide-tf32-lean 30.8, wide-fp16-nolean 30.5, lean-blocks 34.5, -r168 27.6, -cols64-r168 27.9.
PREP7 = types.MappingProxyType({
    "wide-fp16-lean": ChunkConfig(ut="wide", ut_prec="fp16", lean=True),
    "wide-tf32-lean": ChunkConfig(ut="wide", ut_prec="tf32", lean=True),
    "wide-fp16-nolean": ChunkConfig(ut="wide", ut_prec="fp16"),
    "lean-blocks": ChunkConfig(lean=True),
    "wide-fp16-lean-r168": ChunkConfig(ut="wide", ut_prec="fp16", lean=True, maxnreg_tc=168),
    "wide-fp16-lean-cols64-r168": ChunkConfig(ut="wide", ut_prec="fp16", lean=True, wu_cols=64, maxnreg_tc=168),
    # not timed yet: the 64-column W / U slices without a cap (3007 instructions, 235 registers, no spills)
    "wide-fp16-lean-cols64": ChunkConfig(ut="wide", ut_prec="fp16", lean=True, wu_cols=64),
})
# The ChunkConfig fields a PREP7 entry sets (the rest comes from the shape's default configuration).
PREP7_FIELDS = ("ut", "ut_prec", "lean", "wu_cols", "maxnreg_tc")


def prep7_config(name: str, base: ChunkConfig) -> ChunkConfig:
    """`base` (the shape's configuration) with the prep fields of PREP7[name], and without the session-8 prep
    changes (PREP8_FIELDS: the PREP7 entries are measured on the session-7 prep), so without the chain inputs
    that need the hoist / TMA prep (u_in_chain, k_in_chain; a transposed chain, which needs u_in_chain, becomes the
    untransposed Gluon chain on 64-column slices)."""
    chain = dict(chain="gluon", bv=64) if base.chain == "gluon_t" else {}
    return dataclasses.replace(base, **{f: getattr(PREP7[name], f) for f in PREP8_FIELDS}, u_in_chain=False,
                               k_in_chain=False, **chain)


# Session 8 (prep8): the bf16 default prep (PREP7 "wide-fp16-lean") with its latency cut, each on the default state
# kernel of the shape ("prep8 <name>: prep kernel" alone and "ours prep8 <name>" whole in the benchmark; fields
# PREP8_FIELDS). ncu (session 8, 1 x 32768): the default prep runs 2 programs (8 warps) per SM (243 registers), issues
# on 25 % of the cycles, and 37 % of its stall samples are long-scoreboard waits, mostly its shared-memory stores of
# just-loaded rows: it issues each global load where it is used, so a program waits on four memory round trips in a
# row (k; the gates after K K^T; q; v after the inverse), and its grid runs all chunks of one value head before the
# next, so the two value heads of a key head read q / k (and the gate lines, which hold all 32 heads of a token)
# from DRAM ~513 programs apart (L2 hit rate 55 %). hoist: every load first (k, q, the gates, v; v staged in shared
# memory at once); heads_first: the grid (HV, chunks), the 32 heads of a chunk side by side (L2 hit rate 69 %);
# maxnreg_tc=168: 3 programs per SM. The same products of the same operands in the same order: buffers bitwise equal
# to the default prep's (H200 and interpreter). sm_90 SASS per warp (benchmarks/gdn_compile_check.py, chunk layout,
# 4 warps): default 3080 instructions / 243 registers / 32 KiB smem; heads the same; hoist-heads 3000 / 209 / 49 KiB;
# hoist-heads-r168 3248 / 168 with 22 spill stores (scalars held across the inverse). H200 (run prep8-1,
# docs/PERFORMANCE.md), prep alone at 1 x 32768 / 4 x 8192 ns/token: default 26.3 / 26.4, heads 25.5 / 25.6,
# hoist-heads 24.8 / 24.9, hoist-heads-r168 22.1 / 22.2 (whole op 52.3 / 48.9 against 56.6 / 53.1). Measured and
# dropped (docs/PERFORMANCE.md): the inverse's five join operands staged before its first product (25.7: 80 KiB of
# shared memory, no gain), a persistent grid of 2 programs per SM with Triton's pipeliner prefetching the next
# tile (28.3: 255 registers and 58 spill stores, the loop holding its invariant masks live); compiled and dropped
# before the device: one program per key head for its 2 value heads (K K^T and Q K^T held across both: 255
# registers, 107 spill stores), and the caps below 168 (r160 44 spill stores, r128 254).
# Session 9 (prep10): the two steps before hoist-heads-r168 ("heads": the grid alone; "hoist-heads": + the loads
# first, no cap) were dropped from the dict (superseded; their numbers above); it holds the session-8 default and the
# TMA form.
PREP8 = types.MappingProxyType({
    "hoist-heads-r168": ChunkConfig(ut="wide", ut_prec="fp16", lean=True, hoist=True, heads_first=True,
                                    maxnreg_tc=168),
    # Session 8 (prep9): hoist-heads-r168 with TMA (ChunkConfig.tma_load / tma_store): H200 (runs prep9-1/2), prep
    # alone at 1 x 32768 / 4 x 8192 ns/token 19.7 / 20.0 against 22.3 / 22.5 (whole op with the Gluon chain 45.4 /
    # 39.3 against 47.3 / 41.5), buffers bitwise equal to the session-7 prep's; then the k / q / v tile of a
    # sequence's partial last chunk carried the next sequence's rows into the products (0 x inf = NaN across
    # requests). Session 9 (prep10): such a chunk takes the pointer loads (a second program body behind one branch;
    # tests/ops/test_gdn_isolation.py). sm_90 SASS per warp (chunk layout, 4 warps): the TMA body 2656 instructions
    # with 5 spill stores (prep9: 2856 / 7; its row masks are gone: every row of a TMA tile is the sequence's), the
    # pointer body 18 (both bodies in one kernel: 168 registers, 49 KiB of shared memory, which the bodies
    # share). Measured and dropped in session 8 (prep9, docs/PERFORMANCE.md): the TMA stores alone ("tma-store-
    # r168", 22.6 / 22.7), no register cap ("tma": 2 programs per SM, 26.3 / 26.3); not timed: r128 (239 spill
    # stores in the two bodies).
    "tma-r168": ChunkConfig(ut="wide", ut_prec="fp16", lean=True, hoist=True, heads_first=True, maxnreg_tc=168,
                            tma_load=True, tma_store=True),
})
# The ChunkConfig fields a PREP8 entry sets (the rest comes from the shape's default configuration).
PREP8_FIELDS = PREP7_FIELDS + ("hoist", "heads_first", "tma_load", "tma_store")
# The bf16 default prep at head dims 128 (default_chunk_config), as those fields.
PREP8_DEFAULT = types.MappingProxyType({f: getattr(PREP8["tma-r168"], f) for f in PREP8_FIELDS})


def prep8_config(name: str, base: ChunkConfig) -> ChunkConfig:
    """`base` (the shape's configuration) with the prep fields of PREP8[name]; base's k_in_chain only where that
    prep reads k by TMA (tma_load), the one prep that leaves whole chunks' K copy to the chain."""
    prep = PREP8[name]
    return dataclasses.replace(base, **{f: getattr(prep, f) for f in PREP8_FIELDS},
                               k_in_chain=base.k_in_chain and prep.tma_load)


# The chunk-layout candidates, as (one-sequence, batch) CANDIDATES names.
CHUNK_LAYOUT = types.MappingProxyType({
    "one": ("cand-chunk-bv32", "cand-chunk-bv32s2"),
    "many": ("cand-chunk-bv64", "cand-chunk-bv32"),
})
# The split-output candidates, as (one-sequence, batch) CANDIDATES names.
SPLIT_OUTPUT = types.MappingProxyType({
    "one": ("cand-bv32-split", "cand-bv16-split", "cand-bv32-split-o128"),
    "many": ("cand-bv64-split", "cand-bv64-split-w8", "cand-bv32s2-split"),
})
# The session-6 prep variants on the default state kernel, as (one-sequence, batch) CANDIDATES names.
PREP_ON_DEFAULT_STATE = types.MappingProxyType({
    "r168": ("cand-r168", "cand-bv64-r168"),
    "cols64-r168": ("cand-cols64-r168", "cand-bv64-cols64"),
    "cols64-r128": ("cand-cols64-r128", "cand-bv64-cols64-r128"),
    "cols64-r168-dtf32": ("cand-cols64-r168-dtf32", "cand-bv64-cols64-r168-dtf32"),
})


# Microseconds per chunk step of a Gluon chain program on the H200, as (chain, bv) -> us: the whole op less its prep
# over the chunks of the longest program (session 14, runs S14-E / S14-F: the untransposed chain at 32 columns 1.82-1.89
# us at 1 x 32768, 4 x 8192 and 8192 + 3 x 128; the transposed chain at 64 columns (one consumer) 2.1-2.3 at 1 x 32768,
# 2 x 16384, 2 x 8192 and 8192 + 4096, at 128 (two consumers) 3.0 with 64 programs, 3.4-3.8 with the SMs full). The
# untransposed chain at 64 columns (2.4-2.6 us, the same programs as the transposed one's) is not a candidate: slower
# than the one-consumer transposed chain at every batch of S14-F. A program is one CTA per SM, so the chain's time is
# its programs' chunk steps packed into waves of `sms` (chain_step_estimate). Runs S14-C (27 batches, 16 / 32 / 48 /
# 64 value heads, one to 32 sequences, balanced and skewed) and S14-F (15 more with the one-consumer transposed chain):
# the estimate's pick was the fastest or within 1.6 % of it in every one.
CHAIN_STEP_US = types.MappingProxyType({("gluon", 32): 1.85, ("gluon_t", 64): 2.25, ("gluon_t", 128): 3.4})


def chain_step_estimate(chain: str, bv: int, num_v_heads: int, v: int, tokens: int, max_seqlen: int,
                        sms: int) -> float:
    """Estimated microseconds of a Gluon chain over a batch known only by its token count and longest length: the
    batch taken as k = tokens // max_seqlen sequences of the longest length (the critical path: their programs in
    waves of `sms`, one CTA per SM) plus the remaining tokens as short work filling spare slots, and no less than
    all programs' chunk steps spread over the SMs. Ranks the chains as measured (session 14, run S14-F, whole op,
    ns/token, 32 / 64 / 128 columns: 8192 + 3 x 128 42.5 / 47.4 / 59.2; 2 x 16384 40.9 / 30.9 / 36.8; 4 x 8192 41.9
    / 31.6 / 28.9; 1 x 32768 41.4 / 46.2 / 57.8; 2 x 8192 + 2 x 1024 40.7 / 31.3 / 35.1)."""
    step = CHAIN_STEP_US[(chain, bv)]
    programs = num_v_heads * (v // bv)  # per sequence
    longest = triton.cdiv(max_seqlen, CHUNK)
    k = max(tokens // max(max_seqlen, 1), 1)
    rest = max(tokens - k * max_seqlen, 0) / CHUNK
    critical = longest * triton.cdiv(k * programs, sms)
    spread = (k * longest + rest) * programs / sms
    return step * max(critical, spread)




def default_chunk_config(num_seqs: int, num_v_heads: int, v: int, dtype: torch.dtype, k: int | None = None,
                         tokens: int | None = None, gluon: bool = False, sms: int = 132,
                         max_seqlen: int | None = None) -> ChunkConfig:
    """The fastest configuration measured on the H200 and verified there (docs/PERFORMANCE.md): the
    one-kernel tensor-core prep; 64-column state slices (2 stages) once there are >= 128 (sequence,
    value head) pairs to fill the SMs (5 % faster at 4 x 8192 and 32 x 1024), else 32 columns
    (3 stages; 64 columns leave half the SMs idle at 1 x 32768 and are 25 % slower there); and, for bf16
    at head dims 128 (CHUNK_LAYOUT_DIMS, the shapes verified on the device), the chunk layout with the
    TMA state kernel (session 7: 69.3 / 66.4 ns/token against 77.9 / 73.8 at 1 x 32768 / 4 x 8192, the
    same products bit for bit) and the prep with the whole-tile fp16 inverse and the lean factors
    (PREP7 "wide-fp16-lean", session 7: prep 39.7 -> 26.3 ns/token, whole op 56.7 / 53.2, 8k final-state
    error 6.3e-5 against 1.2e-4). fp32 activations keep the exact block inverse (the wide one's fp32
    products spill). The chunk layout's buffers have (cdiv(T, 64) + N) x 64 rows against the token layout's
    T: with many short sequences (`tokens` given and that bound over 1.25 T) the token layout keeps the
    prep's scratch near what the engine's memory profile (one long sequence) measured. gluon (the device
    runs `gluon_chain`: `gluon_chain.supported`): the chunk layout's chain is the Gluon kernel (session 8:
    chain 24.2 / 18.8 ns/token at 1 x 32768 / 4 x 8192 against 30.6 / 26.9 for the Triton chain). The bf16 prep
    at head dims 128 is PREP8 "tma-r168" (PREP8_DEFAULT; session 8: its loads first, the heads-first grid, three
    programs per SM, 26.3 -> 22.1 ns/token; session 9: k / q / v by TMA except in a sequence's partial last
    chunk, W / U / P stored by TMA; buffers bitwise equal to the session-7 prep's). With the Gluon chain on 64-column
    slices (the batches), U is formed in the chain (u_in_chain; session 10, run S10-3: 4 x 8192 / 32 x 1024 38.8-39.1 /
    40.8 ns/token against 40.8-41.3 / 42.4: the prep 20.3-21.6 -> 17.5 saves more than the chain's two products
    cost); not for one sequence's 32-column slices (46.9-47.3 against 46.4-46.5), whose chain is bound by the L2
    reads of its four column programs, each reading the chunk's W, K, Q, P tiles and now v's rows too. Likewise the
    chain reads whole chunks' K rows from k (k_in_chain; the prep's K copy of them is not written) for batches
    (run S10-7: 4 x 8192 / 32 x 1024 37.3 / 39.1 ns/token against 37.8 / 40.0) and not for one sequence (45.2
    against 44.6, though the prep and the chain alone were each faster with it: 19.1 / 25.2 against 19.9 / 26.3).
    The Gluon chain stores whole chunks' outputs by TMA (o_tma; session 11, same-run A/B, 3 repeats, means: whole op
    4 x 8192 37.6 -> 34.7, 32 x 1024 39.5 -> 36.9, 1 x 32768 45.8 -> 45.5 ns/token; chain alone 22.6 -> 20.2,
    24.8 -> 21.1, 26.2 -> 25.0; outputs bit for bit). With those TMA stores u_in_chain pays at one sequence too
    (session 11, final run S11-7, 1 x 32768, three same-run measurements: 42.4 / 42.6 / 42.5 ns/token against
    45.3 / 45.0 / 45.9; chain 27.0 against 23.8, prep 17.4 against 19.6), so it is on for every Gluon chain;
    k_in_chain stayed a batch choice then (at one sequence alone 44.3 / 44.5 against 45.0 / 45.9, on top of
    u_in_chain not measured). The Gluon chain (one CTA per SM at either width) takes 64-column slices wherever 32-column ones
    would need more than one wave of the device's `sms` SMs, so from 2 sequences at 32 value heads (session 12, helper
    conc12, same run, outputs bit for bit: 2 x 16384 41.3 -> 30.8, 2 x 8192 42.8 -> 32.2, 3 x 8192 40.7 -> 36.7
    ns/token; one sequence stays at 32 columns: 64 are 48.2 against 41.8 at 1 x 32768). The prep of every Gluon
    chain is the Gluon prep (gluon_prep; session 12, run S12-1, the prep alone in the same run, 3 repeats: 1 x 32768
    17.3 -> 14.0, 4 x 8192 16.8 -> 13.3 ns/token, every buffer bit for bit). Behind the Gluon prep k_in_chain pays at
    one sequence too (session 12, 1 x 32768, same run, 3 repeats: 41.5 / 42.2 / 42.4 ns/token against 43.4 / 43.6 /
    43.6 without it and 42.2 / 42.6 / 42.6 with the Triton prep; run S12-4; the 8k test's errors identical, S12-1), so
    it is on for every Gluon chain. Where the caller gives the longest length (`max_seqlen`) the chain and its width
    are the fastest by `chain_step_estimate` (session 14): the transposed chain (chain "gluon_t") with two consumers
    (128 columns per program; session 13, run S13-5, same run as FLA: whole op 4 x 8192 33.0 -> 29.5, 32 x 1024 34.9
    -> 30.7 ns/token) where sequences of about the longest length fill the SMs, with one (64 columns) where they fill
    them only at that width, the untransposed chain at 32 columns where one long sequence is the critical path
    (8192 + 3 x 128: 42.5 ns/token against 47.4 / 59.2 at 64 / 128 columns, run S14-F). Without it, 64 columns (the
    one-consumer transposed chain, faster than the untransposed chain's 64-column programs at every batch of S14-F)
    past one wave of 32-column programs."""
    exact = dtype == torch.float32  # fp32 activations: keep every product in fp32
    fast = dtype == torch.bfloat16 and (k or v, v) in CHUNK_LAYOUT_DIMS
    padded_rows = None if tokens is None else (triton.cdiv(tokens, CHUNK) + num_seqs) * CHUNK
    chunk = fast and (padded_rows is None or padded_rows <= tokens + tokens // 4 + CHUNK)
    chain = "gluon" if chunk and gluon else "triton"
    if chunk and gluon:  # one CTA per (32-column slice, sequence, value head): more than one wave -> 64 columns
        if v == 128 and tokens is not None and max_seqlen is not None:  # the lengths known: the fastest estimate
            chain, bv = min(CHAIN_STEP_US, key=lambda cb: chain_step_estimate(*cb, num_v_heads, v, tokens, max_seqlen,
                                                                              sms))
        else:  # one CTA per (32-column slice, sequence, value head): more than one wave -> 64 columns
            bv = 64 if num_seqs * num_v_heads * (v // 32) > sms and v >= 64 else min(32, v)
            if bv == 64 and v == 128:  # the same programs, each a shorter step (S14-F)
                chain = "gluon_t"
    else:
        bv = 64 if num_seqs * num_v_heads >= 128 and v >= 64 else min(32, v)
    return ChunkConfig(bv=bv, prec="ieee" if exact else "bf16x2", layout="chunk" if chunk else "token",
                       chain=chain, u_in_chain=chunk and gluon,
                       k_in_chain=chunk and gluon, o_tma=chunk and gluon, gluon_prep=chunk and gluon,
                       **(dict(PREP8_DEFAULT) if fast else {}))


def _operand_dtype(prec: str) -> torch.dtype:
    """dtype of the W and P buffers: the A operand of the state kernel's products."""
    return torch.bfloat16 if prec.startswith("bf16") else torch.float32


@triton.jit
def _mmx(a, b, PREC: tl.constexpr):
    """a @ b with fp32 accumulation; a is W, K^T, Q or P (already in its operand dtype), b is fp32."""
    if PREC == "bf16":
        return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
    elif PREC == "bf16x2":
        hi = b.to(tl.bfloat16)
        lo = (b - hi.to(tl.float32)).to(tl.bfloat16)
        a16 = a.to(tl.bfloat16)
        return tl.dot(a16, lo, tl.dot(a16, hi))
    else:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision=PREC)


@triton.jit
def _cumsum(g, SB: tl.constexpr):
    """Inclusive prefix sum of a [SB] vector as a masked row sum (no scan)."""
    r = tl.arange(0, SB)
    return tl.sum(tl.where(r[None, :] <= r[:, None], g[None, :], 0.0), axis=1)


@triton.jit
def _subst_step(A, X, i, r):
    """Row i of (I + A)^-1 by forward substitution: X_i = e_i - sum_j A_ij X_j (rows j < i are final)."""
    a = tl.sum(tl.where(r[:, None] == i, A, 0.0), axis=0)                     # A[i, :]
    new = -tl.sum(a[:, None] * X, axis=0)
    return tl.where(r[:, None] == i, new[None, :] + tl.where(r[None, :] == i, 1.0, 0.0), X)


@triton.jit
def _block_inverses(A0, A1, A2, A3, SB: tl.constexpr):
    """(I + A_b)^-1 of four strictly lower-triangular fp32 [SB, SB] tiles, the four chains interleaved."""
    r = tl.arange(0, SB)
    eye = tl.where(r[:, None] == r[None, :], 1.0, 0.0)
    X0 = eye
    X1 = eye
    X2 = eye
    X3 = eye
    for i in range(1, SB):
        X0 = _subst_step(A0, X0, i, r)
        X1 = _subst_step(A1, X1, i, r)
        X2 = _subst_step(A2, X2, i, r)
        X3 = _subst_step(A3, X3, i, r)
    return X0, X1, X2, X3


@triton.jit
def _mm(a, b, PREC: tl.constexpr):
    """Product of two fp32 tiles of the inverse (tf32x3: three tensor-core passes, ~fp32 accuracy)."""
    return tl.dot(a, b, input_precision=PREC)


@triton.jit
def _load_rows(ptr, tok, m, s_t, off, K: tl.constexpr):
    ok = tl.arange(0, K)
    return tl.load(ptr + tok[:, None] * s_t + off + ok[None, :], mask=m[:, None], other=0.0)


@triton.jit
def _rstd(x, L2NORM: tl.constexpr):
    if L2NORM:
        xf = x.to(tl.float32)
        return tl.rsqrt(tl.sum(xf * xf, axis=1) + 1e-6)
    else:
        return tl.sum(x.to(tl.float32) * 0.0, axis=1) + 1.0


@triton.jit
def _gram(a, b, PREC: tl.constexpr):
    """a_i . b_j of raw rows: exact products (bf16 operands), fp32 accumulation; norms applied after."""
    if PREC == "native":
        return tl.dot(a, tl.trans(b))
    else:
        return tl.dot(a, tl.trans(b), input_precision=PREC)


@triton.jit
def _gates(g, beta, s_g_t, s_b_t, A_log, dt_bias, tok, m, hv, GATES: tl.constexpr):
    if GATES:
        av = tl.load(g + tok * s_g_t + hv, mask=m, other=0.0).to(tl.float32)
        bv = tl.load(beta + tok * s_b_t + hv, mask=m, other=0.0).to(tl.float32)
        gv = -tl.exp(tl.load(A_log + hv).to(tl.float32)) * softplus(av + tl.load(dt_bias + hv).to(tl.float32))
        bv = sigmoid(bv)
    else:
        gv = tl.load(g + tok * s_g_t + hv, mask=m, other=0.0).to(tl.float32)
        bv = tl.load(beta + tok * s_b_t + hv, mask=m, other=0.0).to(tl.float32)
    return tl.where(m, gv, 0.0), tl.where(m, bv, 0.0)


@triton.jit
def _decay(Gi, Gj, DIAG: tl.constexpr, STRICT: tl.constexpr, SB: tl.constexpr):
    """exp(G_i - G_j) for a row block i and column block j; on a diagonal block only below (or on) the
    diagonal, masked before the exp so no exp(+x) can overflow."""
    diff = Gi[:, None] - Gj[None, :]
    if DIAG:
        r = tl.arange(0, SB)
        if STRICT:
            keep = r[:, None] > r[None, :]
        else:
            keep = r[:, None] >= r[None, :]
        diff = tl.where(keep, diff, float("-inf"))
    return tl.exp(diff)


@triton.jit
def _store_cols(base, tok, m, hv, HV, col0, X, W: tl.constexpr, N: tl.constexpr):
    """Store an [SB, N] tile at columns col0.. of the rows `tok` of a [T, HV, W] buffer."""
    c = tl.arange(0, N)
    tl.store(base + (tok[:, None] * HV + hv) * W + col0 + c[None, :], X.to(base.dtype.element_ty), mask=m[:, None])


@triton.jit(do_not_specialize=["N"])
def _chunk_prep_kernel(
    q, k, v, s_q_t, s_q_h, s_k_t, s_k_h, s_v_t, s_v_h,
    g, beta, s_g_t, s_b_t, A_log, dt_bias,
    coff, cu, N, Wb, Ub, Pb, Gb, Tb, Bb, rq_b, rk_b, scale, HK, HV,
    R: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BLOCK_N: tl.constexpr,
    L2NORM: tl.constexpr, GATES: tl.constexpr, QK_PREC: tl.constexpr, UT_PREC: tl.constexpr,
    WU_PREC: tl.constexpr, SPLIT: tl.constexpr, P_IN_WU: tl.constexpr,
):
    """One program per (chunk, value head); the chunk is four 16-token sub-blocks (row blocks 0..3).
    SPLIT: store T (fp32, zeros above the diagonal) and beta for `_chunk_wu_kernel` instead of forming
    W and U here from 16-row blocks; P_IN_WU: leave P and the q norms to that kernel too."""
    SB: tl.constexpr = 16
    p = tl.program_id(0)
    hv = tl.program_id(1)
    hk = hv // R
    n, c, bos, eos = locate_chunk(coff, cu, N, p, BLOCK_N)
    t0 = bos + c * BT
    L = eos - t0
    r = tl.arange(0, SB)
    tok0 = (t0 + r).to(tl.int64)
    tok1 = tok0 + SB
    tok2 = tok0 + 2 * SB
    tok3 = tok0 + 3 * SB
    m0 = r < L
    m1 = r + SB < L
    m2 = r + 2 * SB < L
    m3 = r + 3 * SB < L
    koff = hk * s_k_h
    qoff = hk * s_q_h
    voff = hv * s_v_h
    k0 = _load_rows(k, tok0, m0, s_k_t, koff, K)
    k1 = _load_rows(k, tok1, m1, s_k_t, koff, K)
    k2 = _load_rows(k, tok2, m2, s_k_t, koff, K)
    k3 = _load_rows(k, tok3, m3, s_k_t, koff, K)
    rk0 = _rstd(k0, L2NORM)
    rk1 = _rstd(k1, L2NORM)
    rk2 = _rstd(k2, L2NORM)
    rk3 = _rstd(k3, L2NORM)
    g0, b0 = _gates(g, beta, s_g_t, s_b_t, A_log, dt_bias, tok0, m0, hv, GATES)
    g1, b1 = _gates(g, beta, s_g_t, s_b_t, A_log, dt_bias, tok1, m1, hv, GATES)
    g2, b2 = _gates(g, beta, s_g_t, s_b_t, A_log, dt_bias, tok2, m2, hv, GATES)
    g3, b3 = _gates(g, beta, s_g_t, s_b_t, A_log, dt_bias, tok3, m3, hv, GATES)
    G0 = _cumsum(g0, SB)
    G1 = _cumsum(g1, SB) + tl.sum(g0, axis=0)
    G2 = _cumsum(g2, SB) + (tl.sum(g0, axis=0) + tl.sum(g1, axis=0))
    G3 = _cumsum(g3, SB) + (tl.sum(g0, axis=0) + tl.sum(g1, axis=0) + tl.sum(g2, axis=0))
    tl.store(Gb + tok0 * HV + hv, G0, mask=m0)
    tl.store(Gb + tok1 * HV + hv, G1, mask=m1)
    tl.store(Gb + tok2 * HV + hv, G2, mask=m2)
    tl.store(Gb + tok3 * HV + hv, G3, mask=m3)
    # A = strictly_lower(diag(beta) K^ K^T * exp(G_i - G_j)), block by block (the norms scale the products)
    A00 = _gram(k0, k0, QK_PREC) * ((b0 * rk0)[:, None] * rk0[None, :]) * _decay(G0, G0, True, True, SB)
    A11 = _gram(k1, k1, QK_PREC) * ((b1 * rk1)[:, None] * rk1[None, :]) * _decay(G1, G1, True, True, SB)
    A22 = _gram(k2, k2, QK_PREC) * ((b2 * rk2)[:, None] * rk2[None, :]) * _decay(G2, G2, True, True, SB)
    A33 = _gram(k3, k3, QK_PREC) * ((b3 * rk3)[:, None] * rk3[None, :]) * _decay(G3, G3, True, True, SB)
    A10 = _gram(k1, k0, QK_PREC) * ((b1 * rk1)[:, None] * rk0[None, :]) * _decay(G1, G0, False, False, SB)
    A20 = _gram(k2, k0, QK_PREC) * ((b2 * rk2)[:, None] * rk0[None, :]) * _decay(G2, G0, False, False, SB)
    A21 = _gram(k2, k1, QK_PREC) * ((b2 * rk2)[:, None] * rk1[None, :]) * _decay(G2, G1, False, False, SB)
    A30 = _gram(k3, k0, QK_PREC) * ((b3 * rk3)[:, None] * rk0[None, :]) * _decay(G3, G0, False, False, SB)
    A31 = _gram(k3, k1, QK_PREC) * ((b3 * rk3)[:, None] * rk1[None, :]) * _decay(G3, G1, False, False, SB)
    A32 = _gram(k3, k2, QK_PREC) * ((b3 * rk3)[:, None] * rk2[None, :]) * _decay(G3, G2, False, False, SB)
    X0, X1, X2, X3 = _block_inverses(A00, A11, A22, A33, SB)
    # (I + A)^-1 below the diagonal: X_ij = -X_ii sum_{j <= m < i} A_im X_mj
    X10 = -_mm(X1, _mm(A10, X0, UT_PREC), UT_PREC)
    X21 = -_mm(X2, _mm(A21, X1, UT_PREC), UT_PREC)
    X32 = -_mm(X3, _mm(A32, X2, UT_PREC), UT_PREC)
    X20 = -_mm(X2, _mm(A20, X0, UT_PREC) + _mm(A21, X10, UT_PREC), UT_PREC)
    X31 = -_mm(X3, _mm(A31, X1, UT_PREC) + _mm(A32, X21, UT_PREC), UT_PREC)
    X30 = -_mm(X3, _mm(A30, X0, UT_PREC) + _mm(A31, X10, UT_PREC) + _mm(A32, X20, UT_PREC), UT_PREC)
    if SPLIT:
        zt = tl.zeros([SB, SB], dtype=tl.float32)
        _store_cols(Tb, tok0, m0, hv, HV, 0, X0, BT, SB)
        _store_cols(Tb, tok0, m0, hv, HV, SB, zt, BT, SB)
        _store_cols(Tb, tok0, m0, hv, HV, 2 * SB, zt, BT, SB)
        _store_cols(Tb, tok0, m0, hv, HV, 3 * SB, zt, BT, SB)
        _store_cols(Tb, tok1, m1, hv, HV, 0, X10, BT, SB)
        _store_cols(Tb, tok1, m1, hv, HV, SB, X1, BT, SB)
        _store_cols(Tb, tok1, m1, hv, HV, 2 * SB, zt, BT, SB)
        _store_cols(Tb, tok1, m1, hv, HV, 3 * SB, zt, BT, SB)
        _store_cols(Tb, tok2, m2, hv, HV, 0, X20, BT, SB)
        _store_cols(Tb, tok2, m2, hv, HV, SB, X21, BT, SB)
        _store_cols(Tb, tok2, m2, hv, HV, 2 * SB, X2, BT, SB)
        _store_cols(Tb, tok2, m2, hv, HV, 3 * SB, zt, BT, SB)
        _store_cols(Tb, tok3, m3, hv, HV, 0, X30, BT, SB)
        _store_cols(Tb, tok3, m3, hv, HV, SB, X31, BT, SB)
        _store_cols(Tb, tok3, m3, hv, HV, 2 * SB, X32, BT, SB)
        _store_cols(Tb, tok3, m3, hv, HV, 3 * SB, X3, BT, SB)
        tl.store(Bb + tok0 * HV + hv, b0, mask=m0)
        tl.store(Bb + tok1 * HV + hv, b1, mask=m1)
        tl.store(Bb + tok2 * HV + hv, b2, mask=m2)
        tl.store(Bb + tok3 * HV + hv, b3, mask=m3)
    else:
        # W = T diag(beta exp(G) rk) K (raw rows) and U = T diag(beta) V, row block by row block
        kt0 = k0.to(tl.float32) * (b0 * tl.exp(G0) * rk0)[:, None]
        kt1 = k1.to(tl.float32) * (b1 * tl.exp(G1) * rk1)[:, None]
        kt2 = k2.to(tl.float32) * (b2 * tl.exp(G2) * rk2)[:, None]
        kt3 = k3.to(tl.float32) * (b3 * tl.exp(G3) * rk3)[:, None]
        _store_cols(Wb, tok0, m0, hv, HV, 0, _mm(X0, kt0, WU_PREC), K, K)
        _store_cols(Wb, tok1, m1, hv, HV, 0, _mm(X10, kt0, WU_PREC) + _mm(X1, kt1, WU_PREC), K, K)
        _store_cols(Wb, tok2, m2, hv, HV, 0,
                    _mm(X20, kt0, WU_PREC) + _mm(X21, kt1, WU_PREC) + _mm(X2, kt2, WU_PREC), K, K)
        _store_cols(Wb, tok3, m3, hv, HV, 0, _mm(X30, kt0, WU_PREC) + _mm(X31, kt1, WU_PREC)
                    + _mm(X32, kt2, WU_PREC) + _mm(X3, kt3, WU_PREC), K, K)
        # beta scales the columns of T (exact rows of V stay exact operands)
        vb0 = _load_rows(v, tok0, m0, s_v_t, voff, V).to(tl.float32)
        vb1 = _load_rows(v, tok1, m1, s_v_t, voff, V).to(tl.float32)
        vb2 = _load_rows(v, tok2, m2, s_v_t, voff, V).to(tl.float32)
        vb3 = _load_rows(v, tok3, m3, s_v_t, voff, V).to(tl.float32)
        X0 = X0 * b0[None, :]
        X1 = X1 * b1[None, :]
        X2 = X2 * b2[None, :]
        X3 = X3 * b3[None, :]
        X10 = X10 * b0[None, :]
        X20 = X20 * b0[None, :]
        X30 = X30 * b0[None, :]
        X21 = X21 * b1[None, :]
        X31 = X31 * b1[None, :]
        X32 = X32 * b2[None, :]
        _store_cols(Ub, tok0, m0, hv, HV, 0, _mm(X0, vb0, WU_PREC), V, V)
        _store_cols(Ub, tok1, m1, hv, HV, 0, _mm(X10, vb0, WU_PREC) + _mm(X1, vb1, WU_PREC), V, V)
        _store_cols(Ub, tok2, m2, hv, HV, 0,
                    _mm(X20, vb0, WU_PREC) + _mm(X21, vb1, WU_PREC) + _mm(X2, vb2, WU_PREC), V, V)
        _store_cols(Ub, tok3, m3, hv, HV, 0, _mm(X30, vb0, WU_PREC) + _mm(X31, vb1, WU_PREC)
                    + _mm(X32, vb2, WU_PREC) + _mm(X3, vb3, WU_PREC), V, V)
    if hv % R == 0:  # the norms are per key head: one of its value heads stores them
        tl.store(rk_b + tok0 * HK + hk, rk0, mask=m0)
        tl.store(rk_b + tok1 * HK + hk, rk1, mask=m1)
        tl.store(rk_b + tok2 * HK + hk, rk2, mask=m2)
        tl.store(rk_b + tok3 * HK + hk, rk3, mask=m3)
    if not P_IN_WU:
        # P = scale Q^ K^T * exp(G_i - G_j) on and below the diagonal; explicit zeros above it
        q0 = _load_rows(q, tok0, m0, s_q_t, qoff, K)
        q1 = _load_rows(q, tok1, m1, s_q_t, qoff, K)
        q2 = _load_rows(q, tok2, m2, s_q_t, qoff, K)
        q3 = _load_rows(q, tok3, m3, s_q_t, qoff, K)
        rq0 = _rstd(q0, L2NORM) * scale
        rq1 = _rstd(q1, L2NORM) * scale
        rq2 = _rstd(q2, L2NORM) * scale
        rq3 = _rstd(q3, L2NORM) * scale
        if hv % R == 0:  # the norms are per key head: one of its value heads stores them
            tl.store(rq_b + tok0 * HK + hk, rq0, mask=m0)
            tl.store(rq_b + tok1 * HK + hk, rq1, mask=m1)
            tl.store(rq_b + tok2 * HK + hk, rq2, mask=m2)
            tl.store(rq_b + tok3 * HK + hk, rq3, mask=m3)
        zero = tl.zeros([SB, SB], dtype=tl.float32)
        P00 = _gram(q0, k0, QK_PREC) * (rq0[:, None] * rk0[None, :]) * _decay(G0, G0, True, False, SB)
        _store_cols(Pb, tok0, m0, hv, HV, 0, P00, BT, SB)
        _store_cols(Pb, tok0, m0, hv, HV, SB, zero, BT, SB)
        _store_cols(Pb, tok0, m0, hv, HV, 2 * SB, zero, BT, SB)
        _store_cols(Pb, tok0, m0, hv, HV, 3 * SB, zero, BT, SB)
        P10 = _gram(q1, k0, QK_PREC) * (rq1[:, None] * rk0[None, :]) * _decay(G1, G0, False, False, SB)
        P11 = _gram(q1, k1, QK_PREC) * (rq1[:, None] * rk1[None, :]) * _decay(G1, G1, True, False, SB)
        _store_cols(Pb, tok1, m1, hv, HV, 0, P10, BT, SB)
        _store_cols(Pb, tok1, m1, hv, HV, SB, P11, BT, SB)
        _store_cols(Pb, tok1, m1, hv, HV, 2 * SB, zero, BT, SB)
        _store_cols(Pb, tok1, m1, hv, HV, 3 * SB, zero, BT, SB)
        P20 = _gram(q2, k0, QK_PREC) * (rq2[:, None] * rk0[None, :]) * _decay(G2, G0, False, False, SB)
        P21 = _gram(q2, k1, QK_PREC) * (rq2[:, None] * rk1[None, :]) * _decay(G2, G1, False, False, SB)
        P22 = _gram(q2, k2, QK_PREC) * (rq2[:, None] * rk2[None, :]) * _decay(G2, G2, True, False, SB)
        _store_cols(Pb, tok2, m2, hv, HV, 0, P20, BT, SB)
        _store_cols(Pb, tok2, m2, hv, HV, SB, P21, BT, SB)
        _store_cols(Pb, tok2, m2, hv, HV, 2 * SB, P22, BT, SB)
        _store_cols(Pb, tok2, m2, hv, HV, 3 * SB, zero, BT, SB)
        P30 = _gram(q3, k0, QK_PREC) * (rq3[:, None] * rk0[None, :]) * _decay(G3, G0, False, False, SB)
        P31 = _gram(q3, k1, QK_PREC) * (rq3[:, None] * rk1[None, :]) * _decay(G3, G1, False, False, SB)
        P32 = _gram(q3, k2, QK_PREC) * (rq3[:, None] * rk2[None, :]) * _decay(G3, G2, False, False, SB)
        P33 = _gram(q3, k3, QK_PREC) * (rq3[:, None] * rk3[None, :]) * _decay(G3, G3, True, False, SB)
        _store_cols(Pb, tok3, m3, hv, HV, 0, P30, BT, SB)
        _store_cols(Pb, tok3, m3, hv, HV, SB, P31, BT, SB)
        _store_cols(Pb, tok3, m3, hv, HV, 2 * SB, P32, BT, SB)
        _store_cols(Pb, tok3, m3, hv, HV, 3 * SB, P33, BT, SB)


@triton.jit(do_not_specialize=["N"])
def _chunk_wu_kernel(
    q, k, v, s_q_t, s_q_h, s_k_t, s_k_h, s_v_t, s_v_h, coff, cu, N, Wb, Ub, Pb, Gb, Tb, Bb, rq_b, rk_b, scale,
    HK, HV, R: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BLOCK_N: tl.constexpr,
    WU_PREC: tl.constexpr, P_IN_WU: tl.constexpr, L2NORM: tl.constexpr, QK_PREC: tl.constexpr,
):
    """Split prep, part 2, one program per (chunk, value head): W = (T diag(beta exp(G) rk)) K and
    U = (T diag(beta)) V as whole-chunk [BT, BT] x [BT, K|V] tensor-core products (the diagonal factors
    scale T's columns, so the raw bf16 rows of K and V stay exact operands)."""
    p = tl.program_id(0)
    hv = tl.program_id(1)
    hk = hv // R
    n, c, bos, eos = locate_chunk(coff, cu, N, p, BLOCK_N)
    t0 = bos + c * BT
    rows = tl.arange(0, BT)
    m = rows < eos - t0
    tok = (t0 + rows).to(tl.int64)
    Tm = tl.load(Tb + (tok[:, None] * HV + hv) * BT + rows[None, :], mask=m[:, None], other=0.0)
    bt = tl.load(Bb + tok * HV + hv, mask=m, other=0.0)
    G = tl.load(Gb + tok * HV + hv, mask=m, other=0.0)
    rk = tl.load(rk_b + tok * HK + hk, mask=m, other=0.0)
    kraw = _load_rows(k, tok, m, s_k_t, hk * s_k_h, K)
    kk = kraw.to(tl.float32)
    vv = _load_rows(v, tok, m, s_v_t, hv * s_v_h, V).to(tl.float32)
    if P_IN_WU:  # P = scale Q^ K^T * exp(G_i - G_j) as one whole-chunk product, zeros above the diagonal
        qq = _load_rows(q, tok, m, s_q_t, hk * s_q_h, K)
        rq = _rstd(qq, L2NORM) * scale
        if hv % R == 0:
            tl.store(rq_b + tok * HK + hk, rq, mask=m)
        diff = tl.where(rows[:, None] >= rows[None, :], G[:, None] - G[None, :], float("-inf"))
        Pm = _gram(qq, kraw, QK_PREC) * (rq[:, None] * rk[None, :]) * tl.exp(diff)
        tl.store(Pb + (tok[:, None] * HV + hv) * BT + rows[None, :], Pm.to(Pb.dtype.element_ty), mask=m[:, None])
    W = tl.dot(Tm * (bt * tl.exp(G) * rk)[None, :], kk, input_precision=WU_PREC)
    U = tl.dot(Tm * bt[None, :], vv, input_precision=WU_PREC)
    ok = tl.arange(0, K)
    ov = tl.arange(0, V)
    tl.store(Wb + (tok[:, None] * HV + hv) * K + ok[None, :], W.to(Wb.dtype.element_ty), mask=m[:, None])
    tl.store(Ub + (tok[:, None] * HV + hv) * V + ov[None, :], U, mask=m[:, None])


@triton.jit
def _sub_mask(n: tl.constexpr, s: tl.constexpr):
    """[n, n] mask of the blocks that join inverse blocks of size s into blocks of size 2s: rows in the
    lower s-half, columns in the upper s-half of each diagonal 2s-block."""
    r = tl.arange(0, n)
    i = r[:, None]
    j = r[None, :]
    return (i // (2 * s) == j // (2 * s)) & ((i // s) % 2 == 1) & ((j // s) % 2 == 0)


@triton.jit
def _join(X, A, s: tl.constexpr, n: tl.constexpr, PREC: tl.constexpr):
    """Inverse blocks of size s -> 2s: with X = diag(X1, X2) the inverses of the two halves' (I + L) and
    C the block of L below them, (I + [[L1, 0], [C, L2]])^-1 = [[X1, 0], [-X2 C X1, X2]] = X - X C X.
    X and A are [n, n] or batched [B, n, n]; every product is a block of the inverse times a block of
    A (no power series, so nothing grows and cancels)."""
    if len(A.shape) == 3:
        C = tl.where(_sub_mask(n, s)[None, :, :], A, 0.0)
    else:
        C = tl.where(_sub_mask(n, s), A, 0.0)
    return X - tl.dot(tl.dot(X, C, input_precision=PREC), X, input_precision=PREC)


@triton.jit
def _ut_inverse(A, BT: tl.constexpr, DIAG_PREC: tl.constexpr, MERGE_PREC: tl.constexpr):
    """(I + A)^-1 of a strictly lower-triangular fp32 [BT, BT] tile (BT = 64) by recursive doubling on
    tensor cores: the four 16 x 16 diagonal blocks as one batched [4, 16, 16] problem (levels 1 -> 16,
    DIAG_PREC), then the 32- and 64-wide joins on the whole tile (MERGE_PREC)."""
    SB: tl.constexpr = 16
    NB: tl.constexpr = BT // SB
    b = tl.arange(0, NB)
    same = b[:, None, None, None] == b[None, None, :, None]
    Ad = tl.sum(tl.where(same, tl.reshape(A, (NB, SB, NB, SB)), 0.0), axis=2)   # diagonal blocks [NB, SB, SB]
    rs = tl.arange(0, SB)
    X = tl.zeros([NB, SB, SB], dtype=tl.float32) + tl.where(rs[:, None] == rs[None, :], 1.0, 0.0)[None, :, :]
    X = _join(X, Ad, 1, SB, DIAG_PREC)
    X = _join(X, Ad, 2, SB, DIAG_PREC)
    X = _join(X, Ad, 4, SB, DIAG_PREC)
    X = _join(X, Ad, 8, SB, DIAG_PREC)
    Xf = tl.reshape(tl.where(same, tl.expand_dims(X, 2), 0.0), (BT, BT))        # block-diagonal [BT, BT]
    Xf = _join(Xf, A, 16, BT, MERGE_PREC)
    return _join(Xf, A, 32, BT, MERGE_PREC)


@triton.jit
def _dot_raw(a, b, PREC: tl.constexpr):
    """a @ b for an fp32 tile a and raw activation rows b. "bf16x2": a as two bf16 limbs (hi + lo, ~16
    mantissa bits) against the exact bf16 b, two bf16 tensor-core passes with bf16-sized shared-memory
    operands; otherwise b is widened to fp32 and PREC is the dot's input precision."""
    if PREC == "bf16x2":
        hi = a.to(tl.bfloat16)
        lo = (a - hi.to(tl.float32)).to(tl.bfloat16)
        return tl.dot(hi, b, tl.dot(lo, b))
    else:
        return tl.dot(a, b.to(tl.float32), input_precision=PREC)


@triton.jit(do_not_specialize=["N"])
def _chunk_prep_tc_kernel(
    q, k, v, s_q_t, s_q_h, s_k_t, s_k_h, s_v_t, s_v_h,
    g, beta, s_g_t, s_b_t, A_log, dt_bias,
    coff, cu, N, Wb, Ub, Pb, Gb, rq_b, rk_b, Kb, Cb, Lb, scale, HK, HV,
    k_desc, q_desc, v_desc, w_desc, u_desc, p_desc,
    R: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BLOCK_N: tl.constexpr,
    L2NORM: tl.constexpr, GATES: tl.constexpr, QK_PREC: tl.constexpr, DIAG_PREC: tl.constexpr,
    MERGE_PREC: tl.constexpr, WU_PREC: tl.constexpr, WU_COLS_K: tl.constexpr, WU_COLS_V: tl.constexpr,
    CHUNKED: tl.constexpr, UT: tl.constexpr, UT_PREC: tl.constexpr, LEAN: tl.constexpr,
    HOIST: tl.constexpr, HEADS_FIRST: tl.constexpr, TMA_LOAD: tl.constexpr = False,
    TMA_STORE: tl.constexpr = False, TU: tl.constexpr = False, KR: tl.constexpr = False,
):
    """The whole prep in one program per (chunk, value head), on whole-chunk tiles: norms, gates, G,
    P, A, the tensor-core UT inverse T (never stored), W = (T diag(beta e^G rk)) K, U = (T diag(beta)) V.
    The diagonal factors scale T's columns, so the raw bf16 rows of K and V stay exact operands.
    CHUNKED (ChunkConfig.layout "chunk"): W, U, P at rows (p * HV + hv) * 64 + i of [chunks * HV * 64, ...]
    buffers, all 64 rows stored (rows past the sequence are exact zeros: their k, q, v and gates load as
    zeros), plus the zero-padded K rows (Kb, per key head), the decay factors d = e^(G_last - G) rk (zero past
    the sequence) and e^G rq (Cb, [chunks, HV, 2, 64]) and e^G_last (Lb, [chunks, HV]) in place of G and the
    norms."""
    # HEADS_FIRST (PREP8): the grid is (HV, chunks), so the value heads of a chunk run side by side and share
    # their q / k rows and gate lines in L2
    p = tl.program_id(1 if HEADS_FIRST else 0)
    hv = tl.program_id(0 if HEADS_FIRST else 1)
    if HOIST:  # PREP8: the lean prep with every load first (_prep8_program)
        n, c, bos, eos = locate_chunk(coff, cu, N, p, BLOCK_N)
        t0 = bos + c * BT
        if TMA_LOAD:
            # TMA only for a chunk whose 64 rows all belong to its sequence: a partial last chunk's tile would bring
            # in the next sequence's rows, whose inf / NaN no zero weight removes (0 x inf), so it takes the pointer
            # loads (zeros past the sequence). Two whole program bodies, no tile crossing the branch: the TMA tiles
            # stay in shared memory.
            if eos - t0 >= BT:
                _prep8_program(q, k, v, s_q_t, s_q_h, s_k_t, s_k_h, s_v_t, s_v_h, g, beta, s_g_t, s_b_t, A_log,
                               dt_bias, t0, eos, Wb, Ub, Pb, Gb, rq_b, rk_b, Kb, Cb, Lb, scale, HK, HV, p, hv,
                               k_desc, q_desc, v_desc, w_desc, u_desc, p_desc, R, K, V, BT, L2NORM, GATES, QK_PREC,
                               WU_PREC, CHUNKED, UT_PREC, True, TMA_STORE, TU, KR)
            else:
                _prep8_program(q, k, v, s_q_t, s_q_h, s_k_t, s_k_h, s_v_t, s_v_h, g, beta, s_g_t, s_b_t, A_log,
                               dt_bias, t0, eos, Wb, Ub, Pb, Gb, rq_b, rk_b, Kb, Cb, Lb, scale, HK, HV, p, hv,
                               k_desc, q_desc, v_desc, w_desc, u_desc, p_desc, R, K, V, BT, L2NORM, GATES, QK_PREC,
                               WU_PREC, CHUNKED, UT_PREC, False, TMA_STORE, TU, KR)
        else:
            _prep8_program(q, k, v, s_q_t, s_q_h, s_k_t, s_k_h, s_v_t, s_v_h, g, beta, s_g_t, s_b_t, A_log, dt_bias,
                           t0, eos, Wb, Ub, Pb, Gb, rq_b, rk_b, Kb, Cb, Lb, scale, HK, HV, p, hv,
                           k_desc, q_desc, v_desc, w_desc, u_desc, p_desc, R, K, V, BT, L2NORM, GATES, QK_PREC,
                           WU_PREC, CHUNKED, UT_PREC, False, TMA_STORE, TU, KR)
        return
    hk = hv // R
    n, c, bos, eos = locate_chunk(coff, cu, N, p, BLOCK_N)
    t0 = bos + c * BT
    rows = tl.arange(0, BT)
    m = rows < eos - t0
    tok = (t0 + rows).to(tl.int64)
    if CHUNKED:  # store rows of the W / U / P buffers, and their mask (every row of the padded chunk)
        srow = (p.to(tl.int64) * HV + hv) * BT + rows
        sm = rows >= 0
    else:
        srow = tok * HV + hv
        sm = m
    if LEAN:  # the k norms from the Gram product's diagonal, in the layout of the products they scale
        kraw = load_chunk_rows(k, t0, m, s_k_t, hk * s_k_h, 0, K, BT)
        KK = _gram(kraw, kraw, QK_PREC)
        rk = rstd_from_gram(KK, L2NORM, BT)
    else:
        kraw = _load_rows(k, tok, m, s_k_t, hk * s_k_h, K)
        KK = kraw  # formed after P below
        rk = _rstd(kraw, L2NORM)
    gv, bt = _gates(g, beta, s_g_t, s_b_t, A_log, dt_bias, tok, m, hv, GATES)
    if LEAN:
        G = tl.cumsum(gv, 0)
    else:
        G = _cumsum(gv, BT)
    if not CHUNKED:
        tl.store(Gb + tok * HV + hv, G, mask=m)
    # exp(G_i - G_j) on and below the diagonal, masked before the exp (no exp(+x) overflow)
    if LEAN:  # with the column norms folded in: exp(G_i - G_j) rk_j; the q norms from Q Q^T's diagonal
        E = decay_tile(G, tl.log2(rk), BT)
        qraw = load_chunk_rows(q, t0, m, s_q_t, hk * s_q_h, 0, K, BT)
        rq = rstd_from_gram(_gram(qraw, qraw, QK_PREC), L2NORM, BT) * scale
    else:
        E = tl.exp(tl.where(rows[:, None] >= rows[None, :], G[:, None] - G[None, :], float("-inf")))
        qraw = _load_rows(q, tok, m, s_q_t, hk * s_q_h, K)
        rq = _rstd(qraw, L2NORM) * scale
    if CHUNKED:
        _store_chunk_factors(Kb, Cb, Lb, kraw, G, rk, rq, m, p, hv, hk, HK, HV, R, K, BT)
    elif hv % R == 0:  # the norms are per key head: one of its value heads stores them
        tl.store(rq_b + tok * HK + hk, rq, mask=m)
        tl.store(rk_b + tok * HK + hk, rk, mask=m)
    if LEAN:
        Pm = _gram(qraw, kraw, QK_PREC) * rq[:, None] * E
    else:
        Pm = _gram(qraw, kraw, QK_PREC) * (rq[:, None] * rk[None, :]) * E
    tl.store(Pb + srow[:, None] * BT + rows[None, :], Pm.to(Pb.dtype.element_ty), mask=sm[:, None])
    if LEAN:
        A = tl.where(rows[:, None] > rows[None, :], KK * (bt * rk)[:, None] * E, 0.0)
    else:
        KK = _gram(kraw, kraw, QK_PREC)
        A = tl.where(rows[:, None] > rows[None, :], KK * ((bt * rk)[:, None] * rk[None, :]) * E, 0.0)
    if UT == "wide":
        T = ut_inverse_wide(A, BT, UT_PREC)
    else:
        T = _ut_inverse(A, BT, DIAG_PREC, MERGE_PREC)
    # W and U in column slices of WU_COLS (K and V rows reloaded per slice, cache hits): smaller accumulators
    # and shared-memory operands, and no whole K tile live across the inverse
    if LEAN:
        Tw = T * (bt * tl.exp2(G * LOG2E) * rk)[None, :]
    else:
        Tw = T * (bt * tl.exp(G) * rk)[None, :]
    for h in tl.static_range(K // WU_COLS_K):
        oc = h * WU_COLS_K + tl.arange(0, WU_COLS_K)
        if WU_COLS_K == K:
            kc = kraw
        elif LEAN:
            kc = load_chunk_rows(k, t0, m, s_k_t, hk * s_k_h, h * WU_COLS_K, WU_COLS_K, BT)
        else:
            kc = tl.load(k + tok[:, None] * s_k_t + hk * s_k_h + oc[None, :], mask=m[:, None], other=0.0)
        W = _dot_raw(Tw, kc, WU_PREC)
        tl.store(Wb + srow[:, None] * K + oc[None, :], W.to(Wb.dtype.element_ty), mask=sm[:, None])
    Tu = T * bt[None, :]
    for h in tl.static_range(V // WU_COLS_V):
        oc = h * WU_COLS_V + tl.arange(0, WU_COLS_V)
        if LEAN:
            vc = load_chunk_rows(v, t0, m, s_v_t, hv * s_v_h, h * WU_COLS_V, WU_COLS_V, BT)
        else:
            vc = tl.load(v + tok[:, None] * s_v_t + hv * s_v_h + oc[None, :], mask=m[:, None], other=0.0)
        tl.store(Ub + srow[:, None] * V + oc[None, :], _dot_raw(Tu, vc, WU_PREC), mask=sm[:, None])


@triton.jit
def _prep8_program(q, k, v, s_q_t, s_q_h, s_k_t, s_k_h, s_v_t, s_v_h, g, beta, s_g_t, s_b_t, A_log, dt_bias,
                   t0, eos, Wb, Ub, Pb, Gb, rq_b, rk_b, Kb, Cb, Lb, scale, HK, HV, p, hv,
                   k_desc, q_desc, v_desc, w_desc, u_desc, p_desc, R: tl.constexpr,
                   K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, L2NORM: tl.constexpr,
                   GATES: tl.constexpr, QK_PREC: tl.constexpr, WU_PREC: tl.constexpr, CHUNKED: tl.constexpr,
                   UT_PREC: tl.constexpr, TMA_LOAD: tl.constexpr, TMA_STORE: tl.constexpr, TU: tl.constexpr,
                   KR: tl.constexpr):
    """PREP8 (ChunkConfig.hoist): the lean prep of `_chunk_prep_tc_kernel` (wide inverse, full-width W / U, the
    same products in the same order) with every global load of the program (k, q, the gates, v) issued before
    its first product: one memory round trip instead of four (k; the gates after K K^T; q; v after the
    inverse). v goes to shared memory at once (no registers held across the inverse). The chunk starts at token
    t0 of a sequence ending at eos.
    TMA_LOAD (ChunkConfig.tma_load): k / q / v by TMA into shared memory, for a chunk whose 64 rows all lie in
    its sequence (the caller sends a sequence's partial last chunk to the pointer loads: TMA's tile would carry
    the next sequence's rows into the products, and a zero weight does not remove an inf / NaN).
    TMA_STORE (ChunkConfig.tma_store, chunk layout): W, U and P leave by TMA stores of whole tiles.
    TU (ChunkConfig.u_in_chain, chunk layout): instead of U, its factor T diag(beta) as two bf16 limbs (hi in
    columns 0..63, lo in 64..127 of Ub's row); the chain forms U = hi V + lo V itself, so v is not read here.
    KR (ChunkConfig.k_in_chain): the chain reads a whole chunk's K rows from k, so the TMA body stores no K copy
    (the pointer body, a sequence's partial last chunk, still does: its padded rows are what the chain reads)."""
    hk = hv // R
    rows = tl.arange(0, BT)
    m = rows < eos - t0
    tok = (t0 + rows).to(tl.int64)
    if TMA_LOAD:  # each TMA load waits for its data where it stands: the gates' loads first, in flight meanwhile
        gv, bt = _gates(g, beta, s_g_t, s_b_t, A_log, dt_bias, tok, m, hv, GATES)
        kraw = k_desc.load([t0, hk * K])
        qraw = q_desc.load([t0, hk * K])
        if not TU:
            vraw = v_desc.load([t0, hv * V])
    else:
        kraw = load_chunk_rows(k, t0, m, s_k_t, hk * s_k_h, 0, K, BT)
        qraw = load_chunk_rows(q, t0, m, s_q_t, hk * s_q_h, 0, K, BT)
        gv, bt = _gates(g, beta, s_g_t, s_b_t, A_log, dt_bias, tok, m, hv, GATES)
        if not TU:
            vraw = load_chunk_rows(v, t0, m, s_v_t, hv * s_v_h, 0, V, BT)
    KK = _gram(kraw, kraw, QK_PREC)
    rk = rstd_from_gram(KK, L2NORM, BT)
    rq = rstd_from_gram(_gram(qraw, qraw, QK_PREC), L2NORM, BT) * scale
    if CHUNKED:
        srow = (p.to(tl.int64) * HV + hv) * BT + rows
        sm = rows >= 0
    else:
        srow = tok * HV + hv
        sm = m
    G = tl.cumsum(gv, 0)
    if not CHUNKED:
        tl.store(Gb + tok * HV + hv, G, mask=m)
    E = decay_tile(G, tl.log2(rk), BT)
    if CHUNKED:
        _store_chunk_factors(Kb, Cb, Lb, kraw, G, rk, rq, m, p, hv, hk, HK, HV, R, K, BT, not TMA_LOAD)
        if TMA_LOAD and hv % R == 0 and not KR:  # the padded copy of K from k's rows in L2 (kraw is in shared memory)
            _store_k_rows(Kb, load_chunk_rows(k, t0, m, s_k_t, hk * s_k_h, 0, K, BT), p, hk, HK, K, BT)
    elif hv % R == 0:
        tl.store(rq_b + tok * HK + hk, rq, mask=m)
        tl.store(rk_b + tok * HK + hk, rk, mask=m)
    Pm = _gram(qraw, kraw, QK_PREC) * rq[:, None] * E
    if TMA_STORE and CHUNKED:
        p_desc.store([((p * HV + hv) * BT).to(tl.int32), 0], Pm.to(p_desc.dtype))
    else:
        tl.store(Pb + srow[:, None] * BT + rows[None, :], Pm.to(Pb.dtype.element_ty), mask=sm[:, None])
    A = tl.where(rows[:, None] > rows[None, :], KK * (bt * rk)[:, None] * E, 0.0)
    T = ut_inverse_wide(A, BT, UT_PREC)
    Tw = T * (bt * tl.exp2(G * LOG2E) * rk)[None, :]
    ok = tl.arange(0, K)
    W = _dot_raw(Tw, kraw, WU_PREC)
    if TMA_STORE and CHUNKED:
        w_desc.store([((p * HV + hv) * BT).to(tl.int32), 0], W.to(w_desc.dtype))
    else:
        tl.store(Wb + srow[:, None] * K + ok[None, :], W.to(Wb.dtype.element_ty), mask=sm[:, None])
    Tu = T * bt[None, :]
    if TU:  # the limbs _dot_raw("bf16x2") would multiply v by
        hi = Tu.to(tl.bfloat16)
        lo = (Tu - hi.to(tl.float32)).to(tl.bfloat16)
        if TMA_STORE:
            u_desc.store([((p * HV + hv) * BT).to(tl.int32), 0], hi)
            u_desc.store([((p * HV + hv) * BT).to(tl.int32), BT], lo)
        else:
            tl.store(Ub + srow[:, None] * (2 * BT) + rows[None, :], hi)
            tl.store(Ub + srow[:, None] * (2 * BT) + BT + rows[None, :], lo)
    else:
        ov = tl.arange(0, V)
        U = _dot_raw(Tu, vraw, WU_PREC)
        if TMA_STORE and CHUNKED:
            u_desc.store([((p * HV + hv) * BT).to(tl.int32), 0], U)
        else:
            tl.store(Ub + srow[:, None] * V + ov[None, :], U, mask=sm[:, None])


@triton.jit
def _store_chunk_factors(Kb, Cb, Lb, kraw, G, rk, rq, m, p, hv, hk, HK, HV, R: tl.constexpr, K: tl.constexpr,
                         BT: tl.constexpr, STORE_K: tl.constexpr = True):
    """The chunk layout's per-chunk factors (`_chunk_prep_tc_kernel`, CHUNKED): G_last is G's last row (the
    gates past the sequence are zero, so the cumulative sum stays at the last token's value); with STORE_K
    the zero-padded K rows kraw too (one value head of each key head stores them)."""
    rows = tl.arange(0, BT)
    ch = p.to(tl.int64) * HV + hv
    g_last = tl.sum(tl.where(rows == BT - 1, G, 0.0), 0)
    tl.store(Cb + ch * (2 * BT) + rows, tl.where(m, tl.exp(g_last - G) * rk, 0.0))
    tl.store(Cb + ch * (2 * BT) + BT + rows, tl.exp(G) * rq)
    tl.store(Lb + ch, tl.exp(g_last))
    if STORE_K and hv % R == 0:  # K is per key head: one of its value heads stores the padded rows
        _store_k_rows(Kb, kraw, p, hk, HK, K, BT)


@triton.jit
def _store_k_rows(Kb, kraw, p, hk, HK, K: tl.constexpr, BT: tl.constexpr):
    """The chunk's zero-padded K rows (the chunk layout's Kb, per key head)."""
    rows = tl.arange(0, BT)
    ok = tl.arange(0, K)
    tl.store(Kb + ((p.to(tl.int64) * HK + hk) * BT + rows)[:, None] * K + ok[None, :], kraw)


@triton.jit
def _state_slice(cu, idx, has_init, ssm, HV, R: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr):
    """A state kernel program's (sequence n, value head hv, key head hk) from its grid position, the
    sequence's bounds, whether its slot is live, and its [K, BV] state slice (pointers and the initial
    values: zero without an initial state or for a padded row)."""
    j = tl.program_id(0)
    nh = tl.program_id(1)
    n = nh // HV
    hv = nh % HV
    bos = tl.load(cu + n).to(tl.int32)
    L = tl.load(cu + n + 1).to(tl.int32) - bos
    slot = tl.load(idx + n).to(tl.int64)
    live = slot >= 0
    init = tl.load(has_init + n) != 0
    ok = tl.arange(0, K)
    ov = j * BV + tl.arange(0, BV)
    sp = ssm + slot * (HV * K * V) + hv * (K * V) + ok[:, None] * V + ov[None, :]
    S = tl.load(sp, mask=(ok[:, None] >= 0) & live & init, other=0.0)
    return n, hv, hv // R, bos, L, live, ok, ov, sp, S


@triton.jit
def _chunk_state_kernel(
    q, k, s_q_t, s_q_h, s_k_t, s_k_h, o,
    Wb, Ub, Pb, Gb, rq_b, rk_b, ssm, cu, idx, has_init, HK, HV,
    R: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr,
    PREC: tl.constexpr, STAGES: tl.constexpr,
):
    OUT_PREC: tl.constexpr = "bf16" if PREC == "bf16x2" else PREC
    n, hv, hk, bos, L, live, ok, ov, sp, S = _state_slice(cu, idx, has_init, ssm, HV, R, K, V, BV)
    rows = tl.arange(0, BT)
    for c in tl.range(0, tl.cdiv(L, BT), num_stages=STAGES):
        left = L - c * BT
        rm = rows < left
        tok = (bos + c * BT + rows).to(tl.int64)
        w = tl.load(Wb + (tok[:, None] * HV + hv) * K + ok[None, :], mask=rm[:, None], other=0.0)
        u = tl.load(Ub + (tok[:, None] * HV + hv) * V + ov[None, :], mask=rm[:, None], other=0.0)
        # K^T loaded as its own tile (an L1/L2 hit) rather than tl.trans of a loaded tile
        kT = tl.load(k + tok[None, :] * s_k_t + hk * s_k_h + ok[:, None], mask=rm[None, :], other=0.0)
        qq = tl.load(q + tok[:, None] * s_q_t + hk * s_q_h + ok[None, :], mask=rm[:, None], other=0.0)
        pm = tl.load(Pb + (tok[:, None] * HV + hv) * BT + rows[None, :], mask=rm[:, None], other=0.0)
        G = tl.load(Gb + tok * HV + hv, mask=rm, other=0.0)
        rk = tl.load(rk_b + tok * HK + hk, mask=rm, other=0.0)
        rq = tl.load(rq_b + tok * HK + hk, mask=rm, other=0.0)
        g_last = tl.load(Gb + (bos + c * BT + tl.minimum(left, BT) - 1).to(tl.int64) * HV + hv)
        Vn = u - _mmx(w, S, PREC)
        # the output products leave the recurrence: one bf16 limb is enough for a bf16 output
        O = _mmx(qq, S, OUT_PREC) * (rq * tl.exp(G))[:, None] + _mmx(pm, Vn, OUT_PREC)
        tl.store(o + tok[:, None] * (HV * V) + hv * V + ov[None, :],
                 tl.where(live, O, 0.0).to(o.dtype.element_ty), mask=rm[:, None])
        d = tl.where(rm, tl.exp(g_last - G) * rk, 0.0)
        S = S * tl.exp(g_last) + _mmx(kT, Vn * d[:, None], PREC)
    tl.store(sp, S, mask=(ok[:, None] >= 0) & live & (L > 0))


@triton.jit
def _chunk_state_tma_kernel(
    w_desc, u_desc, k_desc, q_desc, p_desc, v_desc, kr_desc, Cb, Lb, o, ssm, cu, coff, idx, has_init, HK, HV,
    R: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr,
    PREC: tl.constexpr, STAGES: tl.constexpr, TU: tl.constexpr = False, KR: tl.constexpr = False,
):
    """`_chunk_state_kernel` on the chunk layout (ChunkConfig.layout "chunk"): W, U, K, P arrive as whole
    zero-padded chunk tiles and Q as the chunk's rows of q, all through TMA descriptors (one async copy per
    tile, no masks, no per-element addresses), and the decay factors come precomputed. The products and
    their operand precisions are `_chunk_state_kernel`'s. Q rows past the sequence belong to the next one
    (or are TMA's zero fill past T); they only reach output rows that are not stored.
    TU (ChunkConfig.u_in_chain): U = hi V + lo V from the prep's two bf16 limbs of T diag(beta) (u_desc) and
    the chunk's rows of v (v_desc), rows past the sequence zeroed (they belong to the next one: 0 x inf).
    KR (ChunkConfig.k_in_chain): a whole chunk's K rows from k (kr_desc), a partial last chunk's from the prep's
    zero-padded copy."""
    OUT_PREC: tl.constexpr = "bf16" if PREC == "bf16x2" else PREC
    n, hv, hk, bos, L, live, ok, ov, sp, S = _state_slice(cu, idx, has_init, ssm, HV, R, K, V, BV)
    c0 = tl.load(coff + n).to(tl.int32)
    rows = tl.arange(0, BT)
    for c in tl.range(0, tl.cdiv(L, BT), num_stages=STAGES):
        ch = c0 + c
        row = (ch * HV + hv) * BT
        w = w_desc.load([row, 0])
        if TU:
            vt = v_desc.load([bos + c * BT, hv * V + tl.program_id(0) * BV])
            vt = tl.where((rows < L - c * BT)[:, None], vt, tl.zeros_like(vt))
            u = tl.dot(u_desc.load([row, 0]), vt, tl.dot(u_desc.load([row, BT]), vt))
        else:
            u = u_desc.load([row, tl.program_id(0) * BV])
        if KR and L - c * BT >= BT:
            kk = kr_desc.load([bos + c * BT, hk * K])
        else:
            kk = k_desc.load([(ch * HK + hk) * BT, 0])
        qq = q_desc.load([bos + c * BT, hk * K])
        pm = p_desc.load([row, 0])
        f = Cb + (ch * HV + hv).to(tl.int64) * (2 * BT) + rows
        d = tl.load(f)
        eq = tl.load(f + BT)
        decay = tl.load(Lb + (ch * HV + hv))
        Vn = u - _mmx(w, S, PREC)
        O = _mmx(qq, S, OUT_PREC) * eq[:, None] + _mmx(pm, Vn, OUT_PREC)
        tok = (bos + c * BT + rows).to(tl.int64)
        tl.store(o + tok[:, None] * (HV * V) + hv * V + ov[None, :],
                 tl.where(live, O, 0.0).to(o.dtype.element_ty), mask=(rows < L - c * BT)[:, None])
        S = S * decay + _mmx(tl.trans(kk), Vn * d[:, None], PREC)
    tl.store(sp, S, mask=(ok[:, None] >= 0) & live & (L > 0))


@triton.jit
def _chunk_state_split_kernel(
    k, s_k_t, s_k_h, Wb, Ub, Gb, rk_b, Hb, Vb, ssm, cu, coff, idx, has_init, HK, HV,
    R: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr,
    PREC: tl.constexpr, STAGES: tl.constexpr,
):
    """`_chunk_state_kernel` with the output products moved out (ChunkConfig.split_output): per chunk it
    stores the state it starts the chunk with (h_c, [chunks, HV, K, V], at the chunk's index coff[n] + c)
    and V_new ([T, HV, V]), both in the output products' operand dtype (Hb / Vb), and carries on with the
    chain alone. Padded sequences (slot < 0) store nothing; `_chunk_out_kernel` writes their zeros."""
    n, hv, hk, bos, L, live, ok, ov, sp, S = _state_slice(cu, idx, has_init, ssm, HV, R, K, V, BV)
    c0 = tl.load(coff + n).to(tl.int64)
    rows = tl.arange(0, BT)
    for c in tl.range(0, tl.cdiv(L, BT), num_stages=STAGES):
        left = L - c * BT
        rm = rows < left
        tok = (bos + c * BT + rows).to(tl.int64)
        w = tl.load(Wb + (tok[:, None] * HV + hv) * K + ok[None, :], mask=rm[:, None], other=0.0)
        u = tl.load(Ub + (tok[:, None] * HV + hv) * V + ov[None, :], mask=rm[:, None], other=0.0)
        kT = tl.load(k + tok[None, :] * s_k_t + hk * s_k_h + ok[:, None], mask=rm[None, :], other=0.0)
        G = tl.load(Gb + tok * HV + hv, mask=rm, other=0.0)
        rk = tl.load(rk_b + tok * HK + hk, mask=rm, other=0.0)
        g_last = tl.load(Gb + (bos + c * BT + tl.minimum(left, BT) - 1).to(tl.int64) * HV + hv)
        tl.store(Hb + ((c0 + c) * HV + hv) * (K * V) + ok[:, None] * V + ov[None, :], S.to(Hb.dtype.element_ty),
                 mask=(ok[:, None] >= 0) & live)
        Vn = u - _mmx(w, S, PREC)
        tl.store(Vb + (tok[:, None] * HV + hv) * V + ov[None, :], Vn.to(Vb.dtype.element_ty),
                 mask=rm[:, None] & live)
        d = tl.where(rm, tl.exp(g_last - G) * rk, 0.0)
        S = S * tl.exp(g_last) + _mmx(kT, Vn * d[:, None], PREC)
    tl.store(sp, S, mask=(ok[:, None] >= 0) & live & (L > 0))


@triton.jit(do_not_specialize=["N"])
def _chunk_out_kernel(
    q, s_q_t, s_q_h, o, Pb, Gb, rq_b, Hb, Vb, coff, cu, idx, N, HK, HV,
    R: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr,
    BLOCK_N: tl.constexpr, PREC: tl.constexpr,
):
    """The outputs of one (chunk, value head, BV columns) from the split state kernel's h_c and V_new, with
    `_chunk_state_kernel`'s output math: O = (Q h_c) * e^G rq + P V_new, both products at the output
    precision (one bf16 limb for bf16x2) and fp32 accumulation; zeros for padded sequences."""
    OUT_PREC: tl.constexpr = "bf16" if PREC == "bf16x2" else PREC
    p = tl.program_id(0)
    hv = tl.program_id(1)
    j = tl.program_id(2)
    hk = hv // R
    n, c, bos, eos = locate_chunk(coff, cu, N, p, BLOCK_N)
    slot = tl.load(idx + n, mask=n < N, other=-1)
    live = slot >= 0
    t0 = bos + c * BT
    rows = tl.arange(0, BT)
    rm = rows < eos - t0
    tok = (t0 + rows).to(tl.int64)
    ok = tl.arange(0, K)
    ov = j * BV + tl.arange(0, BV)
    qq = tl.load(q + tok[:, None] * s_q_t + hk * s_q_h + ok[None, :], mask=rm[:, None], other=0.0)
    pm = tl.load(Pb + (tok[:, None] * HV + hv) * BT + rows[None, :], mask=rm[:, None], other=0.0)
    G = tl.load(Gb + tok * HV + hv, mask=rm, other=0.0)
    rq = tl.load(rq_b + tok * HK + hk, mask=rm, other=0.0)
    h = tl.load(Hb + (p.to(tl.int64) * HV + hv) * (K * V) + ok[:, None] * V + ov[None, :],
                mask=(ok[:, None] >= 0) & live, other=0.0)
    vn = tl.load(Vb + (tok[:, None] * HV + hv) * V + ov[None, :], mask=rm[:, None] & live, other=0.0)
    O = _mmx(qq, h, OUT_PREC) * (rq * tl.exp(G))[:, None] + _mmx(pm, vn, OUT_PREC)
    tl.store(o + tok[:, None] * (HV * V) + hv * V + ov[None, :],
             tl.where(live, O, 0.0).to(o.dtype.element_ty), mask=rm[:, None])


@triton.jit
def _mma(a, b, PREC: tl.constexpr):
    """a @ b with fp32 accumulation; a is fp32 (S^T or V_new^T, in registers), b a loaded W, Q, P or K
    tile (already in its operand dtype). "bf16x2": a as two bf16 limbs against the bf16 b."""
    if PREC == "bf16":
        return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
    elif PREC == "bf16x2":
        hi = a.to(tl.bfloat16)
        lo = (a - hi.to(tl.float32)).to(tl.bfloat16)
        b16 = b.to(tl.bfloat16)
        return tl.dot(lo, b16, tl.dot(hi, b16))
    else:
        return tl.dot(a, b.to(tl.float32), input_precision=PREC)


@triton.jit
def _chunk_state_t_kernel(
    q, k, s_q_t, s_q_h, s_k_t, s_k_h, o,
    Wb, Ub, Pb, Gb, rq_b, rk_b, ssm, cu, idx, has_init, HK, HV,
    R: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr,
    PREC: tl.constexpr, STAGES: tl.constexpr,
):
    """`_chunk_state_kernel` transposed: the program carries S^T [BV, K], so everything that depends on
    the state (S^T and V_new^T, and their bf16 limbs) is the A operand of its product and stays in
    registers (one product's accumulator feeds the next without a shared-memory round trip), while the
    B operands are the loaded W, Q, P and K tiles (transposed views, no extra loads):
      V_new^T = U^T - S^T W^T;   O^T = (S^T Q^T) diag(e^G rq) + V_new^T P^T;
      S^T <- e^{G_last} S^T + (V_new^T diag(e^{G_last - G} rk)) K."""
    OUT_PREC: tl.constexpr = "bf16" if PREC == "bf16x2" else PREC
    j = tl.program_id(0)
    nh = tl.program_id(1)
    n = nh // HV
    hv = nh % HV
    hk = hv // R
    bos = tl.load(cu + n).to(tl.int32)
    L = tl.load(cu + n + 1).to(tl.int32) - bos
    slot = tl.load(idx + n).to(tl.int64)
    live = slot >= 0
    init = tl.load(has_init + n) != 0
    ok = tl.arange(0, K)
    ov = j * BV + tl.arange(0, BV)
    rows = tl.arange(0, BT)
    sp = ssm + slot * (HV * K * V) + hv * (K * V) + ok[None, :] * V + ov[:, None]       # S^T: [BV, K]
    X = tl.load(sp, mask=(ov[:, None] >= 0) & live & init, other=0.0)
    for c in tl.range(0, tl.cdiv(L, BT), num_stages=STAGES):
        left = L - c * BT
        rm = rows < left
        tok = (bos + c * BT + rows).to(tl.int64)
        w = tl.load(Wb + (tok[:, None] * HV + hv) * K + ok[None, :], mask=rm[:, None], other=0.0)
        kk = tl.load(k + tok[:, None] * s_k_t + hk * s_k_h + ok[None, :], mask=rm[:, None], other=0.0)
        qq = tl.load(q + tok[:, None] * s_q_t + hk * s_q_h + ok[None, :], mask=rm[:, None], other=0.0)
        pm = tl.load(Pb + (tok[:, None] * HV + hv) * BT + rows[None, :], mask=rm[:, None], other=0.0)
        uT = tl.load(Ub + (tok[None, :] * HV + hv) * V + ov[:, None], mask=rm[None, :], other=0.0)
        G = tl.load(Gb + tok * HV + hv, mask=rm, other=0.0)
        rk = tl.load(rk_b + tok * HK + hk, mask=rm, other=0.0)
        rq = tl.load(rq_b + tok * HK + hk, mask=rm, other=0.0)
        g_last = tl.load(Gb + (bos + c * BT + tl.minimum(left, BT) - 1).to(tl.int64) * HV + hv)
        VnT = uT - _mma(X, tl.trans(w), PREC)
        # the output products leave the recurrence: one bf16 limb is enough for a bf16 output
        OT = _mma(X, tl.trans(qq), OUT_PREC) * (rq * tl.exp(G))[None, :] + _mma(VnT, tl.trans(pm), OUT_PREC)
        tl.store(o + tok[None, :] * (HV * V) + hv * V + ov[:, None],
                 tl.where(live, OT, 0.0).to(o.dtype.element_ty), mask=rm[None, :])
        d = tl.where(rm, tl.exp(g_last - G) * rk, 0.0)
        X = X * tl.exp(g_last) + _mma(VnT * d[None, :], kk, PREC)
    tl.store(sp, X, mask=(ov[:, None] >= 0) & live & (L > 0))


def _chunk_forward(q, k, v, g, beta, *, gates_in_kernel, A_log, dt_bias, scale, cu_seqlens, ssm_state,
                   state_indices, has_initial_state, use_qk_l2norm_in_kernel, config, op, max_seqlen=None):
    check(q.dim() == 3 and k.shape == q.shape and v.dim() == 3 and v.shape[0] == q.shape[0], op,
          f"q, k must be [T, HK, K] and v [T, HV, V], got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    T, HK, K = q.shape
    HV, V = v.shape[1:]
    check(HV % HK == 0 and HV // HK <= 8, op, f"value heads {HV} must be 1..8 x key heads {HK}")
    check_head_dim(op, "K", K)
    check_head_dim(op, "V", V)
    check(q.dtype in (torch.bfloat16, torch.float16, torch.float32) and k.dtype == q.dtype and v.dtype == q.dtype,
          op, f"q, k, v must share a float dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    check(g.shape == (T, HV) and beta.shape == (T, HV), op,
          f"{'a and b' if gates_in_kernel else 'g and beta'} must be [{T}, {HV}], "
          f"got {tuple(g.shape)}, {tuple(beta.shape)}")
    check_last_contiguous(op, q=q, k=k, v=v, g=g, beta=beta)
    check_pool(op, ssm_state, HV, K, V)
    N = state_indices.shape[0]
    check_index(op, "cu_seqlens", cu_seqlens, N + 1)
    check_index(op, "state_indices", state_indices, N)
    check(has_initial_state.dim() == 1 and has_initial_state.shape[0] == N, op,
          f"has_initial_state must be [{N}], got {tuple(has_initial_state.shape)}")
    check_same_device(op, q, k, v, g, beta, cu_seqlens, ssm_state, state_indices, has_initial_state)
    if gates_in_kernel:
        check(A_log.shape == (HV,) and dt_bias.shape == (HV,), op, f"A_log and dt_bias must be [{HV}]")
    check_max_seqlen(op, max_seqlen)
    if config is None:
        # (head counts the Gluon chain's boxes do not fit take the Triton chain: the same products, bit for bit)
        gluon = gluon_chain.supported(q.device) and gluon_chain.heads_supported(HV)
        cfg = default_chunk_config(N, HV, V, q.dtype, k=K, tokens=T, gluon=gluon, max_seqlen=max_seqlen,
                                   **({"sms": torch.cuda.get_device_properties(q.device).multi_processor_count}
                                      if gluon else {}))
    else:
        cfg = config
    check(V % cfg.bv == 0, op, f"config bv={cfg.bv} must divide V={V}")
    check(cfg.prec in PRECISIONS, op, f"config prec={cfg.prec!r} is not one of {PRECISIONS}")
    check(cfg.merge_prec in MERGE_PRECISIONS, op,
          f"config merge_prec={cfg.merge_prec!r} is not one of {MERGE_PRECISIONS}")
    check(cfg.solve in SOLVES, op, f"config solve={cfg.solve!r} is not one of {SOLVES}")
    check(cfg.wu_prec in ("bf16x2", "tf32"), op, f"config wu_prec={cfg.wu_prec!r} is not one of ('bf16x2', 'tf32')")
    check(cfg.state_t or cfg.state_stages() >= 2, op,
          f"config stages_state={cfg.stages_state}: the untransposed state kernel needs >= 2 stages "
          "(one stage computed wrong values on the H200); use state_t=True for one stage")
    check(cfg.diag_prec in DIAG_PRECISIONS, op, f"config diag_prec={cfg.diag_prec!r} is not one of {DIAG_PRECISIONS}")
    check(cfg.ut in UT_FORMS and cfg.ut_prec in UT_PRECISIONS, op,
          f"config ut={cfg.ut!r} / ut_prec={cfg.ut_prec!r} must be one of {UT_FORMS} / {UT_PRECISIONS}")
    check((cfg.ut == "blocks" and not cfg.lean) or q.device.type != "cuda" or (K, V) in CHUNK_LAYOUT_DIMS, op,
          f"config ut={cfg.ut!r} / lean={cfg.lean} is verified on the GPU only at head dims (K, V) in "
          f"{CHUNK_LAYOUT_DIMS}, got ({K}, {V}); use ut='blocks', lean=False")
    check(cfg.solve == "tc" or (cfg.ut == "blocks" and not cfg.lean), op,
          f"config ut={cfg.ut!r} and lean={cfg.lean} are choices of the tc prep, not of solve={cfg.solve!r}")
    check(cfg.wu_cols == 0 or (cfg.wu_cols >= 16 and K % cfg.wu_cols == 0 and V % cfg.wu_cols == 0), op,
          f"config wu_cols={cfg.wu_cols} must be 0 or a divisor >= 16 of K={K} and V={V}")
    verified = K in DEVICE_VERIFIED_DIMS and V in DEVICE_VERIFIED_DIMS
    check(q.device.type != "cuda" or q.dtype == torch.float32 or verified, op,
          f"head dims K={K}, V={V} with {q.dtype} activations are not verified on the GPU (only "
          f"{DEVICE_VERIFIED_DIMS}; at 16 / 32 the kernels gave non-finite outputs on the H200): use the reference op")
    check(not cfg.hoist or (cfg.solve == "tc" and cfg.ut == "wide" and cfg.lean and cfg.wu_cols == 0), op,
          f"config hoist needs the lean tc prep with the wide inverse and full-width W / U (solve='tc', ut='wide', "
          f"lean=True, wu_cols=0), got solve={cfg.solve!r}, ut={cfg.ut!r}, lean={cfg.lean}, wu_cols={cfg.wu_cols}")
    check(not (cfg.tma_load or cfg.tma_store) or cfg.hoist, op,
          "config tma_load / tma_store are choices of the hoist prep (hoist=True)")
    check(not cfg.u_in_chain or (cfg.hoist and cfg.layout == "chunk" and cfg.wu_prec == "bf16x2"
                                  and q.dtype == torch.bfloat16), op,
          f"config u_in_chain needs the hoist prep, layout='chunk', wu_prec='bf16x2' and bf16 activations, got "
          f"hoist={cfg.hoist}, layout={cfg.layout!r}, wu_prec={cfg.wu_prec!r}, dtype {q.dtype}")
    check(not cfg.k_in_chain or (cfg.hoist and cfg.tma_load and cfg.layout == "chunk"), op,
          f"config k_in_chain needs the TMA prep (hoist, tma_load) and layout='chunk', got hoist={cfg.hoist}, "
          f"tma_load={cfg.tma_load}, layout={cfg.layout!r}")
    check(not cfg.heads_first or cfg.solve == "tc", op,
          f"config heads_first is a choice of the tc prep, not of solve={cfg.solve!r}")
    check(cfg.layout in LAYOUTS, op, f"config layout={cfg.layout!r} is not one of {LAYOUTS}")
    check(cfg.layout == "token" or q.device.type != "cuda" or (K, V) in CHUNK_LAYOUT_DIMS, op,
          f"config layout='chunk' is verified on the GPU only at head dims (K, V) in {CHUNK_LAYOUT_DIMS}, "
          f"got ({K}, {V}); use layout='token'")
    check(cfg.layout == "token" or (cfg.solve == "tc" and not cfg.state_t and not cfg.split_output
                                    and cfg.prec.startswith("bf16") and q.dtype == torch.bfloat16), op,
          f"config layout='chunk' needs the tc prep, the untransposed fused state kernel and bf16 operands, "
          f"got solve={cfg.solve!r}, state_t={cfg.state_t}, split_output={cfg.split_output}, prec={cfg.prec!r}, "
          f"dtype {q.dtype}")
    check(cfg.chain in CHAINS, op, f"config chain={cfg.chain!r} is not one of {CHAINS}")
    check(not cfg.o_tma or cfg.chain in ("gluon", "gluon_t"), op,
          f"config o_tma is a choice of the Gluon chain (chain='gluon'), got chain={cfg.chain!r}")
    check(cfg.chain != "gluon_t" or (cfg.layout == "chunk" and gluon_chain.supported(q.device)
                                     and (K, V) == gluon_chain.DIMS and cfg.bv in gluon_chain_t.BVS
                                     and cfg.u_in_chain and cfg.o_tma and gluon_chain.heads_supported(HV)), op,
          f"config chain='gluon_t' needs layout='chunk', a CUDA device of compute capability 9.0, head dims "
          f"{gluon_chain.DIMS}, bv in {gluon_chain_t.BVS}, u_in_chain, o_tma (its only output path) and a "
          f"value-head count that is a multiple of 4 and either >= 32 or a divisor of 32, got layout={cfg.layout!r}, "
          f"device {q.device}, ({K}, {V}), bv={cfg.bv}, u_in_chain={cfg.u_in_chain}, o_tma={cfg.o_tma}, "
          f"{HV} value heads")
    check(cfg.chain != "gluon" or (cfg.layout == "chunk" and gluon_chain.supported(q.device)
                                   and (K, V) == gluon_chain.DIMS and cfg.bv in gluon_chain.BVS
                                     and gluon_chain.heads_supported(HV)), op,
          f"config chain='gluon' needs layout='chunk', a CUDA device of compute capability 9.0, head dims "
          f"{gluon_chain.DIMS}, bv in {gluon_chain.BVS} and a value-head count that is a multiple of 4 and either "
          f">= 32 or a divisor of 32, got layout={cfg.layout!r}, device {q.device}, ({K}, {V}), bv={cfg.bv}, "
          f"{HV} value heads")
    check(not cfg.gluon_prep or gluon_chain.supported(q.device), op,
          f"config gluon_prep needs a CUDA device of compute capability 9.0 (Gluon, wgmma, TMA), got device {q.device}")
    check(not cfg.split_output or (not cfg.state_t and cfg.bv_out >= 16 and V % min(cfg.bv_out, V) == 0), op,
          f"config split_output needs the untransposed state kernel and bv_out={cfg.bv_out} >= 16 dividing V={V}")
    o = torch.empty((T, HV, V), dtype=v.dtype, device=v.device)
    if T == 0 or N == 0:
        return o
    bufs = _launch_prep(q, k, v, g, beta, gates_in_kernel, A_log, dt_bias, scale, cu_seqlens, N,
                        use_qk_l2norm_in_kernel, cfg)
    _launch_state(q, k, v, o, bufs, cu_seqlens, ssm_state, state_indices, has_initial_state, cfg)
    return o


def _launch_prep(q, k, v, g, beta, gates_in_kernel, A_log, dt_bias, scale, cu_seqlens, N, l2norm, cfg):
    """The prep launch(es): per (chunk, value head) norms, gates, G, W, U and P (module docstring)."""
    T, HK, K = q.shape
    HV, V = v.shape[1:]
    dev = q.device
    f32 = torch.float32
    op_dtype = _operand_dtype(cfg.prec)
    if cfg.layout == "chunk":  # per chunk, zero-padded to CHUNK rows; cdiv(T, CHUNK) + N bounds the chunk count
        C = triton.cdiv(T, CHUNK) + N
        bufs = dict(
            Wb=torch.empty((C * HV * CHUNK, K), dtype=op_dtype, device=dev),
            # u_in_chain: the two bf16 limbs of U's factor T diag(beta) side by side
            Ub=(torch.empty((C * HV * CHUNK, 2 * CHUNK), dtype=torch.bfloat16, device=dev) if cfg.u_in_chain
                else torch.empty((C * HV * CHUNK, V), dtype=f32, device=dev)),
            Pb=torch.empty((C * HV * CHUNK, CHUNK), dtype=op_dtype, device=dev),
            Kb=torch.empty((C * HK * CHUNK, K), dtype=k.dtype, device=dev),
            Cb=torch.empty((C, HV, 2, CHUNK), dtype=f32, device=dev),
            Lb=torch.empty((C, HV), dtype=f32, device=dev),
        )
        dummy = bufs["Lb"]
        bufs.update(Gb=dummy, rq=dummy, rk=dummy)
        if cfg.u_in_chain:  # the chain reads the chunk's rows of v by TMA: one [HV * V] row per token
            bufs["v"] = v if _tma_rows(v) else v.contiguous()
    else:
        bufs = dict(
            Wb=torch.empty((T, HV, K), dtype=op_dtype, device=dev),
            Ub=torch.empty((T, HV, V), dtype=f32, device=dev),
            Pb=torch.empty((T, HV, CHUNK), dtype=op_dtype, device=dev),
            Gb=torch.empty((T, HV), dtype=f32, device=dev),
            rq=torch.empty((T, HK), dtype=f32, device=dev),
            rk=torch.empty((T, HK), dtype=f32, device=dev),
        )
        dummy = bufs["Gb"]
        bufs.update(Kb=dummy, Cb=dummy, Lb=dummy)
    exact = q.dtype == torch.float32
    wu_prec = "ieee" if exact else "tf32"
    qk_prec = "ieee" if exact else "native"
    merge_prec = "ieee" if exact else cfg.merge_prec
    coff = chunk_offsets(cu_seqlens, CHUNK)
    bufs["coff"] = coff  # the split state / output kernels index h_c by chunk
    grid = (triton.cdiv(T, CHUNK) + N, HV)
    block_n = max(16, next_pow2(N))
    if cfg.solve == "tc":
        heads_first = cfg.heads_first and grid[0] <= 65535
        if cfg.gluon_prep and cfg.u_in_chain and cfg.tma_load and cfg.tma_store \
                and gluon_prep.covers(q, k, v, l2norm, _tma_rows):
            if cfg.k_in_chain:  # whole chunks' K rows come from k (the prep reads every whole chunk by TMA)
                bufs["k"] = k
            gluon_prep.launch_prep(q, k, g, beta, gates_in_kernel, A_log, dt_bias, scale, cu_seqlens, N, bufs,
                                   cfg.k_in_chain, heads_first, cfg.maxnreg_tc)
            return bufs
        descs = _prep_descriptors(q, k, v, bufs, cfg, dummy)
        if cfg.k_in_chain and not isinstance(descs[0], torch.Tensor):  # the prep reads whole chunks by TMA
            bufs["k"] = k
        _chunk_prep_tc_kernel[grid[::-1] if heads_first else grid](
            q, k, v, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            g, beta, g.stride(0), beta.stride(0), A_log if gates_in_kernel else dummy,
            dt_bias if gates_in_kernel else dummy, coff, cu_seqlens, N,
            bufs["Wb"], bufs["Ub"], bufs["Pb"], bufs["Gb"], bufs["rq"], bufs["rk"], bufs["Kb"], bufs["Cb"],
            bufs["Lb"], float(scale), HK, HV, *descs,
            R=HV // HK, K=K, V=V, BT=CHUNK, BLOCK_N=block_n, L2NORM=bool(l2norm), GATES=bool(gates_in_kernel),
            QK_PREC=qk_prec, DIAG_PREC="ieee" if exact else cfg.diag_prec, MERGE_PREC=merge_prec,
            WU_PREC=cfg.wu_prec if q.dtype == torch.bfloat16 else wu_prec,
            WU_COLS_K=cfg.wu_cols or K, WU_COLS_V=cfg.wu_cols or V, CHUNKED=cfg.layout == "chunk",
            UT=cfg.ut, UT_PREC="ieee" if exact else cfg.ut_prec if l2norm else "tf32", LEAN=cfg.lean,
            HOIST=cfg.hoist, HEADS_FIRST=heads_first, TMA_LOAD=not isinstance(descs[0], torch.Tensor),
            TMA_STORE=not isinstance(descs[3], torch.Tensor), TU=cfg.u_in_chain, KR="k" in bufs,
            num_warps=cfg.warps_tc,
            **({"maxnreg": cfg.maxnreg_tc} if cfg.maxnreg_tc else {}))
        return bufs
    if cfg.split_prep:
        bufs.update(Tb=torch.empty((T, HV, CHUNK), dtype=f32, device=dev),
                    Bb=torch.empty((T, HV), dtype=f32, device=dev))
    p_in_wu = cfg.split_prep and cfg.p_in_wu
    _chunk_prep_kernel[grid](
        q, k, v, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        g, beta, g.stride(0), beta.stride(0), A_log if gates_in_kernel else dummy,
        dt_bias if gates_in_kernel else dummy, coff, cu_seqlens, N,
        bufs["Wb"], bufs["Ub"], bufs["Pb"], bufs["Gb"], bufs.get("Tb", dummy), bufs.get("Bb", dummy),
        bufs["rq"], bufs["rk"], float(scale), HK, HV,
        R=HV // HK, K=K, V=V, BT=CHUNK, BLOCK_N=block_n, L2NORM=bool(l2norm),
        GATES=bool(gates_in_kernel), QK_PREC=qk_prec, UT_PREC=merge_prec,
        WU_PREC=wu_prec, SPLIT=cfg.split_prep, P_IN_WU=p_in_wu, num_warps=cfg.warps_prep)
    if cfg.split_prep:
        _chunk_wu_kernel[grid](
            q, k, v, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), coff, cu_seqlens, N,
            bufs["Wb"], bufs["Ub"], bufs["Pb"], bufs["Gb"], bufs["Tb"], bufs["Bb"], bufs["rq"], bufs["rk"],
            float(scale), HK, HV, R=HV // HK, K=K, V=V, BT=CHUNK, BLOCK_N=block_n, WU_PREC=wu_prec,
            P_IN_WU=p_in_wu, L2NORM=bool(l2norm), QK_PREC=qk_prec, num_warps=cfg.warps_wu)
    return bufs


def _tma_rows(x: torch.Tensor) -> bool:
    """Whether TMA can read x [T, H, D] as one [T, H * D] row per token: heads contiguous, the base and the row
    stride 16-byte aligned."""
    e = x.element_size()
    return (x.stride(2) == 1 and x.stride(1) == x.shape[2] and x.data_ptr() % 16 == 0
            and (x.stride(0) * e) % 16 == 0)


def _prep_descriptors(q, k, v, bufs, cfg, dummy) -> tuple:
    """The hoist prep's TMA descriptors (k, q, v, W, U, P; `dummy` where the configuration or the tensors
    leave them out: ChunkConfig.tma_load / tma_store). Host-built, addresses and shapes only (CUDA-graph safe)."""
    out = [dummy] * 6
    if cfg.hoist and cfg.tma_load and all(_tma_rows(x) for x in (q, k, v)):
        out[:3] = [TensorDescriptor(x, [x.shape[0], x.shape[1] * x.shape[2]], [x.stride(0), 1], [CHUNK, x.shape[2]])
                   for x in (k, q, v)]
    if cfg.hoist and cfg.tma_store and cfg.layout == "chunk":
        # u_in_chain: U's factor leaves as two [64, 64] limb tiles
        out[3:] = [TensorDescriptor.from_tensor(bufs[b], [CHUNK, CHUNK if b == "Ub" and cfg.u_in_chain
                                                          else bufs[b].shape[1]]) for b in ("Wb", "Ub", "Pb")]
    return tuple(out)


def _launch_state(q, k, v, o, bufs, cu_seqlens, ssm_state, state_indices, has_initial_state, cfg):
    """The state kernel: per (sequence, value head, V-slice) the chunk recurrence, outputs and final state."""
    HK, K = q.shape[1:]
    HV, V = v.shape[1:]
    N = state_indices.shape[0]
    has_init = has_initial_state if has_initial_state.dtype != torch.bool else has_initial_state.view(torch.uint8)
    if cfg.split_output:
        split = split_scratch(q, v, N, cfg)
        _launch_state_split(q, k, v, bufs, split, cu_seqlens, ssm_state, state_indices, has_init, cfg)
        _launch_out(q, v, o, bufs, split, cu_seqlens, state_indices, cfg)
        return
    if cfg.chain == "gluon_t":
        gluon_chain_t.launch_chain_t(q, o, bufs, cu_seqlens, ssm_state, state_indices, has_init,
                                     consumers=cfg.bv // gluon_chain_t.COLS)
        return
    if cfg.layout == "chunk" and cfg.chain == "gluon":
        gluon_chain.launch_chain(q, o, bufs, cu_seqlens, ssm_state, state_indices, has_init, cfg.bv, ws=True,
                                 o_tma=cfg.o_tma)
        return
    if cfg.layout == "chunk":
        _launch_state_tma(q, o, bufs, cu_seqlens, ssm_state, state_indices, has_init, cfg)
        return
    kernel = _chunk_state_t_kernel if cfg.state_t else _chunk_state_kernel
    kernel[(V // cfg.bv, N * HV)](
        q, k, q.stride(0), q.stride(1), k.stride(0), k.stride(1), o,
        bufs["Wb"], bufs["Ub"], bufs["Pb"], bufs["Gb"], bufs["rq"], bufs["rk"], ssm_state, cu_seqlens,
        state_indices, has_init, HK, HV,
        R=HV // HK, K=K, V=V, BV=cfg.bv, BT=CHUNK, PREC=cfg.prec, STAGES=cfg.state_stages(),
        num_warps=cfg.warps_state)


def _launch_state_tma(q, o, bufs, cu_seqlens, ssm_state, state_indices, has_init, cfg):
    """The state kernel on the chunk layout, its tiles read through host-built TMA descriptors (a descriptor
    holds only addresses and shapes, so the launch stays CUDA-graph capturable)."""
    T, HK, K = q.shape
    HV, V = o.shape[1:]
    N = state_indices.shape[0]
    aligned = q.data_ptr() % 16 == 0 and q.stride(0) * q.element_size() % 16 == 0
    # TMA reads a row's heads as one [HK * K] row: they must be contiguous, the rows 16-byte aligned
    q2 = q if aligned and q.stride(1) == K and q.stride(2) == 1 else q.contiguous()
    tu = "v" in bufs  # ChunkConfig.u_in_chain: Ub holds the limbs of U's factor, v the rows it multiplies
    v2 = bufs.get("v")
    kr = "k" in bufs  # ChunkConfig.k_in_chain: whole chunks' K rows from k
    k2 = bufs["k"].reshape(T, HK * K) if kr else None
    _chunk_state_tma_kernel[(V // cfg.bv, N * HV)](
        TensorDescriptor.from_tensor(bufs["Wb"], [CHUNK, K]),
        TensorDescriptor.from_tensor(bufs["Ub"], [CHUNK, CHUNK if tu else cfg.bv]),
        TensorDescriptor.from_tensor(bufs["Kb"], [CHUNK, K]),
        TensorDescriptor(q2, [T, HK * K], [q2.stride(0), 1], [CHUNK, K]),
        TensorDescriptor.from_tensor(bufs["Pb"], [CHUNK, CHUNK]),
        TensorDescriptor(v2, [T, HV * V], [v2.stride(0), 1], [CHUNK, cfg.bv]) if tu else bufs["Lb"],
        TensorDescriptor(k2, [T, HK * K], [k2.stride(0), 1], [CHUNK, K]) if kr else bufs["Lb"],
        bufs["Cb"], bufs["Lb"], o, ssm_state, cu_seqlens, bufs["coff"], state_indices, has_init, HK, HV,
        R=HV // HK, K=K, V=V, BV=cfg.bv, BT=CHUNK, PREC=cfg.prec, STAGES=cfg.state_stages(), TU=tu, KR=kr,
        num_warps=cfg.warps_state)


def split_scratch(q, v, N, cfg):
    """The split path's scratch, sized from shapes only: h_c for every chunk ([cdiv(T, 64) + N, HV, K, V], the
    bound on the chunk count without a host sync) and V_new ([T, HV, V]), in the output products' operand
    dtype (bf16 for the bf16 / bf16x2 precisions: what the default kernel's output products round to)."""
    T, _, K = q.shape
    HV, V = v.shape[1:]
    dt = _operand_dtype(cfg.prec)
    return dict(Hb=torch.empty((triton.cdiv(T, CHUNK) + N, HV, K, V), dtype=dt, device=q.device),
                Vb=torch.empty((T, HV, V), dtype=dt, device=q.device))


def _launch_state_split(q, k, v, bufs, split, cu_seqlens, ssm_state, state_indices, has_init, cfg):
    """The split state kernel alone: the chain, h_c and V_new per chunk, the final state."""
    HK, K = q.shape[1:]
    HV, V = v.shape[1:]
    N = state_indices.shape[0]
    _chunk_state_split_kernel[(V // cfg.bv, N * HV)](
        k, k.stride(0), k.stride(1), bufs["Wb"], bufs["Ub"], bufs["Gb"], bufs["rk"], split["Hb"], split["Vb"],
        ssm_state, cu_seqlens, bufs["coff"], state_indices, has_init, HK, HV,
        R=HV // HK, K=K, V=V, BV=cfg.bv, BT=CHUNK, PREC=cfg.prec, STAGES=cfg.state_stages(),
        num_warps=cfg.warps_state)


def _launch_out(q, v, o, bufs, split, cu_seqlens, state_indices, cfg):
    """The parallel output kernel: one program per (chunk, value head, bv_out columns)."""
    T, HK, K = q.shape
    HV, V = v.shape[1:]
    N = state_indices.shape[0]
    bvo = min(cfg.bv_out, V)
    _chunk_out_kernel[(triton.cdiv(T, CHUNK) + N, HV, V // bvo)](
        q, q.stride(0), q.stride(1), o, bufs["Pb"], bufs["Gb"], bufs["rq"], split["Hb"], split["Vb"],
        bufs["coff"], cu_seqlens, state_indices, N, HK, HV,
        R=HV // HK, K=K, V=V, BV=bvo, BT=CHUNK, BLOCK_N=max(16, next_pow2(N)), PREC=cfg.prec,
        num_warps=cfg.warps_out)


def chunk_gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    *, scale: float, cu_seqlens: torch.Tensor, ssm_state: torch.Tensor,
    state_indices: torch.Tensor, has_initial_state: torch.Tensor,
    use_qk_l2norm_in_kernel: bool = True, chunk_size: int = CHUNK, config: ChunkConfig | None = None,
    max_seqlen: int | None = None,
) -> torch.Tensor:
    """reference.chunk_gated_delta_rule on the GPU. Domain of the default bf16 configuration's fp16 inverse
    (ChunkConfig.ut_prec): g <= 0 and 0 <= beta <= 2 with the in-kernel q/k norms, where every entry of the
    UT inverse is bounded by max(1, beta) (triton_ut); the layer's gates (g = -exp(A_log) softplus(.),
    beta = sigmoid(.)) always are. Outside it the recurrence itself grows geometrically."""
    check(chunk_size == CHUNK, "chunk_gated_delta_rule", f"only chunk_size={CHUNK} is implemented, got {chunk_size}")
    return _chunk_forward(q, k, v, g, beta, gates_in_kernel=False, A_log=None, dt_bias=None, scale=scale,
                          cu_seqlens=cu_seqlens, ssm_state=ssm_state, state_indices=state_indices,
                          has_initial_state=has_initial_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                          config=config, op="chunk_gated_delta_rule", max_seqlen=max_seqlen)


def gdn_prefill(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
    *, A_log: torch.Tensor, dt_bias: torch.Tensor, scale: float, cu_seqlens: torch.Tensor,
    ssm_state: torch.Tensor, state_indices: torch.Tensor, has_initial_state: torch.Tensor,
    config: ChunkConfig | None = None, max_seqlen: int | None = None,
) -> torch.Tensor:
    return _chunk_forward(q, k, v, a, b, gates_in_kernel=True, A_log=A_log, dt_bias=dt_bias, scale=scale,
                          cu_seqlens=cu_seqlens, ssm_state=ssm_state, state_indices=state_indices,
                          has_initial_state=has_initial_state, use_qk_l2norm_in_kernel=True, config=config,
                          op="gdn_prefill", max_seqlen=max_seqlen)
