"""Triton paged attention (same signature and masking as reference.paged_attention).

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
  output) in fp32, and a second kernel merges them (triton_merge.py). Segments are sized on device from
  the context length, so the host needs no per-sequence lengths.

Numerics differ from the reference (which rounds scores and probabilities to the activation dtype) only
by that rounding: fp32 inputs agree to ~1e-6.

On Hopper the attention and merge kernels are programmatic dependent launches (PDL): each becomes
resident while the kernel before it drains, waits for it (griddepcontrol.wait) before any load, and
releases the next one at once.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ..quant.fp8 import FP8_DTYPE, Fp8KvCache
from ..triton_common import check, check_last_contiguous, check_same_device, pdl_launch_args
from .config import MAX_SPLITS, AttentionConfig, default_attention_config
from .triton_merge import NEG_BIG, merge_splits
from .triton_prologue import kv8_args, pool, split_cache

LOG2E = 1.4426950408889634


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
def kv_multipliers(kv_scale, kvh, s_sc_kv, s_sc_h, KV8: tl.constexpr):
    """An FP8 cache's (key, value) dequantisation multipliers for KV head kvh (s_sc_h 0: per tensor); 1, 1
    for a cache in the activation dtype."""
    if KV8:
        return tl.load(kv_scale + kvh * s_sc_h), tl.load(kv_scale + s_sc_kv + kvh * s_sc_h)
    else:
        return 1.0, 1.0


@triton.jit
def _attend(qv, m_i, l_i, acc, cache, table, start, hi, q_pos, dims, qk_scale, s_c_kv, BS, head_off,
            NKV: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, IEEE: tl.constexpr,
            k_mul=1.0, v_mul=1.0, KV8: tl.constexpr = False):
    """One online-softmax step over keys [start, start + BLOCK_N) gathered through the block table.
    MASKED: the step may hold keys past `hi` or past a row's causal limit. KV8: the cache holds e4m3 bits
    (uint8), dequantised on load as the reference does: (value * multiplier) rounded to q's dtype."""
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
    if KV8:
        kT = (kT.to(tl.float8e4nv, bitcast=True).to(tl.float32) * k_mul).to(qv.dtype)
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
    if KV8:
        vv = (vv.to(tl.float8e4nv, bitcast=True).to(tl.float32) * v_mul).to(qv.dtype)
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(pr.to(vv.dtype), vv, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(pr.to(vv.dtype), vv)
    return m_new, l_i, acc


# The split count is a runtime value (only split-or-not is a constant): in eager mixed steps it follows the
# batch, and as a constant each new value would compile a kernel variant in the middle of a step.
@triton.jit(do_not_specialize=["T", "N", "s_bt_n", "splits"])
def _attention_kernel(q, cache, cu, seq_lens, tables, out, part_ml, part_acc, qk_scale, T, N, splits,
                      s_q_t, s_q_h, s_bt_n, s_c_kv, BS,
                      NH: tl.constexpr, NKV: tl.constexpr, D: tl.constexpr, G: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
                      MIN_SPLIT: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr = False,
                      kv_scale=None, s_sc_kv=0, s_sc_h=0, KV8: tl.constexpr = False):
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
    k_mul, v_mul = kv_multipliers(kv_scale, kvh, s_sc_kv, s_sc_h, KV8)
    # keys before the first row's causal limit are visible to every row: no masks there
    first_limit = tl.minimum(hi, ctx - q_len + tile * BQ + 1)
    full_hi = lo + tl.maximum(first_limit - lo, 0) // BLOCK_N * BLOCK_N
    for start in range(lo, full_hi, BLOCK_N):
        m_i, l_i, acc = _attend(qv, m_i, l_i, acc, cache, table, start, hi, q_pos, dims, qk_scale, s_c_kv, BS,
                                head_off, NKV, D, BLOCK_N, False, IEEE, k_mul, v_mul, KV8)
    for start in range(full_hi, hi, BLOCK_N):
        m_i, l_i, acc = _attend(qv, m_i, l_i, acc, cache, table, start, hi, q_pos, dims, qk_scale, s_c_kv, BS,
                                head_off, NKV, D, BLOCK_N, True, IEEE, k_mul, v_mul, KV8)

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


def check_attention(op, q, kv_cache, cu_seqlens, seq_lens, block_tables, scale) -> None:
    kv_cache, _ = split_cache(op, kv_cache)
    nkv, d = kv_cache.shape[-2], kv_cache.shape[-1]
    check(q.dim() == 3 and q.shape[-1] == d, op, f"q must be [T, heads, {d}], got {tuple(q.shape)}")
    nh = q.shape[1]
    check(nh % nkv == 0, op, f"query heads {nh} must be a multiple of KV heads {nkv}")
    check(q.dtype == kv_cache.dtype or kv_cache.dtype == FP8_DTYPE, op,
          f"q dtype {q.dtype} must match kv_cache dtype {kv_cache.dtype}")
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
    q: torch.Tensor, kv_cache: torch.Tensor | Fp8KvCache, *, cu_seqlens: torch.Tensor, seq_lens: torch.Tensor,
    block_tables: torch.Tensor, scale: float, max_query_len: int | None = None,
    config: AttentionConfig | None = None,
) -> torch.Tensor:
    """See reference.paged_attention. Optional, host-side only: `max_query_len` (the longest query chunk
    in the batch, if the caller knows it; 1 selects the decode launch shape, which is otherwise chosen
    when T <= N) and `config` (launch choices). Neither changes the result beyond rounding."""
    op = "paged_attention"
    check_attention(op, q, kv_cache, cu_seqlens, seq_lens, block_tables, scale)
    kv_cache, fp8 = split_cache(op, kv_cache)
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
        q, pool(kv_cache), cu_seqlens, seq_lens, block_tables, out, part_ml, part_acc, float(scale) * LOG2E, T, N, splits,
        q.stride(0), q.stride(1), block_tables.stride(0), kv_cache.stride(0), bs,
        NH=nh, NKV=nkv, D=d, G=g, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, SPLIT=splits > 1,
        MIN_SPLIT=cfg.min_split, IEEE=q.dtype == torch.float32,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_launch_args(q.device), **kv8_args(fp8))
    if splits > 1:
        merge_splits(part_ml, part_acc, out)
    return out
