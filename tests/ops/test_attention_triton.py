"""Paged attention and KV store (Triton) against the plain-torch references: ragged prefill chunks that
continue from cached context mixed with decodes, block tables out of order, GQA ratios 1/2/8, head_dim
64 and 256, split-K, padded slots and rows, and chunked == whole. fused_paged_attention (prologue +
attention; one launch for decode batches) against the reference composition: random decode batches
(contexts ending mid-block, empty padded rows, shuffled tables), the new token's key read by its own
split, the merge by the last split, CUDA-graph replay == eager."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from deltaserve.ops.attention import reference as ref
from deltaserve.ops.attention import config as attn_config
from deltaserve.ops.attention import triton as tri
from deltaserve.ops.attention import triton_decode

from .helpers import assert_close, cu_seqlens, gen, randn

TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2}
MIXED = dict(q_lens=[15, 17, 16, 1, 1, 1], ctx=[15, 60, 16, 1, 17, 100])   # prefills first, then decodes


class Paged:
    """A one-layer paged cache with random contents and shuffled block tables for the given contexts."""

    def __init__(self, ctx, nkv, d, *, bs=16, dtype=torch.float32, device="cpu", seed=0, spare_cols=2):
        g = gen(seed)
        self.g, self.dtype, self.device, self.bs = g, dtype, device, bs
        need = [-(-c // bs) for c in ctx]
        num_blocks = sum(need) + 3
        self.cache = randn(2, num_blocks, bs, nkv, d, g=g, dtype=dtype, device=device)
        perm = torch.randperm(num_blocks, generator=g)
        tables = torch.full((len(ctx), max(need, default=0) + spare_cols), 10**6, dtype=torch.int32)  # junk past the end
        used = 0
        for n, k in enumerate(need):
            tables[n, :k] = perm[used:used + k]
            used += k
        self.tables = tables.to(device)
        self.seq_lens = torch.tensor(ctx, dtype=torch.int32, device=device)

    def slots(self, q_lens, ctx):
        """Flat cache slots of the new tokens (the last q_len positions of each context)."""
        out = []
        for n, (L, c) in enumerate(zip(q_lens, ctx)):
            for p in range(c - L, c):
                out.append(int(self.tables[n, p // self.bs]) * self.bs + p % self.bs)
        return torch.tensor(out, dtype=torch.int64, device=self.device)


def _run_both(q, paged, q_lens, scale, **kw):
    args = dict(cu_seqlens=cu_seqlens(q_lens, q.device), seq_lens=paged.seq_lens, block_tables=paged.tables,
                scale=scale)
    return ref.paged_attention(q, paged.cache, **args), tri.paged_attention(q, paged.cache, **args, **kw)


@pytest.mark.parametrize("nh,nkv,d,dtype", [
    (2, 2, 64, torch.float32),        # MHA
    (4, 2, 64, torch.bfloat16),       # GQA 2
    (8, 1, 256, torch.float32),       # GQA 8, the real head size
    (2, 1, 256, torch.bfloat16),
])
def test_mixed_batch_matches_reference(nh, nkv, d, dtype, device):
    q_lens, ctx = MIXED["q_lens"], MIXED["ctx"]
    paged = Paged(ctx, nkv, d, dtype=dtype, device=device, seed=nh + d)
    q = randn(sum(q_lens), nh, d, g=paged.g, dtype=dtype, device=device)
    o_ref, o_tri = _run_both(q, paged, q_lens, d ** -0.5)
    assert_close(o_tri, o_ref, TOL[dtype], f"attention nh={nh} nkv={nkv} d={d} {dtype}")


@pytest.mark.parametrize("config", [
    tri.AttentionConfig(block_m=16, block_n=16, num_splits=1),
    tri.AttentionConfig(block_m=16, block_n=16, num_splits=5, min_split=16),     # split-K, some segments empty
    tri.AttentionConfig(block_m=32, block_n=32, num_splits=2, min_split=32),
])
def test_launch_configs_agree(config, device):
    """Tile sizes and split-K change nothing beyond rounding; one prefill of 100 tokens on a block size of 8."""
    q_lens, ctx = [100, 1, 1, 3], [100, 100, 9, 40]
    paged = Paged(ctx, 2, 64, bs=8, device=device, seed=3)
    q = randn(sum(q_lens), 4, 64, g=paged.g, device=device)
    o_ref, o_tri = _run_both(q, paged, q_lens, 0.125, config=config)
    assert_close(o_tri, o_ref, TOL[torch.float32], str(config))


def test_padding_rows_and_empty_sequences_are_zero(device):
    """A sequence with no context (a padded batch row) and rows past cu_seqlens[-1] give zeros, as the
    reference leaves them; the other sequences are unaffected."""
    q_lens, ctx = [3, 1, 1], [5, 0, 9]
    paged = Paged(ctx, 1, 64, device=device, seed=5)
    T = sum(q_lens) + 2                              # two trailing rows that belong to no sequence
    q = randn(T, 2, 64, g=paged.g, device=device)
    for splits in (1, 3):
        o_ref, o_tri = _run_both(q, paged, q_lens, 0.125,
                                 config=tri.AttentionConfig(block_m=16, block_n=16, num_splits=splits, min_split=16))
        assert_close(o_tri, o_ref, TOL[torch.float32], f"splits={splits}")
        assert (o_tri[3] == 0).all() and (o_tri[5:] == 0).all()


def test_store_kv_matches_reference(device):
    g = gen(11)
    nkv, d, bs, blocks = 2, 64, 16, 6
    cache = randn(2, blocks, bs, nkv, d, g=g, device=device)
    # k, v as strided column views of one projection output, as the attention layer produces them
    proj = randn(7, 3 * nkv * d + 5, g=g, device=device)
    k = proj[:, : nkv * d].view(7, nkv, d)
    v = proj[:, 2 * nkv * d: 3 * nkv * d].view(7, nkv, d)
    slots = torch.tensor([37, -1, 5, 90, -1, 16, 0], dtype=torch.int64, device=device)
    c_ref, c_tri = cache.clone(), cache.clone()
    ref.store_kv(k, v, c_ref, slots)
    tri.store_kv(k, v, c_tri, slots)
    assert torch.equal(c_tri, c_ref)
    assert not torch.equal(c_tri, cache)


def test_chunked_prefill_then_decode_equals_whole(device):
    """One sequence written and attended in three chunks (16, 23, then 1 decode token) gives the same rows
    as one pass over all 40 tokens: the continuation reads what the earlier chunks stored."""
    nh, nkv, d, bs = 4, 2, 64, 16
    g = gen(21)
    total = 40
    q = randn(total, nh, d, g=g, device=device)
    k = randn(total, nkv, d, g=g, device=device)
    v = randn(total, nkv, d, g=g, device=device)
    table = torch.tensor([[4, 0, 2]], dtype=torch.int32, device=device)
    slots = torch.tensor([int(table[0, p // bs]) * bs + p % bs for p in range(total)], device=device)

    def run(cache, lo, hi):
        tri.store_kv(k[lo:hi], v[lo:hi], cache, slots[lo:hi])
        return tri.paged_attention(q[lo:hi], cache, cu_seqlens=cu_seqlens([hi - lo], device),
                                   seq_lens=torch.tensor([hi], dtype=torch.int32, device=device),
                                   block_tables=table, scale=d ** -0.5)

    whole = run(torch.zeros(2, 5, bs, nkv, d, device=device), 0, total)
    cache = torch.zeros(2, 5, bs, nkv, d, device=device)
    parts = torch.cat([run(cache, 0, 16), run(cache, 16, 39), run(cache, 39, 40)])
    assert_close(parts, whole, 1e-6, "chunked vs whole")


@pytest.mark.parametrize("bad, match", [
    (dict(q_heads=3), "multiple of KV heads"),
    (dict(d=96), "head_dim"),
    (dict(q_dtype=torch.bfloat16), "dtype"),
    (dict(cu_len=2), "cu_seqlens"),
    (dict(cache_strided=True), "contiguous"),
])
def test_bad_inputs_raise(bad, match, device):
    d = bad.get("d", 64)
    cache = torch.zeros(2, 4, 16, 2, d, device=device)
    if bad.get("cache_strided"):
        cache = torch.zeros(2, 4, 16, 4, d, device=device)[:, :, :, ::2]
    q = torch.zeros(3, bad.get("q_heads", 4), d, dtype=bad.get("q_dtype", torch.float32), device=device)
    cu = torch.tensor([0, 3, 3][: bad.get("cu_len", 3)], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match=match):
        tri.paged_attention(q, cache, cu_seqlens=cu, seq_lens=torch.tensor([3, 0], dtype=torch.int32, device=device),
                            block_tables=torch.zeros(2, 1, dtype=torch.int32, device=device), scale=0.125)


# ---- real shapes on the GPU ------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("nh,nkv", [(16, 2), (24, 4)])          # Qwen3.5-35B-A3B, Qwen3.5-27B
def test_real_shapes_gpu(nh, nkv, device):
    d = 256
    q_lens = [300, 77, 1000] + [1] * 40
    ctx = [300, 2100, 1000] + [1 + 97 * i for i in range(40)]
    paged = Paged(ctx, nkv, d, dtype=torch.bfloat16, device=device, seed=nh)
    q = randn(sum(q_lens), nh, d, g=paged.g, dtype=torch.bfloat16, device=device)
    o_ref, o_tri = _run_both(q, paged, q_lens, d ** -0.5)
    assert_close(o_tri, o_ref, TOL[torch.bfloat16], "mixed batch")
    # decode only: the split-K launch shape
    dq, dctx = [1] * 8, [5000 * (i + 1) for i in range(8)]
    paged = Paged(dctx, nkv, d, dtype=torch.bfloat16, device=device, seed=1)
    q = randn(8, nh, d, g=paged.g, dtype=torch.bfloat16, device=device)
    o_ref, o_tri = _run_both(q, paged, dq, d ** -0.5)
    assert_close(o_tri, o_ref, TOL[torch.bfloat16], "decode")


def test_signatures_match_the_references():
    """The reference's parameters in order, plus only optional keyword-only extras (host-side hints)."""
    import inspect

    for name, extras in (("store_kv", set()), ("paged_attention", {"max_query_len", "config"}),
                         ("fused_paged_attention", {"config"})):
        want = [(p.name, p.kind) for p in inspect.signature(getattr(ref, name)).parameters.values()]
        params = inspect.signature(getattr(tri, name)).parameters.values()
        got = [(p.name, p.kind) for p in params if p.name not in extras]
        assert got == want, name
        assert all(p.kind == p.KEYWORD_ONLY and p.default is None for p in params if p.name in extras)


# ---- fused_paged_attention: prologue + attention, one launch for decode batches ---------------------

class Decode:
    """A decode batch (token n = sequence n) as the attention layer hands it over: q/k/v strided views of
    one projection output, norm weights, RoPE tables of each token's position, its cache slot (-1 for a
    padded row: context 0), a paged cache with shuffled tables."""

    def __init__(self, ctx, nh, nkv, d, rd, *, dtype=torch.float32, device="cpu", seed=0, bs=16):
        self.paged = p = Paged(ctx, nkv, d, bs=bs, dtype=dtype, device=device, seed=seed)
        g, T = p.g, len(ctx)
        qkv = randn(T, (2 * nh + 2 * nkv) * d, g=g, dtype=dtype, device=device)      # [q | gate | k | v]
        self.q = qkv[:, : nh * d].view(T, nh, d)
        self.k = qkv[:, 2 * nh * d: (2 * nh + nkv) * d].view(T, nkv, d)
        self.v = qkv[:, (2 * nh + nkv) * d:].view(T, nkv, d)
        self.qw = randn(d, g=g, dtype=dtype, device=device, scale=0.1)
        self.kw = randn(d, g=g, dtype=dtype, device=device, scale=0.1)
        pos = torch.tensor([max(c - 1, 0) for c in ctx]).float()
        emb = torch.cat([pos[:, None] * (1.0 / (1e7 ** (torch.arange(0, rd, 2).float() / rd)))] * 2, dim=-1)
        self.cos, self.sin = emb.cos().to(dtype).to(device), emb.sin().to(dtype).to(device)
        self.slots = torch.tensor([int(p.tables[n, (c - 1) // bs]) * bs + (c - 1) % bs if c > 0 else -1
                                   for n, c in enumerate(ctx)], dtype=torch.int64, device=device)
        self.kw_args = dict(cu_seqlens=cu_seqlens([1] * T, device), seq_lens=p.seq_lens, block_tables=p.tables,
                            scale=d ** -0.5)

    def run(self, impl, cache, **kw):
        return impl.fused_paged_attention(self.q, self.k, self.v, self.qw, self.kw, 1e-6, self.cos, self.sin, cache,
                                          self.slots, **self.kw_args, **kw)


def _check_fused(dec: Decode, config, tol, what):
    want_cache, got_cache = dec.paged.cache.clone(), dec.paged.cache.clone()
    want = dec.run(ref, want_cache)
    got = dec.run(tri, got_cache, max_query_len=1, config=config)
    assert_close(got, want, tol, f"{what}: output")
    assert_close(got_cache, want_cache, tol, f"{what}: cache")
    return got, got_cache


DC = tri.DecodeAttentionConfig


@pytest.mark.parametrize("nh,nkv,d,rd,dtype,config", [
    (4, 2, 64, 16, torch.float32, DC(block_n=16, max_splits=1, num_stages=1)),              # no split
    (4, 2, 64, 16, torch.float32, DC(block_n=16, max_splits=3, min_tiles=1, num_stages=1)),  # split, merge
    (8, 1, 64, 64, torch.float32, DC(block_n=16, max_splits=4, min_tiles=2, num_stages=1)),  # GQA 8, full rotary
    (6, 2, 32, 8, torch.bfloat16, DC(block_n=16, max_splits=5, min_tiles=1, num_stages=1)),  # GQA 3 (rows padded)
    (2, 2, 16, 4, torch.float32, DC(block_n=16, max_splits=2, min_tiles=1, num_stages=1)),   # MHA
    (4, 2, 64, 16, torch.float32, DC(block_n=16, max_splits=3, min_tiles=1, num_stages=1,    # merge launch
                                     last_split_merges=False)),
    (6, 2, 32, 8, torch.bfloat16, DC(block_n=16, max_splits=4, min_tiles=2, num_stages=1, last_split_merges=False)),
])
def test_fused_decode_matches_reference(nh, nkv, d, rd, dtype, config, device):
    """Random decode batches: contexts ending mid-block and on block ends, an empty padded row (slot -1,
    context 0: zeros), one key, contexts shorter and longer than the splits reach."""
    g = gen(nh * 100 + d + config.max_splits)
    for trial in range(2):
        ctx = [int(c) for c in torch.randint(1, 120, (5,), generator=g)] + [0, 1, 16, 64]
        ctx = [ctx[i] for i in torch.randperm(len(ctx), generator=g)]
        dec = Decode(ctx, nh, nkv, d, rd, dtype=dtype, device=device, seed=trial + nh)
        _check_fused(dec, config, TOL[dtype], f"{config} ctx={ctx}")


def test_fused_decode_reads_the_new_key(device):
    """The new token's key and value weigh heavily at short contexts: the program that owns the last tile
    must attend to what it just stored (the cache's previous contents at that slot would give another
    answer, checked to differ by far more than the tolerance). Owners other than split 0 included."""
    ctx = [1, 2, 3, 17, 33, 48]
    dec = Decode(ctx, 4, 2, 64, 16, device=device, seed=7)
    for config in (DC(block_n=16, max_splits=1, num_stages=1), DC(block_n=16, max_splits=3, min_tiles=1, num_stages=1),
                   DC(block_n=16, max_splits=3, min_tiles=1, num_stages=1, last_split_merges=False)):
        got, _ = _check_fused(dec, config, TOL[torch.float32], str(config))
        q_only = ref.attention_prologue(dec.q, dec.k, dec.v, dec.qw, dec.kw, 1e-6, dec.cos, dec.sin,
                                        dec.paged.cache.clone(), torch.full_like(dec.slots, -1))   # nothing stored
        stale = ref.paged_attention(q_only, dec.paged.cache, **dec.kw_args)
        assert (got - stale).abs().max() > 100 * TOL[torch.float32] * stale.abs().max()


def test_fused_decode_repeat_and_counters(device):
    """Two calls give the same output (the merge counters are back to zero after each launch), and the
    default configuration of this device agrees with the reference."""
    dec = Decode([40, 7, 100, 0], 4, 2, 64, 16, device=device, seed=9)
    cfg = DC(block_n=16, max_splits=4, min_tiles=1, num_stages=1)
    first, _ = _check_fused(dec, cfg, TOL[torch.float32], "first")
    again, _ = _check_fused(dec, cfg, TOL[torch.float32], "again")
    assert torch.equal(first, again)
    assert int(triton_decode.decode_counters(torch.device(device), 8).abs().sum()) == 0


def test_fused_decode_path_choice(device, monkeypatch):
    """Without a config, every decode batch runs the decode kernel (never the prologue op): below
    FUSED_DECODE_MIN_PAIRS (token, KV head) pairs with one tile per split and the merge kernel, from there on
    with the in-kernel merge; both equal the reference."""
    dec = Decode([40, 7, 100, 0, 1], 4, 2, 64, 16, device=device, seed=19)
    calls = []
    prologue = tri.attention_prologue
    monkeypatch.setattr(tri, "attention_prologue", lambda *a, **k: calls.append(1) or prologue(*a, **k))
    monkeypatch.setattr(attn_config, "FUSED_DECODE_MIN_PAIRS", 11)                       # 5 tokens x 2 KV heads = 10
    small = tri.default_decode_config(5, 2, 64, 4, torch.float32)
    assert not small.last_split_merges and small.min_tiles == 1 and small.prefetch_tiles == 0
    assert tri.default_decode_config(1, 2, 64, 4).prefetch_tiles == 1
    _check_fused(dec, None, TOL[torch.float32], "two launches (merge kernel)")
    monkeypatch.setattr(attn_config, "FUSED_DECODE_MIN_PAIRS", 10)
    assert tri.default_decode_config(5, 2, 64, 4, torch.float32).last_split_merges
    _check_fused(dec, None, TOL[torch.float32], "one launch, default config")
    assert calls == []


def test_fused_mixed_batch_runs_the_two_launch_path(device):
    """Prefill chunks mixed with decodes (max_query_len unknown or > 1): prologue then paged attention, equal
    to the reference composition; cu_seqlens decides, not T."""
    nh, nkv, d, rd = 4, 2, 64, 16
    q_lens, ctx = [15, 1, 2, 1], [20, 9, 40, 1]
    p = Paged(ctx, nkv, d, device=device, seed=13)
    g, T = p.g, sum(q_lens)
    q, k, v = (randn(T, h, d, g=g, device=device) for h in (nh, nkv, nkv))
    qw, kw = randn(d, g=g, device=device, scale=0.1), randn(d, g=g, device=device, scale=0.1)
    cos, sin = randn(T, rd, g=g, device=device), randn(T, rd, g=g, device=device)
    slots = p.slots(q_lens, ctx)
    args = dict(cu_seqlens=cu_seqlens(q_lens, device), seq_lens=p.seq_lens, block_tables=p.tables, scale=0.125)
    c_ref, c_tri = p.cache.clone(), p.cache.clone()
    want = ref.fused_paged_attention(q, k, v, qw, kw, 1e-6, cos, sin, c_ref, slots, **args)
    for mql in (None, 15):
        got = tri.fused_paged_attention(q, k, v, qw, kw, 1e-6, cos, sin, c_tri, slots, **args, max_query_len=mql)
        assert_close(got, want, TOL[torch.float32], f"max_query_len={mql}")
        assert_close(c_tri, c_ref, TOL[torch.float32], "cache")


def test_fused_bad_inputs(device):
    dec = Decode([5, 9], 4, 2, 64, 16, device=device)
    with pytest.raises(ValueError, match="config applies"):
        dec.run(tri, dec.paged.cache.clone(), config=DC())
    with pytest.raises(ValueError, match="max_query_len"):
        dec.run(tri, dec.paged.cache.clone(), max_query_len=0)
    with pytest.raises(ValueError, match="max_splits"):
        dec.run(tri, dec.paged.cache.clone(), max_query_len=1, config=DC(max_splits=0))
    with pytest.raises(ValueError, match="k and v"):
        tri.fused_paged_attention(dec.q, dec.k[:, :1], dec.v, dec.qw, dec.kw, 1e-6, dec.cos, dec.sin,
                                  dec.paged.cache, dec.slots, **dec.kw_args, max_query_len=1)
    # the reference checks the promise the one-launch path relies on
    with pytest.raises(ValueError, match="max_query_len=1 but a sequence has 2"):
        ref.fused_paged_attention(dec.q, dec.k, dec.v, dec.qw, dec.kw, 1e-6, dec.cos, dec.sin, dec.paged.cache,
                                  dec.slots, cu_seqlens=cu_seqlens([2, 0], device), seq_lens=dec.paged.seq_lens,
                                  block_tables=dec.paged.tables, scale=0.125, max_query_len=1)


@pytest.mark.gpu
@pytest.mark.parametrize("nh,nkv", [(16, 2), (24, 4)])          # Qwen3.5-35B-A3B, Qwen3.5-27B
def test_fused_decode_real_shapes_gpu(nh, nkv, device):
    """Default launch choices at batch 1, 8 and 64 (split-K with the merge by the last split, and without),
    contexts 1 .. 32768, bf16; then the batch-8 call captured in a CUDA graph replays to the eager result."""
    d, rd = 256, 64
    for ctx in ([1152], [32768], [1], [4095], [1 + 613 * i for i in range(8)], [1 + 37 * i for i in range(64)]):
        dec = Decode(ctx, nh, nkv, d, rd, dtype=torch.bfloat16, device=device, seed=len(ctx))
        _check_fused(dec, None, TOL[torch.bfloat16], f"ctx={ctx[:4]}.. x{len(ctx)}")
        # the L2 prefetch before the programmatic-launch wait (a hint: the same result); the merge launch
        cfg = tri.default_decode_config(len(ctx), nkv, d, torch.cuda.get_device_properties(device).multi_processor_count)
        _check_fused(dec, dataclasses.replace(cfg, prefetch_tiles=2), TOL[torch.bfloat16], f"prefetch ctx={ctx[:4]}..")
        _check_fused(dec, dataclasses.replace(cfg, min_tiles=1, prefetch_tiles=1, last_split_merges=False),
                     TOL[torch.bfloat16], f"merge launch ctx={ctx[:4]}..")
    dec = Decode([1 + 613 * i for i in range(8)], nh, nkv, d, rd, dtype=torch.bfloat16, device=device, seed=3)
    cache = dec.paged.cache.clone()
    eager = dec.run(tri, cache, max_query_len=1)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = dec.run(tri, cache, max_query_len=1)
    for _ in range(2):
        static.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static, eager)
