"""Triton paged attention and KV store (same signatures and masking as reference.py).

`paged_attention` is one kernel over a varlen batch that may mix prefill chunks (continuing from cached
context) and 1-token decodes, plus an optional split-K reduction:

* A program owns one KV head, a tile of BQ consecutive query tokens of one sequence and all G = NH/NKV
  query heads sharing that KV head: its BLOCK_M = BQ * G query rows are (token, head) pairs. Each K/V tile
  read from the paged cache thus serves the whole GQA group: in decode every KV byte is read once per
  KV head (flash-decoding packing), in prefill the group shares the tile as well.
* Tiles are aligned to sequence starts. Sequence n owns tiles [cu[n] // BQ + n, cu[n+1] // BQ + n + 1),
  a monotone map, so a program finds its sequence by binary search over cu_seqlens and the grid bound
  T // BQ + N + 1 is known from shapes alone (no device->host sync; CUDA-graph capturable). The last
  "sequence" is the tail [cu[N], T) of rows that belong to no sequence: they are written as zeros, as
  the reference leaves them.
* Keys are visited in BLOCK_N-token tiles gathered through the block table; the causal limit of the
  tile bounds the loop, and scores, online softmax and the output accumulator are fp32 (exp2 with the
  scale folded in). P is rounded to the value dtype for the P.V product, as flash attention does.
* Split-K (flash decoding): when the batch has too few (tile, head) programs to fill the GPU, the key
  range of each tile is cut into up to `num_splits` segments; each writes (max, sum, unnormalised
  output) in fp32, and a second kernel merges them. Segments are sized on device from the context
  length, so the host needs no per-sequence lengths.

Numerics differ from the reference (which rounds scores and probabilities to the activation dtype) only
by that rounding: fp32 inputs agree to ~1e-6.

On Hopper the prologue, attention and merge kernels are programmatic dependent launches (PDL): each
becomes resident while the kernel before it drains, waits for it (griddepcontrol.wait) before any load,
and releases the next one at once.

`fused_paged_attention` is the prologue and attention together. Decode batches (one token per sequence)
run _decode_attention_kernel (its docstring: q norm + RoPE on the load, the new key stored by the owner of
the last tile): large ones (>= FUSED_DECODE_MIN_PAIRS (token, KV head) pairs) in one launch, the split
merge done by the last split to finish; smaller ones with one key tile per split and the parallel merge
kernel (two launches: on an H200 at batch 1-8 the in-kernel merge was 1.6-2.6x slower than the old three
launches, the two launches 3-22 % faster; docs/PERFORMANCE.md, "Decode in one launch"). Batches with
prefill chunks run the two ops.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ..triton_common import (ACTIVATION_DTYPES, check, check_head_dim, check_last_contiguous, check_same_device,
                             pdl_launch, prefetch_l2)

LOG2E = 1.4426950408889634
NEG_BIG = tl.constexpr(-1.0e30)  # finite "minus infinity" for running maxima: exp2(NEG_BIG - NEG_BIG) = 1, no NaN
MAX_SPLITS = 64
SPLIT_SCRATCH_BYTES = 64 << 20   # cap on the fp32 partial results of split-K


# ---- KV store ------------------------------------------------------------------------------------

@triton.jit
def _store_kv_kernel(k, v, cache, slots, s_k_t, s_k_h, s_v_t, s_v_h, s_c_kv,
                     NKV: tl.constexpr, D: tl.constexpr, BH: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots + t).to(tl.int64)
    if slot >= 0:
        h = tl.arange(0, BH)[:, None]
        d = tl.arange(0, D)[None, :]
        m = (h < NKV) & (d < D)
        dst = cache + slot * (NKV * D) + h * D + d
        tl.store(dst, tl.load(k + t * s_k_t + h * s_k_h + d, mask=m).to(cache.dtype.element_ty), mask=m)
        tl.store(dst + s_c_kv, tl.load(v + t * s_v_t + h * s_v_h + d, mask=m).to(cache.dtype.element_ty), mask=m)


def _check_cache(op: str, kv_cache: torch.Tensor) -> None:
    check(kv_cache.dim() == 5 and kv_cache.shape[0] == 2, op,
          f"kv_cache must be [2, blocks, block_size, kv_heads, head_dim], got {tuple(kv_cache.shape)}")
    check(kv_cache.is_contiguous(), op, "kv_cache must be contiguous (one layer's slice of the cache)")
    check(kv_cache.dtype in ACTIVATION_DTYPES, op, f"unsupported kv_cache dtype {kv_cache.dtype}")
    check_head_dim(op, "head_dim", kv_cache.shape[-1])


def store_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    op = "store_kv"
    _check_cache(op, kv_cache)
    nkv, d = kv_cache.shape[-2], kv_cache.shape[-1]
    check(k.dim() == 3 and k.shape[1:] == (nkv, d) and v.shape == k.shape, op,
          f"k and v must be [T, {nkv}, {d}], got {tuple(k.shape)}, {tuple(v.shape)}")
    T = k.shape[0]
    check(slot_mapping.dim() == 1 and slot_mapping.shape[0] == T, op,
          f"slot_mapping must be [{T}], got {tuple(slot_mapping.shape)}")
    check(slot_mapping.dtype in (torch.int32, torch.int64), op,
          f"slot_mapping must be int32/int64, got {slot_mapping.dtype}")
    check(slot_mapping.is_contiguous(), op, "slot_mapping must be contiguous")
    check(k.dtype in ACTIVATION_DTYPES and v.dtype in ACTIVATION_DTYPES, op, f"unsupported dtypes {k.dtype}, {v.dtype}")
    check_last_contiguous(op, k=k, v=v)
    check_same_device(op, k, v, kv_cache, slot_mapping)
    if T == 0:
        return
    _store_kv_kernel[(T,)](k, v, kv_cache, slot_mapping, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                           kv_cache.stride(0), NKV=nkv, D=d, BH=triton.next_power_of_2(nkv),
                           num_warps=4 if nkv * d >= 1024 else 2)


# ---- prologue: q/k norm, RoPE, KV store ------------------------------------------------------------

@triton.jit
def _attn_prologue_kernel(q, k, v, q_w, k_w, cos, sin, q_out, cache, slots, eps,
                     s_q_t, s_q_h, s_k_t, s_k_h, s_v_t, s_v_h, s_cos, s_sin, s_c_kv,
                     NH: tl.constexpr, NKV: tl.constexpr, D: tl.constexpr, RD: tl.constexpr,
                     PDL: tl.constexpr = False):
    """One (token, head) per program: heads 0..NH-1 are query heads (written to q_out), NH.. key heads
    (written with their value head to the token's cache slot; padding rows, slot < 0, store nothing)."""
    if PDL:                          # launched as a programmatic dependent: wait, then release the next
        gdc_wait()
        gdc_launch_dependents()
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    dims = tl.arange(0, D)
    HALF: tl.constexpr = RD // 2
    # rotate-half pairing: out[i] = y[i] cos[i] + sign[i] y[partner[i]] sin[i] on the first RD dims
    partner = tl.where(dims < HALF, dims + HALF, tl.where(dims < RD, dims - HALF, dims))
    sign = tl.where(dims < HALF, -1.0, 1.0)
    in_rd = dims < RD
    if h < NH:
        src = q + t * s_q_t + h * s_q_h
        w = q_w
        slot = t                                       # unused for query heads
    else:
        src = k + t * s_k_t + (h - NH) * s_k_h
        w = k_w
        slot = tl.load(slots + t).to(tl.int64)
    if slot >= 0:
        x = tl.load(src + dims).to(tl.float32)
        xp = tl.load(src + partner).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, 0) / D + eps)
        # the norm's output is rounded to the activation dtype first, as the reference's rms_norm is
        y = (x * rstd * (tl.load(w + dims).to(tl.float32) + 1.0)).to(q_out.dtype.element_ty).to(tl.float32)
        yp = (xp * rstd * (tl.load(w + partner).to(tl.float32) + 1.0)).to(q_out.dtype.element_ty).to(tl.float32)
        c = tl.load(cos + t * s_cos + dims, mask=in_rd, other=1.0).to(tl.float32)
        sn = tl.load(sin + t * s_sin + dims, mask=in_rd, other=0.0).to(tl.float32)
        out = y * c + sign * yp * sn
        if h < NH:
            tl.store(q_out + (t * NH + h) * D + dims, out.to(q_out.dtype.element_ty))
        else:
            kvh = h - NH
            dst = cache + slot * (NKV * D) + kvh * D + dims
            tl.store(dst, out.to(cache.dtype.element_ty))
            vv = tl.load(v + t * s_v_t + kvh * s_v_h + dims)
            tl.store(dst + s_c_kv, vv.to(cache.dtype.element_ty))


def _check_prologue(op, q, k, v, q_norm_weight, k_norm_weight, cos, sin, kv_cache, slot_mapping) -> None:
    _check_cache(op, kv_cache)
    nkv, d = kv_cache.shape[-2], kv_cache.shape[-1]
    check(q.dim() == 3 and q.shape[-1] == d, op, f"q must be [T, heads, {d}], got {tuple(q.shape)}")
    T = q.shape[0]
    check(k.shape == (T, nkv, d) and v.shape == k.shape, op,
          f"k and v must be [{T}, {nkv}, {d}], got {tuple(k.shape)}, {tuple(v.shape)}")
    check(q_norm_weight.shape == (d,) and k_norm_weight.shape == (d,), op,
          f"norm weights must be [{d}], got {tuple(q_norm_weight.shape)}, {tuple(k_norm_weight.shape)}")
    rd = cos.shape[-1] if cos.dim() == 2 else -1
    check(cos.dim() == 2 and cos.shape[0] == T and sin.shape == cos.shape and rd % 2 == 0 and 0 < rd <= d, op,
          f"cos and sin must be [{T}, rotary_dim] with an even rotary_dim <= {d}, got {tuple(cos.shape)}, "
          f"{tuple(sin.shape)}")
    check(slot_mapping.dim() == 1 and slot_mapping.shape[0] == T, op,
          f"slot_mapping must be [{T}], got {tuple(slot_mapping.shape)}")
    check(slot_mapping.dtype in (torch.int32, torch.int64), op,
          f"slot_mapping must be int32/int64, got {slot_mapping.dtype}")
    check(slot_mapping.is_contiguous(), op, "slot_mapping must be contiguous")
    check(q.dtype in ACTIVATION_DTYPES and k.dtype == q.dtype and v.dtype == q.dtype, op,
          f"q, k, v must share a float dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    check_last_contiguous(op, q=q, k=k, v=v, cos=cos, sin=sin, q_norm_weight=q_norm_weight,
                          k_norm_weight=k_norm_weight)
    check_same_device(op, q, k, v, cos, sin, kv_cache, slot_mapping, q_norm_weight, k_norm_weight)


def attention_prologue(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_norm_weight: torch.Tensor, k_norm_weight: torch.Tensor,
    eps: float, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """See reference.attention_prologue: one launch instead of two norms, two rotations (a dozen
    elementwise kernels) and the store. fp32 math; the normed values are rounded to the activation dtype
    as the reference's rms_norm output is, and the rotation is rounded once (the reference rounds each
    of its bf16 multiplies and the add: at most an ulp apart)."""
    op = "attention_prologue"
    _check_prologue(op, q, k, v, q_norm_weight, k_norm_weight, cos, sin, kv_cache, slot_mapping)
    T, nh, nkv, d, rd = q.shape[0], q.shape[1], kv_cache.shape[-2], kv_cache.shape[-1], cos.shape[-1]
    q_out = torch.empty((T, nh, d), dtype=q.dtype, device=q.device)
    if T == 0:
        return q_out
    _attn_prologue_kernel[(T, nh + nkv)](
        q, k, v, q_norm_weight, k_norm_weight, cos, sin, q_out, kv_cache, slot_mapping, float(eps),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0), sin.stride(0),
        kv_cache.stride(0), NH=nh, NKV=nkv, D=d, RD=rd, num_warps=2 if d <= 256 else 4, **_pdl(q.device))
    return q_out


# ---- paged attention ------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """Launch choices. block_m: query rows (token x head pairs) per program; block_n: keys per step;
    num_splits: key-range segments per tile (1 = no split-K); min_split: smallest segment in keys."""

    block_m: int = 16
    block_n: int = 64
    num_splits: int = 1
    min_split: int = 256
    num_warps: int = 4
    num_stages: int = 2


def _pdl(device: torch.device) -> dict:
    """Launch arguments of a programmatic dependent launch where the device has it (Hopper): the kernel
    becomes resident while its predecessor drains and waits for it (griddepcontrol.wait) before any load."""
    return dict(PDL=True, launch_pdl=True) if pdl_launch(device) else {}


def _device_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def default_attention_config(T: int, N: int, nh: int, nkv: int, d: int, device: torch.device,
                             max_query_len: int | None = None, dtype: torch.dtype = torch.bfloat16) -> AttentionConfig:
    """Decode-shaped batches (every sequence one token) get small query tiles and split-K when the
    (tile, KV head) programs cannot fill the GPU; batches with prefill chunks get wide tiles."""
    g = nh // nkv
    decode = max_query_len == 1 if max_query_len is not None else T <= N
    # tile choices measured on an H200 at head_dim 256 (benchmarks/attention_moe_ops.py --sweep)
    if decode:
        block_m = max(16, triton.next_power_of_2(g))
        block_n, warps, stages = 64, 4, 2
    else:
        block_m = max(128, triton.next_power_of_2(g))
        block_n, warps, stages = 64, (8 if d > 128 else 4), 2
    if dtype.itemsize >= 4:
        # fp32 operands are twice the bytes: the bf16 prefill tile (128 x 64, 2 stages) in fp32 needs 295 KB of
        # shared memory at head_dim 256 on sm_90 (a block has 227 KB) and fails to launch; 64 x 32 in one
        # stage needs 107 KB (`attention_moe_compile_check.py --fp32-attention` compiles them without a GPU)
        block_m = block_m if decode else max(64, triton.next_power_of_2(g))
        block_n, stages = 32, 1
    bq = block_m // g
    programs = (T // bq + N + 1) * nkv
    target = 4 * _device_sms(device)
    splits = 1
    if programs < target:
        splits = min(MAX_SPLITS, triton.cdiv(target, programs))
        cap = SPLIT_SCRATCH_BYTES // max(1, T * nh * (d + 2) * 4)
        splits = max(1, min(splits, cap))
    # decode segments may be one key tile long: at batch 1 with a short context the work is a few tiles,
    # and spreading them over programs beats walking them in a chain (prefill keeps 256-key segments)
    min_split = block_n if decode else AttentionConfig.min_split
    return AttentionConfig(block_m=block_m, block_n=block_n, num_splits=splits, min_split=min_split,
                           num_warps=warps, num_stages=stages)


@triton.jit
def _find_sequence(cu, N, p, BQ: tl.constexpr):
    """Largest n in [0, N] with first_tile(n) = cu[n] // BQ + n <= p (first_tile is non-decreasing)."""
    lo = p * 0
    hi = p * 0 + N
    while lo < hi:
        mid = (lo + hi + 1) // 2
        start = tl.load(cu + mid).to(tl.int32) // BQ + mid
        if start <= p:
            lo = mid
        else:
            hi = mid - 1
    return lo


@triton.jit
def _attend(qv, m_i, l_i, acc, cache, table, start, hi, q_pos, dims, qk_scale, s_c_kv, BS, head_off,
            NKV: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, IEEE: tl.constexpr):
    """One online-softmax step over keys [start, start + BLOCK_N) gathered through the block table.
    MASKED: the step may hold keys past `hi` or past a row's causal limit."""
    pos = start + tl.arange(0, BLOCK_N)
    if MASKED:
        key_ok = pos < hi
        blk = tl.load(table + pos // BS, mask=key_ok, other=0).to(tl.int64)
    else:
        blk = tl.load(table + pos // BS).to(tl.int64)
    kv_off = (blk * BS + pos % BS) * (NKV * D) + head_off
    if MASKED:
        kT = tl.load(cache + kv_off[None, :] + dims[:, None], mask=key_ok[None, :], other=0.0)
    else:
        kT = tl.load(cache + kv_off[None, :] + dims[:, None])
    if IEEE:
        s = tl.dot(qv, kT, input_precision="ieee")
    else:
        s = tl.dot(qv, kT)
    s = s * qk_scale
    if MASKED:
        s = tl.where(key_ok[None, :] & (pos[None, :] <= q_pos[:, None]), s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    pr = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(pr, 1)
    if MASKED:
        vv = tl.load(cache + s_c_kv + kv_off[:, None] + dims[None, :], mask=key_ok[:, None], other=0.0)
    else:
        vv = tl.load(cache + s_c_kv + kv_off[:, None] + dims[None, :])
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(pr.to(vv.dtype), vv, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(pr.to(vv.dtype), vv)
    return m_new, l_i, acc


# The split count is a runtime value (only split-or-not is a constant): in eager mixed steps it follows the
# batch, and as a constant each new value built a kernel variant in the middle of a step (H200: 1.5 s).
@triton.jit(do_not_specialize=["T", "N", "s_bt_n", "splits"])
def _attention_kernel(q, cache, cu, seq_lens, tables, out, part_ml, part_acc, qk_scale, T, N, splits,
                      s_q_t, s_q_h, s_bt_n, s_c_kv, BS,
                      NH: tl.constexpr, NKV: tl.constexpr, D: tl.constexpr, G: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
                      MIN_SPLIT: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr = False):
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    BQ: tl.constexpr = BLOCK_M // G
    p = tl.num_programs(0) - 1 - tl.program_id(0)   # last tiles (longest causal range) start first
    kvh = tl.program_id(1)
    split = tl.program_id(2)

    n = _find_sequence(cu, N, p, BQ)
    q_start = tl.load(cu + n).to(tl.int32)
    if n < N:
        q_end = tl.load(cu + n + 1).to(tl.int32)
        ctx = tl.load(seq_lens + n).to(tl.int32)
    else:  # the tail of rows past the last sequence: no keys, zero output
        q_end = T
        ctx = 0
    q_len = q_end - q_start
    tile = p - (q_start // BQ + n)
    if tile * BQ >= q_len:
        return

    rows = tl.arange(0, BLOCK_M)
    tok = tile * BQ + rows // G                          # token index inside the sequence
    head = kvh * G + rows % G
    row_ok = (rows < BQ * G) & (tok < q_len)
    q_pos = ctx - q_len + tok                            # absolute position of each query row
    t_glob = (q_start + tok).to(tl.int64)

    dims = tl.arange(0, D)
    qv = tl.load(q + t_glob[:, None] * s_q_t + head[:, None] * s_q_h + dims[None, :],
                 mask=row_ok[:, None], other=0.0)

    # keys [0, kv_hi) are visible to some row of the tile; this program takes one segment of them
    last_tok = tl.minimum(tile * BQ + BQ, q_len) - 1
    kv_hi = tl.minimum(ctx, ctx - q_len + last_tok + 1)
    kv_hi = tl.maximum(kv_hi, 0)
    if SPLIT:
        seg = tl.cdiv(tl.cdiv(kv_hi, splits), BLOCK_N) * BLOCK_N
        seg = tl.maximum(seg, MIN_SPLIT)
        lo = split * seg
        hi = tl.minimum(kv_hi, lo + seg)
    else:
        lo = 0
        hi = kv_hi

    m_i = tl.full([BLOCK_M], NEG_BIG, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    table = tables + n.to(tl.int64) * s_bt_n
    head_off = kvh * D
    # keys before the first row's causal limit are visible to every row: no masks there
    first_limit = tl.minimum(hi, ctx - q_len + tile * BQ + 1)
    full_hi = lo + tl.maximum(first_limit - lo, 0) // BLOCK_N * BLOCK_N
    for start in range(lo, full_hi, BLOCK_N):
        m_i, l_i, acc = _attend(qv, m_i, l_i, acc, cache, table, start, hi, q_pos, dims, qk_scale, s_c_kv, BS,
                                head_off, NKV, D, BLOCK_N, False, IEEE)
    for start in range(full_hi, hi, BLOCK_N):
        m_i, l_i, acc = _attend(qv, m_i, l_i, acc, cache, table, start, hi, q_pos, dims, qk_scale, s_c_kv, BS,
                                head_off, NKV, D, BLOCK_N, True, IEEE)

    if not SPLIT:
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out + (t_glob[:, None] * NH + head[:, None]) * D + dims[None, :], o.to(out.dtype.element_ty),
                 mask=row_ok[:, None])
    else:
        part = (t_glob * NH + head) * splits + split
        tl.store(part_ml + part * 2, m_i, mask=row_ok)
        tl.store(part_ml + part * 2 + 1, l_i, mask=row_ok)
        if hi > lo:  # empty segments leave their accumulator unwritten; the merge masks it by l == 0
            tl.store(part_acc + part[:, None] * D + dims[None, :], acc, mask=row_ok[:, None])


@triton.jit(do_not_specialize=["splits"])
def _merge_splits_kernel(part_ml, part_acc, out, splits, NH: tl.constexpr, SP: tl.constexpr,
                         BD: tl.constexpr, D: tl.constexpr, PDL: tl.constexpr = False):
    """out[t, h, dims] = sum_s w_s acc_s / sum_s w_s l_s with w_s = exp2(m_s - max_s m_s), for one token,
    one head and BD dims per program, every segment loaded at once (a loop over segments would be a
    chain of dependent loads: ~20 us at 64 segments). Segments with l == 0 (no visible keys) carry no
    weight and are not read."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    t = tl.program_id(0).to(tl.int64)
    row = t * NH + tl.program_id(1)
    s = tl.arange(0, SP)
    ok = s < splits
    part = row * splits + s
    m = tl.load(part_ml + part * 2, mask=ok, other=NEG_BIG)
    lsum = tl.load(part_ml + part * 2 + 1, mask=ok, other=0.0)
    w = tl.where(lsum > 0, tl.exp2(m - tl.max(m, 0)), 0.0)
    l_all = tl.sum(w * lsum, 0)
    w = w / tl.where(l_all > 0, l_all, 1.0)
    dims = tl.program_id(2) * BD + tl.arange(0, BD)
    a = tl.load(part_acc + part[:, None] * D + dims[None, :], mask=(w > 0)[:, None], other=0.0)
    tl.store(out + row * D + dims, tl.sum(a * w[:, None], 0).to(out.dtype.element_ty))


def _check_attention(op, q, kv_cache, cu_seqlens, seq_lens, block_tables, scale) -> None:
    _check_cache(op, kv_cache)
    nkv, d = kv_cache.shape[-2], kv_cache.shape[-1]
    check(q.dim() == 3 and q.shape[-1] == d, op, f"q must be [T, heads, {d}], got {tuple(q.shape)}")
    nh = q.shape[1]
    check(nh % nkv == 0, op, f"query heads {nh} must be a multiple of KV heads {nkv}")
    check(q.dtype == kv_cache.dtype, op, f"q dtype {q.dtype} must match kv_cache dtype {kv_cache.dtype}")
    check(seq_lens.dim() == 1, op, f"seq_lens must be [N], got {tuple(seq_lens.shape)}")
    N = seq_lens.shape[0]
    check(cu_seqlens.dim() == 1 and cu_seqlens.shape[0] == N + 1, op,
          f"cu_seqlens must be [{N + 1}] for {N} sequences, got {tuple(cu_seqlens.shape)}")
    check(block_tables.dim() == 2 and block_tables.shape[0] == N, op,
          f"block_tables must be [{N}, max_blocks], got {tuple(block_tables.shape)}")
    for name, t in (("cu_seqlens", cu_seqlens), ("seq_lens", seq_lens), ("block_tables", block_tables)):
        check(t.dtype in (torch.int32, torch.int64), op, f"{name} must be int32/int64, got {t.dtype}")
    check(cu_seqlens.is_contiguous() and seq_lens.is_contiguous(), op, "cu_seqlens and seq_lens must be contiguous")
    check(block_tables.stride(-1) == 1 or block_tables.shape[1] <= 1, op, "block_tables rows must be contiguous")
    check(scale > 0 and math.isfinite(scale), op, f"scale must be a positive finite number, got {scale}")
    check_last_contiguous(op, q=q)
    check_same_device(op, q, kv_cache, cu_seqlens, seq_lens, block_tables)


def paged_attention(
    q: torch.Tensor, kv_cache: torch.Tensor, *, cu_seqlens: torch.Tensor, seq_lens: torch.Tensor,
    block_tables: torch.Tensor, scale: float, max_query_len: int | None = None,
    config: AttentionConfig | None = None,
) -> torch.Tensor:
    """See reference.paged_attention. Optional, host-side only: `max_query_len` (the longest query chunk
    in the batch, if the caller knows it; 1 selects the decode launch shape, which is otherwise chosen
    when T <= N) and `config` (launch choices). Neither changes the result beyond rounding."""
    op = "paged_attention"
    _check_attention(op, q, kv_cache, cu_seqlens, seq_lens, block_tables, scale)
    check(max_query_len is None or max_query_len >= 1, op, f"max_query_len must be >= 1, got {max_query_len}")
    T, nh, N = q.shape[0], q.shape[1], seq_lens.shape[0]
    nkv, d, bs = kv_cache.shape[-2], kv_cache.shape[-1], kv_cache.shape[2]
    out = torch.empty((T, nh, d), dtype=q.dtype, device=q.device)
    if T == 0:
        return out
    cfg = config or default_attention_config(T, N, nh, nkv, d, q.device, max_query_len, q.dtype)
    g = nh // nkv
    check(cfg.block_m >= g and cfg.block_m >= 16 and cfg.block_m & (cfg.block_m - 1) == 0, op,
          f"config block_m={cfg.block_m} must be a power of two >= max(16, {g} query heads per KV head)")
    check(cfg.block_n >= 16 and cfg.block_n & (cfg.block_n - 1) == 0, op,
          f"config block_n={cfg.block_n} must be a power of two >= 16")
    check(1 <= cfg.num_splits <= MAX_SPLITS, op, f"config num_splits={cfg.num_splits} not in [1, {MAX_SPLITS}]")
    check(cfg.min_split % cfg.block_n == 0, op, "config min_split must be a multiple of block_n")
    bq = cfg.block_m // g
    splits = cfg.num_splits
    if splits > 1:
        part_ml = torch.empty((T, nh, splits, 2), dtype=torch.float32, device=q.device)
        part_acc = torch.empty((T, nh, splits, d), dtype=torch.float32, device=q.device)
    else:
        part_ml = part_acc = out
    grid = (T // bq + N + 1, nkv, splits)
    _attention_kernel[grid](
        q, kv_cache, cu_seqlens, seq_lens, block_tables, out, part_ml, part_acc, float(scale) * LOG2E, T, N, splits,
        q.stride(0), q.stride(1), block_tables.stride(0), kv_cache.stride(0), bs,
        NH=nh, NKV=nkv, D=d, G=g, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, SPLIT=splits > 1,
        MIN_SPLIT=cfg.min_split, IEEE=q.dtype == torch.float32,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **_pdl(q.device))
    if splits > 1:
        _merge_splits(part_ml, part_acc, out)
    return out


def _merge_splits(part_ml: torch.Tensor, part_acc: torch.Tensor, out: torch.Tensor) -> None:
    """out [T, NH, D] from the split-K partial results part_ml [T, NH, S, 2], part_acc [T, NH, S, D]."""
    T, nh, splits, d = part_acc.shape
    sp = triton.next_power_of_2(splits)
    bd = min(d, max(16, 4096 // sp))
    _merge_splits_kernel[(T, nh, d // bd)](part_ml, part_acc, out, splits, NH=nh, SP=sp, BD=bd, D=d,
                                           num_warps=4, **_pdl(out.device))


# ---- fused decode: prologue + attention + merge in one launch -----------------------------------------

@dataclasses.dataclass(frozen=True)
class DecodeAttentionConfig:
    """Launch choices of the one-launch decode path. max_splits: programs per (token, KV head) in the
    grid; min_tiles: key tiles a split takes at least (a sequence of `tiles` key tiles uses
    min(max_splits, cdiv(tiles, min_tiles)) of them, the rest exit at once); block_n: keys per step."""

    block_n: int = 64
    max_splits: int = 1
    min_tiles: int = 1
    num_warps: int = 4
    num_stages: int = 2
    prefetch_tiles: int = 0      # with PDL: key tiles per program asked of L2 before the wait (a hint)
    last_split_merges: bool = True   # False: the splits' results merged by _merge_splits_kernel (2 launches)


# Decode batches of at least this many (token, KV head) pairs merge their splits in the last split to finish
# (one launch); smaller ones take one key tile per split and merge in _merge_splits_kernel (two launches).
# H200, 35B-A3B shape (docs/PERFORMANCE.md, "Decode in one launch"): the one launch was 4 % faster than the
# old three launches at 64 and 256 sequences (128 and 512 pairs) and 1.4-2.3x slower at 1 and 8 sequences,
# where its merge and multi-tile splits add dependent memory round trips to the critical path; the two
# launches were 3-22 % faster than the three at 1 and 8 sequences (contexts 512-32768).
FUSED_DECODE_MIN_PAIRS = 128


def default_decode_config(N: int, nkv: int, d: int, sms: int,
                          dtype: torch.dtype = torch.bfloat16) -> DecodeAttentionConfig:
    """For N decode tokens on a device of `sms` multiprocessors: split-K while the (token, KV head)
    programs cannot fill the GPU; each split takes at least `min_tiles` key tiles (the last program to
    finish merges the splits: fewer, longer splits there)."""
    pairs = N * nkv
    splits = max(1, min(MAX_SPLITS, 4 * sms // pairs))
    cap = SPLIT_SCRATCH_BYTES // max(1, pairs * 16 * (d + 2) * 4)
    splits = max(1, min(splits, cap))
    block_n, stages = (64, 2) if dtype.itemsize < 4 else (32, 1)
    if pairs < FUSED_DECODE_MIN_PAIRS:
        # one tile per split, merged by the merge kernel; the L2 prefetch before the wait won at batch 1
        # (11.7 against 12.1 us at ctx 1152) and lost at batch 8 (22.8 against 22.2)
        return DecodeAttentionConfig(block_n=block_n, max_splits=splits, min_tiles=1, num_warps=4,
                                     num_stages=stages, prefetch_tiles=1 if N == 1 else 0, last_split_merges=False)
    return DecodeAttentionConfig(block_n=block_n, max_splits=splits, min_tiles=2, num_warps=4, num_stages=stages)


@triton.jit
def _rope_normed(x, xp, rstd, w, wp, c, sn, sign, OUT_DTYPE: tl.constexpr):
    """The prologue's math on loaded rows: zero-centred RMSNorm (rounded to the activation dtype, as the
    reference's rms_norm output is), then rotate-half RoPE in fp32, rounded once."""
    y = (x * rstd * (w + 1.0)).to(OUT_DTYPE).to(tl.float32)
    yp = (xp * rstd * (wp + 1.0)).to(OUT_DTYPE).to(tl.float32)
    return (y * c + sign * yp * sn).to(OUT_DTYPE)


@triton.jit
def _prefetch_tiles(cache, seq_lens, tables, n, kvh, split, s_bt_n, s_c_kv, BS, table_w, num_blocks,
                    NKV: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr,
                    MIN_TILES: tl.constexpr, TILES: tl.constexpr, LINE: tl.constexpr):
    """L2 prefetch of the keys and values of this split's first TILES tiles, from guessed inputs (LINE:
    elements per 128-byte line)."""
    ctx = tl.load(seq_lens + n, cache_modifier=".cg").to(tl.int32)
    tiles = tl.cdiv(ctx, BLOCK_N)
    active = tl.maximum(tl.minimum(tl.cdiv(tiles, MIN_TILES), SPLITS), 1)
    table = tables + n.to(tl.int64) * s_bt_n
    lines = tl.arange(0, D // LINE) * LINE             # one pointer per line of a row
    for j in tl.static_range(TILES):
        pos = (split + j * active) * BLOCK_N + tl.arange(0, BLOCK_N)
        ok = pos < ctx
        idx = tl.minimum(tl.maximum(pos // BS, 0), table_w - 1)
        blk = tl.load(table + idx, mask=ok, other=0, cache_modifier=".cg").to(tl.int64)
        blk = tl.minimum(tl.maximum(blk, 0), num_blocks - 1)
        row = cache + (blk * BS + pos % BS) * (NKV * D) + kvh * D
        m = ok[:, None] & (lines[None, :] >= 0)
        prefetch_l2(row[:, None] + lines[None, :], m)
        prefetch_l2(row[:, None] + s_c_kv + lines[None, :], m)


@triton.jit(do_not_specialize=["s_bt_n", "table_w", "num_blocks"])
def _decode_attention_kernel(q, k, v, q_w, k_w, cos, sin, cache, slots, seq_lens, tables, out,
                             part_ml, part_acc, counters, eps, qk_scale,
                             s_q_t, s_q_h, s_k_t, s_k_h, s_v_t, s_v_h, s_cos, s_sin, s_bt_n, s_c_kv, BS,
                             table_w, num_blocks,
                             NH: tl.constexpr, NKV: tl.constexpr, D: tl.constexpr, RD: tl.constexpr,
                             G: tl.constexpr, GM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                             SPLITS: tl.constexpr, SP: tl.constexpr, MIN_TILES: tl.constexpr,
                             MS: tl.constexpr, BD: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr = False,
                             PREFETCH_TILES: tl.constexpr = 0, LINE: tl.constexpr = 64,
                             LAST_MERGES: tl.constexpr = True):
    """One decode token (= sequence n), one KV head, one split of its keys per program:

    1. q: RMSNorm + RoPE of the G query heads of this KV head, on the load (every split does this; it is
       4 KB), exactly as the prologue computes and rounds it.
    2. The program owning the last key tile (it holds the new token's position ctx - 1) normalises and
       rotates the new key, stores key and value into the token's cache slot, and a CTA barrier orders
       those stores before its own tile loads (bar.sync orders global memory among the CTA's threads).
       No other program reads position ctx - 1: a decode token's slot is read only by its own sequence.
    3. Online softmax over the split's key tiles: tiles split, split + A, split + 2A, ... of the
       sequence, A = min(SPLITS, cdiv(tiles, MIN_TILES)) active splits (the others exit at once).
    4. With one active split it writes the output; otherwise it writes (max, sum, accumulator) in fp32,
       counts itself in on the (token, KV head) counter, and the last to arrive merges the A partial
       results into the output and resets the counter to zero (as the GDN decode kernel's tail does).
       Without LAST_MERGES (and SPLITS > 1) every split writes its partial result, inactive ones an
       empty one, in _merge_splits_kernel's layout, and that kernel merges them (a second launch).

    With PDL the kernel reads nothing before griddepcontrol.wait but, with PREFETCH_TILES, a guess of its
    context length and block table (L2 only) from which it asks L2 for the lines of its first key tiles:
    the old keys are not written in this step, so the DRAM latency overlaps the kernel before; a stale
    guess costs bandwidth, never a wrong value (every address is clamped into its buffer)."""
    n = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    if PDL:
        if PREFETCH_TILES > 0:
            _prefetch_tiles(cache, seq_lens, tables, n, kvh, split, s_bt_n, s_c_kv, BS, table_w, num_blocks,
                            NKV, D, BLOCK_N, SPLITS, MIN_TILES, PREFETCH_TILES, LINE)
        gdc_wait()
        gdc_launch_dependents()
    t = n.to(tl.int64)
    # every load the program needs that does not depend on the context length, in one batch
    ctx = tl.load(seq_lens + n).to(tl.int32)
    slot = tl.load(slots + t).to(tl.int64)
    dims = tl.arange(0, D)
    HALF: tl.constexpr = RD // 2
    partner = tl.where(dims < HALF, dims + HALF, tl.where(dims < RD, dims - HALF, dims))
    sign = tl.where(dims < HALF, -1.0, 1.0)
    in_rd = dims < RD
    c = tl.load(cos + t * s_cos + dims, mask=in_rd, other=1.0).to(tl.float32)
    sn = tl.load(sin + t * s_sin + dims, mask=in_rd, other=0.0).to(tl.float32)
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < G
    head = kvh * G + rows
    qp = q + t * s_q_t + head[:, None] * s_q_h
    x = tl.load(qp + dims[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
    xp = tl.load(qp + partner[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
    kp = k + t * s_k_t + kvh * s_k_h
    kx = tl.load(kp + dims).to(tl.float32)
    kxp = tl.load(kp + partner).to(tl.float32)
    vv_new = tl.load(v + t * s_v_t + kvh * s_v_h + dims)
    qw = tl.load(q_w + dims).to(tl.float32)
    qwp = tl.load(q_w + partner).to(tl.float32)
    kw = tl.load(k_w + dims).to(tl.float32)
    kwp = tl.load(k_w + partner).to(tl.float32)

    tiles = tl.cdiv(ctx, BLOCK_N)
    active = tl.maximum(tl.minimum(tl.cdiv(tiles, MIN_TILES), SPLITS), 1)
    if split >= active:
        if SPLITS > 1 and not LAST_MERGES:  # the merge kernel reads every split: this one has no keys
            part = (t * NH + kvh * G + rows) * SPLITS + split
            tl.store(part_ml + part * 2, tl.full([BLOCK_M], NEG_BIG, dtype=tl.float32), mask=row_ok)
            tl.store(part_ml + part * 2 + 1, tl.zeros([BLOCK_M], dtype=tl.float32), mask=row_ok)
        return
    owner = tl.maximum(tiles - 1, 0) % active
    # the new key and value, stored by the owner of the last tile before it reads that tile
    knew = _rope_normed(kx, kxp, tl.rsqrt(tl.sum(kx * kx, 0) / D + eps), kw, kwp, c, sn, sign,
                        cache.dtype.element_ty)
    dst = cache + slot * (NKV * D) + kvh * D + dims
    store_new = (dims >= 0) & (slot >= 0) & (split == owner) & (ctx > 0)
    tl.store(dst, knew, mask=store_new)
    tl.store(dst + s_c_kv, vv_new.to(cache.dtype.element_ty), mask=store_new)
    rstd = tl.rsqrt(tl.sum(x * x, 1) / D + eps)
    qv = _rope_normed(x, xp, rstd[:, None], qw[None, :], qwp[None, :], c[None, :], sn[None, :], sign[None, :],
                      cache.dtype.element_ty)
    tl.debug_barrier()

    m_i = tl.full([BLOCK_M], NEG_BIG, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    table = tables + n.to(tl.int64) * s_bt_n
    head_off = kvh * D
    q_pos = tl.zeros([BLOCK_M], dtype=tl.int32) + ctx - 1
    kv_full = ctx // BLOCK_N * BLOCK_N
    for start in range(split * BLOCK_N, kv_full, active * BLOCK_N):
        m_i, l_i, acc = _attend(qv, m_i, l_i, acc, cache, table, start, ctx, q_pos, dims, qk_scale, s_c_kv, BS,
                                head_off, NKV, D, BLOCK_N, False, IEEE)
    tail = tl.where(split == owner, kv_full, ctx)       # the partial last tile, if any: its owner's
    for start in range(tail, ctx, BLOCK_N):
        m_i, l_i, acc = _attend(qv, m_i, l_i, acc, cache, table, start, ctx, q_pos, dims, qk_scale, s_c_kv, BS,
                                head_off, NKV, D, BLOCK_N, True, IEEE)

    out_rows = out + (t * NH + head[:, None]) * D
    if SPLITS > 1 and not LAST_MERGES:  # partial results in _merge_splits_kernel's layout, merged by it
        part = (t * NH + head) * SPLITS + split
        tl.store(part_ml + part * 2, m_i, mask=row_ok)
        tl.store(part_ml + part * 2 + 1, l_i, mask=row_ok)
        tl.store(part_acc + part[:, None] * D + dims[None, :], acc, mask=row_ok[:, None])
    elif active == 1:   # the only split (or no keys: zeros, as the reference leaves them)
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_rows + dims[None, :], o.to(out.dtype.element_ty), mask=row_ok[:, None])
    else:
        group = t * NKV + kvh
        part = (group * SPLITS + split) * GM + rows
        tl.store(part_ml + part * 2, m_i, mask=row_ok)
        tl.store(part_ml + part * 2 + 1, l_i, mask=row_ok)
        tl.store(part_acc + part[:, None] * D + dims[None, :], acc, mask=row_ok[:, None])
        tl.debug_barrier()   # every thread's partial stores precede the release below
        cnt = counters + group
        arrived = tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu")
        if arrived == active - 1:     # the last split of this (token, KV head): merge
            tl.store(cnt, 0)
            sp = tl.arange(0, SP)
            g = tl.arange(0, GM)
            ml_ok = (sp[:, None] < active) & (g[None, :] < G)
            pml = part_ml + ((group * SPLITS + sp[:, None]) * GM + g[None, :]) * 2
            m_all = tl.load(pml, mask=ml_ok, other=NEG_BIG, cache_modifier=".cg")
            l_all = tl.load(pml + 1, mask=ml_ok, other=0.0, cache_modifier=".cg")
            m_max = tl.max(m_all, 0)                                          # [GM]
            l_tot = tl.sum(tl.where(ml_ok, tl.exp2(m_all - m_max[None, :]) * l_all, 0.0), 0)
            inv = 1.0 / tl.where(l_tot > 0, l_tot, 1.0)
            ms = tl.arange(0, MS)
            bd = tl.arange(0, BD)
            for dc in tl.static_range(D // BD):
                o = tl.zeros([GM, BD], dtype=tl.float32)
                for j0 in range(0, active, MS):
                    sj = j0 + ms
                    ok2 = (sj[:, None] < active) & (g[None, :] < G)
                    pj = (group * SPLITS + sj[:, None]) * GM + g[None, :]                   # [MS, GM]
                    mj = tl.load(part_ml + pj * 2, mask=ok2, other=NEG_BIG, cache_modifier=".cg")
                    wj = tl.where(ok2, tl.exp2(mj - m_max[None, :]), 0.0) * inv[None, :]
                    a = tl.load(part_acc + pj[:, :, None] * D + dc * BD + bd[None, None, :], mask=ok2[:, :, None],
                                other=0.0, cache_modifier=".cg")
                    o += tl.sum(a * wj[:, :, None], 0)
                tl.store(out + (t * NH + kvh * G + g[:, None]) * D + dc * BD + bd[None, :],
                         o.to(out.dtype.element_ty), mask=(g < G)[:, None])


def _decode_counters(device: torch.device, groups: int) -> torch.Tensor:
    """Zeroed int32 counters, one per (token, KV head), for _decode_attention_kernel; every launch leaves
    them zero again. Shared by all calls on a device (the layers' calls are stream-ordered; two launches
    must not run concurrently)."""
    return _zeroed_counters(device, triton.next_power_of_2(max(groups, 4096)))


@functools.cache
def _zeroed_counters(device: torch.device, size: int) -> torch.Tensor:
    # A cache, as in ops/gdn/triton_recurrent.py: the op's signature has no workspace, and zeroing a fresh
    # buffer on every call would add back a launch the one-launch path removes.
    return torch.zeros(size, dtype=torch.int32, device=device)


def fused_paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_norm_weight: torch.Tensor, k_norm_weight: torch.Tensor,
    eps: float, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor, *,
    cu_seqlens: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor, scale: float,
    max_query_len: int | None = None, config: DecodeAttentionConfig | None = None,
) -> torch.Tensor:
    """See reference.fused_paged_attention. With max_query_len == 1 (the caller promises one token per
    sequence; the reference checks it, this op cannot without a host sync) the op runs
    _decode_attention_kernel with `config` or default_decode_config (one launch, or two with the merge
    kernel); otherwise attention_prologue then paged_attention."""
    op = "fused_paged_attention"
    T, N = q.shape[0], seq_lens.shape[0]
    check(max_query_len is None or max_query_len >= 1, op, f"max_query_len must be >= 1, got {max_query_len}")
    nkv = kv_cache.shape[-2] if kv_cache.dim() == 5 else 1
    decode = max_query_len == 1 and T == N
    check(config is None or decode, op, "config applies to the one-launch decode path only "
          "(max_query_len=1, one token per sequence)")
    if not decode:
        qr = attention_prologue(q, k, v, q_norm_weight, k_norm_weight, eps, cos, sin, kv_cache, slot_mapping)
        return paged_attention(qr, kv_cache, cu_seqlens=cu_seqlens, seq_lens=seq_lens, block_tables=block_tables,
                               scale=scale, max_query_len=max_query_len)
    _check_prologue(op, q, k, v, q_norm_weight, k_norm_weight, cos, sin, kv_cache, slot_mapping)
    _check_attention(op, q, kv_cache, cu_seqlens, seq_lens, block_tables, scale)
    nh, d, bs = q.shape[1], kv_cache.shape[-1], kv_cache.shape[2]
    g = nh // nkv
    cfg = config or default_decode_config(N, nkv, d, _device_sms(q.device), q.dtype)
    check(cfg.block_n >= 16 and cfg.block_n & (cfg.block_n - 1) == 0, op,
          f"config block_n={cfg.block_n} must be a power of two >= 16")
    check(1 <= cfg.max_splits <= MAX_SPLITS and cfg.min_tiles >= 1 and cfg.prefetch_tiles >= 0, op,
          f"config max_splits={cfg.max_splits} not in [1, {MAX_SPLITS}], min_tiles={cfg.min_tiles} < 1 or "
          f"prefetch_tiles={cfg.prefetch_tiles} < 0")
    out = torch.empty((T, nh, d), dtype=q.dtype, device=q.device)
    if T == 0:
        return out
    gm = triton.next_power_of_2(g)
    splits = cfg.max_splits
    merge_kernel = splits > 1 and not cfg.last_split_merges
    if merge_kernel:
        part_ml = torch.empty((N, nh, splits, 2), dtype=torch.float32, device=q.device)
        part_acc = torch.empty((N, nh, splits, d), dtype=torch.float32, device=q.device)
        counters = out
    elif splits > 1:
        part_ml = torch.empty((N, nkv, splits, gm, 2), dtype=torch.float32, device=q.device)
        part_acc = torch.empty((N, nkv, splits, gm, d), dtype=torch.float32, device=q.device)
        counters = _decode_counters(q.device, N * nkv)
    else:
        part_ml = part_acc = counters = out
    sp = triton.next_power_of_2(splits)
    ms = min(sp, 8)                                      # partial results merged per step
    bd = min(d, max(16, 64 * 32 * cfg.num_warps // (ms * gm)))   # ~64 fp32 registers a thread per step
    _decode_attention_kernel[(N, nkv, splits)](
        q, k, v, q_norm_weight, k_norm_weight, cos, sin, kv_cache, slot_mapping, seq_lens, block_tables, out,
        part_ml, part_acc, counters, float(eps), float(scale) * LOG2E,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0), sin.stride(0),
        block_tables.stride(0), kv_cache.stride(0), bs, max(1, block_tables.shape[1]), kv_cache.shape[1],
        NH=nh, NKV=nkv, D=d, RD=cos.shape[-1], G=g, GM=gm, BLOCK_M=max(16, gm), BLOCK_N=cfg.block_n,
        SPLITS=splits, SP=sp, MIN_TILES=cfg.min_tiles, MS=ms, BD=bd, IEEE=q.dtype == torch.float32,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **_pdl(q.device),
        LAST_MERGES=not merge_kernel,
        **({"PREFETCH_TILES": cfg.prefetch_tiles, "LINE": min(d, 128 // kv_cache.element_size())}
           if pdl_launch(q.device) else {}))
    if merge_kernel:
        _merge_splits(part_ml, part_acc, out)
    return out
