"""Triton one-launch decode attention: attention_prologue and paged_attention together for a batch of
one token per sequence (triton.fused_paged_attention's decode path). _decode_attention_kernel's docstring
has the steps: q norm + RoPE on the load, the new key stored by the owner of the last key tile, online
softmax over the split's key tiles. Large batches (>= config.FUSED_DECODE_MIN_PAIRS (token, KV head)
pairs) run in one launch, the splits merged by the last split to finish; smaller ones take one key tile
per split and the merge kernel (triton_merge.py; two launches).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ..triton_common import check, pdl_launch, pdl_launch_args, prefetch_l2
from .config import MAX_SPLITS, DecodeAttentionConfig, default_decode_config, device_sms
from .triton_merge import NEG_BIG, merge_splits
from .triton_paged import LOG2E, _attend, kv_multipliers
from .triton_prologue import cache_value, kv8_args, pool, split_cache


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
                             LAST_MERGES: tl.constexpr = True, kv_scale=None, s_sc_kv=0, s_sc_h=0,
                             KV8: tl.constexpr = False):
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
    guess costs bandwidth, never a wrong value (every address is clamped into its buffer).

    KV8: the pool holds e4m3 bits (uint8) with the layer's multipliers kv_scale: the new key and value are
    quantised on the store and every tile dequantised on the load (triton_prologue.cache_value, _attend)."""
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
                        out.dtype.element_ty)
    k_mul, v_mul = kv_multipliers(kv_scale, kvh, s_sc_kv, s_sc_h, KV8)
    dst = cache + slot * (NKV * D) + kvh * D + dims
    store_new = (dims >= 0) & (slot >= 0) & (split == owner) & (ctx > 0)
    tl.store(dst, cache_value(knew, k_mul, cache, KV8), mask=store_new)
    tl.store(dst + s_c_kv, cache_value(vv_new, v_mul, cache, KV8), mask=store_new)
    rstd = tl.rsqrt(tl.sum(x * x, 1) / D + eps)
    qv = _rope_normed(x, xp, rstd[:, None], qw[None, :], qwp[None, :], c[None, :], sn[None, :], sign[None, :],
                      out.dtype.element_ty)
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
                                head_off, NKV, D, BLOCK_N, False, IEEE, k_mul, v_mul, KV8)
    tail = tl.where(split == owner, kv_full, ctx)       # the partial last tile, if any: its owner's
    for start in range(tail, ctx, BLOCK_N):
        m_i, l_i, acc = _attend(qv, m_i, l_i, acc, cache, table, start, ctx, q_pos, dims, qk_scale, s_c_kv, BS,
                                head_off, NKV, D, BLOCK_N, True, IEEE, k_mul, v_mul, KV8)

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


def decode_counters(device: torch.device, groups: int) -> torch.Tensor:
    """Zeroed int32 counters, one per (token, KV head), for _decode_attention_kernel; every launch leaves
    them zero again. Shared by all calls on a device (the layers' calls are stream-ordered; two launches
    must not run concurrently)."""
    return _zeroed_counters(device, triton.next_power_of_2(max(groups, 4096)))


@functools.cache
def _zeroed_counters(device: torch.device, size: int) -> torch.Tensor:
    # A cache, as in ops/gdn/triton_steps.py: the op's signature has no workspace, and zeroing a fresh
    # buffer on every call would add back a launch the one-launch path removes.
    return torch.zeros(size, dtype=torch.int32, device=device)


def decode_attention(q, k, v, q_norm_weight, k_norm_weight, eps, cos, sin, kv_cache, slot_mapping, *,
                     seq_lens, block_tables, scale, config: DecodeAttentionConfig | None) -> torch.Tensor:
    """fused_paged_attention on checked decode inputs (one token per sequence) with `config` or
    default_decode_config."""
    op = "fused_paged_attention"
    kv_cache, fp8 = split_cache(op, kv_cache)
    T, N = q.shape[0], seq_lens.shape[0]
    nkv = kv_cache.shape[-2]
    nh, d, bs = q.shape[1], kv_cache.shape[-1], kv_cache.shape[2]
    g = nh // nkv
    cfg = config or default_decode_config(N, nkv, d, device_sms(q.device), q.dtype)
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
        counters = decode_counters(q.device, N * nkv)
    else:
        part_ml = part_acc = counters = out
    sp = triton.next_power_of_2(splits)
    ms = min(sp, 8)                                      # partial results merged per step
    bd = min(d, max(16, 64 * 32 * cfg.num_warps // (ms * gm)))   # ~64 fp32 registers a thread per step
    _decode_attention_kernel[(N, nkv, splits)](
        q, k, v, q_norm_weight, k_norm_weight, cos, sin, pool(kv_cache), slot_mapping, seq_lens, block_tables, out,
        part_ml, part_acc, counters, float(eps), float(scale) * LOG2E,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0), sin.stride(0),
        block_tables.stride(0), kv_cache.stride(0), bs, max(1, block_tables.shape[1]), kv_cache.shape[1],
        NH=nh, NKV=nkv, D=d, RD=cos.shape[-1], G=g, GM=gm, BLOCK_M=max(16, gm), BLOCK_N=cfg.block_n,
        SPLITS=splits, SP=sp, MIN_TILES=cfg.min_tiles, MS=ms, BD=bd, IEEE=q.dtype == torch.float32,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_launch_args(q.device),
        LAST_MERGES=not merge_kernel, **kv8_args(fp8),
        **({"PREFETCH_TILES": cfg.prefetch_tiles, "LINE": min(d, 128 // kv_cache.element_size())}
           if pdl_launch(q.device) else {}))
    if merge_kernel:
        merge_splits(part_ml, part_acc, out)
    return out
