"""Paged attention and KV store (Triton) against the plain-torch references: ragged prefill chunks that
continue from cached context mixed with decodes, block tables out of order, GQA ratios 1/2/8, head_dim
64 and 256, split-K, padded slots and rows, and chunked == whole."""

from __future__ import annotations

import pytest
import torch

from deltaserve.ops.attention import reference as ref
from deltaserve.ops.attention import triton as tri

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

    for name, extras in (("store_kv", set()), ("paged_attention", {"max_query_len", "config"})):
        want = [(p.name, p.kind) for p in inspect.signature(getattr(ref, name)).parameters.values()]
        params = inspect.signature(getattr(tri, name)).parameters.values()
        got = [(p.name, p.kind) for p in params if p.name not in extras]
        assert got == want, name
        assert all(p.kind == p.KEYWORD_ONLY and p.default is None for p in params if p.name in extras)
