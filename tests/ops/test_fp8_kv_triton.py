"""The Triton attention ops on an FP8 KV cache (ops.quant Fp8KvCache: e4m3 pool + per-tensor / per-KV-head
multipliers) against the references on the same cache: the store quantises bit for bit as the reference does,
attention over the stored values equals the reference's (mixed prefill + decode batches, split-K, the
one-launch decode with the new key quantised by its owner), and malformed FP8 caches are refused."""

from __future__ import annotations

import pytest
import torch

from deltaserve.ops.attention import reference as ref
from deltaserve.ops.attention import triton as tri
from deltaserve.ops.quant.fp8 import FP8_DTYPE, FP8_MAX, Fp8KvCache

from .helpers import assert_close, cu_seqlens, gen, randn
from .test_attention_triton import DC, MIXED, TOL, Decode, Paged


def _fp8(paged: Paged, per_head: bool, seed: int = 0) -> Fp8KvCache:
    """paged's contents quantised into an e4m3 pool with multipliers of 2x headroom over its amax."""
    cache = paged.cache.float()
    amax = cache.abs().amax(dim=(1, 2, 4)) if per_head else cache.abs().amax(dim=(1, 2, 3, 4))[:, None]
    scale = (amax * 2 / FP8_MAX).float().contiguous()
    fp8 = Fp8KvCache(torch.zeros(cache.shape, dtype=FP8_DTYPE, device=cache.device), scale)
    fp8.cache.copy_((cache / scale.view(2, 1, 1, -1, 1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE))
    return fp8


def _clone(fp8: Fp8KvCache) -> Fp8KvCache:
    return Fp8KvCache(fp8.cache.clone(), fp8.scale)


@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_quantises_as_the_reference(device, per_head, dtype):
    paged = Paged([20, 5], 2, 64, dtype=dtype, device=device, seed=3)
    fp8 = _fp8(paged, per_head)
    T = 7
    k = randn(T, 2, 64, g=paged.g, dtype=dtype, device=device, scale=3.0)
    v = randn(T, 2, 64, g=paged.g, dtype=dtype, device=device)
    slots = torch.tensor([0, 5, -1, 17, 18, 33, 2], dtype=torch.int64, device=device)
    want, got = _clone(fp8), _clone(fp8)
    ref.store_kv(k, v, want, slots)
    tri.store_kv(k, v, got, slots)
    assert torch.equal(got.cache.view(torch.uint8), want.cache.view(torch.uint8))


SPLIT = tri.AttentionConfig(block_m=16, block_n=16, num_splits=3, min_split=16)


@pytest.mark.parametrize("nh,nkv,d,dtype,per_head,config", [(4, 2, 64, torch.float32, False, None),
                                                            (4, 2, 64, torch.float32, True, SPLIT),
                                                            (4, 2, 64, torch.bfloat16, True, None),
                                                            (8, 1, 256, torch.bfloat16, False, SPLIT)])
def test_paged_attention_reads_the_fp8_cache_as_the_reference(device, nh, nkv, d, dtype, per_head, config):
    q_lens, ctx = MIXED["q_lens"], MIXED["ctx"]
    paged = Paged(ctx, nkv, d, dtype=dtype, device=device, seed=nh + d)
    fp8 = _fp8(paged, per_head)
    q = randn(sum(q_lens), nh, d, g=paged.g, dtype=dtype, device=device)
    args = {"cu_seqlens": cu_seqlens(q_lens, device), "seq_lens": paged.seq_lens, "block_tables": paged.tables,
            "scale": d ** -0.5}
    assert_close(tri.paged_attention(q, fp8, **args, config=config), ref.paged_attention(q, fp8, **args),
                 TOL[dtype], f"fp8 attention {config}")


def test_the_two_launch_path_on_an_fp8_cache(device):
    """A mixed batch through fused_paged_attention: attention_prologue stores the rotated keys quantised, then
    paged_attention reads them."""
    q_lens, ctx = [5, 1, 1], [21, 9, 40]
    dec = Decode(ctx, 4, 2, 64, 16, device=device, seed=4)
    T = sum(q_lens)
    q, k, v = (randn(T, h, 64, g=dec.paged.g, device=device) for h in (4, 2, 2))
    cos, sin = dec.cos[:1].expand(T, -1).contiguous(), dec.sin[:1].expand(T, -1).contiguous()
    slots = dec.paged.slots(q_lens, ctx)
    fp8 = _fp8(dec.paged, per_head=True)
    want, got = _clone(fp8), _clone(fp8)
    meta = {"cu_seqlens": cu_seqlens(q_lens, device), "seq_lens": dec.paged.seq_lens,
            "block_tables": dec.paged.tables, "scale": 0.125}
    o_ref = ref.fused_paged_attention(q, k, v, dec.qw, dec.kw, 1e-6, cos, sin, want, slots, **meta)
    o_tri = tri.fused_paged_attention(q, k, v, dec.qw, dec.kw, 1e-6, cos, sin, got, slots, **meta)
    assert_close(o_tri, o_ref, TOL[torch.float32], "two-launch fp8")
    # the stored keys: the prologue's rotation (fp32 here, one rounding apart) then the same quantisation
    diff = (got.cache.float() - want.cache.float()).abs()
    assert (diff <= want.cache.float().abs() * 2 ** -3 + 1e-6).all()


@pytest.mark.parametrize("config,dtype", [
    (DC(block_n=16, max_splits=1, num_stages=1), torch.float32),
    (DC(block_n=16, max_splits=3, min_tiles=1, num_stages=1), torch.bfloat16),
    (DC(block_n=16, max_splits=3, min_tiles=1, num_stages=1, last_split_merges=False), torch.float32)])
def test_fused_decode_on_an_fp8_cache(device, config, dtype):
    g = gen(11)
    ctx = [int(c) for c in torch.randint(1, 90, (4,), generator=g)] + [0, 1, 16]
    dec = Decode(ctx, 4, 2, 64, 16, dtype=dtype, device=device, seed=5)
    fp8 = _fp8(dec.paged, per_head=config.max_splits > 1)
    want, got = _clone(fp8), _clone(fp8)
    o_ref = dec.run(ref, want)
    o_tri = dec.run(tri, got, max_query_len=1, config=config)
    assert_close(o_tri, o_ref, TOL[dtype], f"fp8 decode {config}")
    # the new keys: normed and rotated in fp32, rounded once (the reference rounds each op: an ulp of the RoPE
    # terms apart, more where they cancel), then the same quantisation: equal codes but where that crosses a
    # rounding boundary (one e4m3 step, or an ulp of the terms near zero)
    g, w = got.cache.float(), want.cache.float()
    assert ((g - w).abs() <= w.abs() * 2 ** -3 + 2 ** -7 * w.abs().max()).all()
    assert (g != w).float().mean() < 0.01


def test_malformed_fp8_caches_are_refused(device):
    paged = Paged([8], 2, 64, device=device)
    fp8 = _fp8(paged, per_head=True)
    q = randn(1, 4, 64, g=paged.g, device=device)
    args = {"cu_seqlens": cu_seqlens([1], device), "seq_lens": paged.seq_lens, "block_tables": paged.tables,
            "scale": 0.1}
    with pytest.raises(ValueError, match=r"scale must be fp32 \[2, 1\] or \[2, 2\]"):
        tri.paged_attention(q, Fp8KvCache(fp8.cache, fp8.scale[:, :1].repeat(1, 3)), **args)
    with pytest.raises(ValueError, match="must be torch.float8_e4m3fn"):
        tri.paged_attention(q, Fp8KvCache(paged.cache, fp8.scale), **args)
    with pytest.raises(ValueError, match="comes as an Fp8KvCache"):
        tri.paged_attention(q, fp8.cache, **args)


@pytest.mark.gpu
@pytest.mark.parametrize("nh,nkv", [(16, 2), (32, 4)])
def test_fp8_kv_real_shapes_gpu(nh, nkv):
    ctx = [1, 300, 4097, 8000]
    dec = Decode(ctx, nh, nkv, 256, 64, dtype=torch.bfloat16, device="cuda", seed=1)
    fp8 = _fp8(dec.paged, per_head=False)
    want, got = _clone(fp8), _clone(fp8)
    assert_close(dec.run(tri, got, max_query_len=1), dec.run(ref, want), TOL[torch.bfloat16], "fp8 decode gpu")
    q_lens = [1, 300, 17, 1]
    q = randn(sum(q_lens), nh, 256, g=dec.paged.g, dtype=torch.bfloat16, device="cuda")
    args = {"cu_seqlens": cu_seqlens(q_lens, "cuda"), "seq_lens": dec.paged.seq_lens,
            "block_tables": dec.paged.tables, "scale": 256 ** -0.5}
    assert_close(tri.paged_attention(q, fp8, **args), ref.paged_attention(q, fp8, **args), TOL[torch.bfloat16],
                 "fp8 paged gpu")
