"""The attention prologue (q/k zero-centred RMSNorm + partial RoPE + KV store, one Triton launch) against
the reference composition: strided q/k/v views of one projection output, partial and full rotary dims,
GQA, padded rows (slot -1) that store nothing, bad inputs."""

from __future__ import annotations

import pytest
import torch

from deltaserve.ops.attention import reference as ref
from deltaserve.ops.attention import triton as tri

from .helpers import assert_close, gen, randn

TOL = {torch.float32: 2e-6, torch.bfloat16: 1.6e-2}   # bf16: the reference rounds each rotation op


def _inputs(T, nh, nkv, d, rd, *, dtype, device, seed=0, blocks=4, bs=16):
    g = gen(seed)
    qkv = randn(T, (2 * nh + 2 * nkv) * d, g=g, dtype=dtype, device=device)    # [q | gate | k | v] rows
    q = qkv[:, : nh * d].view(T, nh, d)
    k = qkv[:, 2 * nh * d : (2 * nh + nkv) * d].view(T, nkv, d)
    v = qkv[:, (2 * nh + nkv) * d :].view(T, nkv, d)
    qw, kw = randn(d, g=g, dtype=dtype, device=device, scale=0.1), randn(d, g=g, dtype=dtype, device=device, scale=0.1)
    pos = torch.randint(0, 5000, (T,), generator=g).float()
    inv = 1.0 / (1e7 ** (torch.arange(0, rd, 2).float() / rd))
    emb = torch.cat([pos[:, None] * inv] * 2, dim=-1)
    cos, sin = emb.cos().to(dtype).to(device), emb.sin().to(dtype).to(device)
    cache = randn(2, blocks, bs, nkv, d, g=g, dtype=dtype, device=device)
    slots = torch.randperm(blocks * bs, generator=g)[:T].to(torch.int32)
    return q, k, v, qw, kw, cos, sin, cache, slots


@pytest.mark.parametrize("nh,nkv,d,rd", [(4, 2, 32, 8), (8, 1, 64, 64), (4, 4, 16, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prologue_matches_reference(nh, nkv, d, rd, dtype, device):
    q, k, v, qw, kw, cos, sin, cache, slots = _inputs(7, nh, nkv, d, rd, dtype=dtype, device=device, seed=d + rd)
    slots[3] = -1                                                   # a padded row: stores nothing
    slots = slots.to(device)
    want_cache, got_cache = cache.clone(), cache.clone()
    want = ref.attention_prologue(q, k, v, qw, kw, 1e-6, cos, sin, want_cache, slots)
    got = tri.attention_prologue(q, k, v, qw, kw, 1e-6, cos, sin, got_cache, slots)
    assert got.shape == (7, nh, d) and got.is_contiguous()
    live = torch.arange(7, device=device) != 3
    assert_close(got[live], want[live], TOL[dtype], "q")
    assert_close(got_cache, want_cache, TOL[dtype], "cache")
    assert torch.equal(got_cache[1].flatten(0, 1)[slots[live].long()], v[live]), "values are stored exactly"
    untouched = torch.ones(cache.shape[1] * cache.shape[2], dtype=torch.bool, device=device)
    untouched[slots[live].long()] = False
    assert torch.equal(got_cache.flatten(1, 2)[:, untouched], cache.flatten(1, 2)[:, untouched])


def test_prologue_bad_inputs(device):
    q, k, v, qw, kw, cos, sin, cache, slots = _inputs(3, 4, 2, 32, 8, dtype=torch.float32, device=device)
    slots = slots.to(device)
    with pytest.raises(ValueError, match="cos and sin"):
        tri.attention_prologue(q, k, v, qw, kw, 1e-6, cos[:, :7], sin[:, :7], cache, slots)
    with pytest.raises(ValueError, match="k and v"):
        tri.attention_prologue(q, k[:, :1], v, qw, kw, 1e-6, cos, sin, cache, slots)
    with pytest.raises(ValueError, match="norm weights"):
        tri.attention_prologue(q, k, v, qw[:8], kw, 1e-6, cos, sin, cache, slots)
    with pytest.raises(ValueError, match="slot_mapping"):
        tri.attention_prologue(q, k, v, qw, kw, 1e-6, cos, sin, cache, slots[:2])
