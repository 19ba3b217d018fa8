"""FP8 KV cache in the attention references: quantised on store, dequantised on read (ops/quant/fp8.py
Fp8KvCache), so attention over an FP8 cache equals attention over a dense cache holding the dequantised values."""

from __future__ import annotations

import pytest
import torch

from deltaserve.ops.attention import reference as attn
from deltaserve.ops.quant.fp8 import FP8_DTYPE, FP8_MAX, Fp8KvCache


def _setup(per_head: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    B, BS, NKV, D, NH = 6, 4, 2, 16, 4
    lens = [5, 9]
    T = sum(lens)
    k = torch.randn(T, NKV, D, generator=g) * torch.tensor([1.0, 3.0])[:, None]
    v = torch.randn(T, NKV, D, generator=g)
    q = torch.randn(T, NH, D, generator=g)
    slots = torch.cat([torch.arange(5), 12 + torch.arange(9)])          # seq 0: blocks 0-1, seq 1: blocks 3-5
    tables = torch.tensor([[0, 1, 0], [3, 4, 5]], dtype=torch.int32)
    amax = torch.stack([k.abs().amax(dim=(0, 2)), v.abs().amax(dim=(0, 2))]) if per_head else \
        torch.stack([k.abs().amax(), v.abs().amax()]).view(2, 1)
    scale = amax * 2 / FP8_MAX
    fp8 = Fp8KvCache(torch.zeros(2, B, BS, NKV, D, dtype=FP8_DTYPE), scale)
    meta = dict(cu_seqlens=torch.tensor([0, 5, 14], dtype=torch.int32), seq_lens=torch.tensor(lens, dtype=torch.int32),
                block_tables=tables, scale=D ** -0.5)
    return q, k, v, slots, fp8, meta


@pytest.mark.parametrize("per_head", [False, True])
def test_fp8_store_quantises_and_attention_reads_the_dequantised_values(per_head):
    q, k, v, slots, fp8, meta = _setup(per_head)
    attn.store_kv(k, v, fp8, slots)
    flat = fp8.cache.view(2, -1, *fp8.cache.shape[-2:])
    deq_k = flat[0, slots].float() * fp8.scale[0].view(1, -1, 1)
    # e4m3 rounding: relative error <= 2^-4, and nothing clipped (amax x 2 of headroom)
    assert ((deq_k - k).abs() <= k.abs() * 2 ** -4 + 1e-6).all()
    dense = torch.zeros(fp8.cache.shape)
    dense.view(2, -1, *dense.shape[-2:])[:, slots] = fp8.dequantize(flat[:, slots], torch.float32)
    ours = attn.paged_attention(q, fp8, **meta)
    ref = attn.paged_attention(q, dense, **meta)
    torch.testing.assert_close(ours, ref, rtol=0, atol=0)
    exact = attn.paged_attention(q, _dense_cache(k, v, slots, fp8.cache.shape), **meta)
    assert (ours - exact).abs().max() < 0.25     # e4m3 K and V (3 mantissa bits) vs exact, O(1) outputs


def _dense_cache(k, v, slots, shape):
    cache = torch.zeros(shape)
    flat = cache.view(2, -1, *shape[-2:])
    flat[0, slots], flat[1, slots] = k, v
    return cache


def test_fp8_store_saturates_beyond_the_calibrated_range():
    _, k, v, slots, fp8, _ = _setup(False)
    attn.store_kv(k * 100, v, fp8, slots)
    assert torch.isfinite(fp8.cache.float()).all() and fp8.cache.float().abs().max() == FP8_MAX
