"""embed_rope (Triton, one launch) against the plain-torch reference: the embedding rows and the RoPE
tables bit-equal, pending ids (-1) resolved from last_tokens by state slot, hidden sizes that end mid-block,
and the old torch formulation (RotaryEmbedding.cos_sin) reproduced exactly by the reference."""

from __future__ import annotations

import pytest
import torch

from deltaserve.layers.rotary import RotaryEmbedding
from deltaserve.ops.embedding import reference as ref
from deltaserve.ops.embedding import triton as tri

from .helpers import gen


def _case(V: int, H: int, rd: int, T: int, dtype, device, seed: int = 0):
    g = gen(seed)
    embed = torch.randn(V, H, generator=g).to(dtype=dtype, device=device)
    ids = torch.randint(0, V, (T,), generator=g).to(device)
    pos = torch.randint(0, 40000, (T,), generator=g).to(device)
    rope = RotaryEmbedding(rd, 10_000_000.0, device=device)
    return embed, ids, pos, rope


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("H,rd", [(64, 16), (200, 64), (1100, 32)])
def test_same_rows_and_tables_as_the_reference(H, rd, dtype, device):
    embed, ids, pos, rope = _case(50, H, rd, 7, dtype, device)
    want = ref.embed_rope(ids, embed, pos, rope.inv_freq)
    got = tri.embed_rope(ids, embed, pos, rope.inv_freq)
    assert torch.equal(got[0], want[0])
    for w, x in zip(want[1:], got[1:]):
        assert x.dtype == dtype and x.shape == w.shape
        if device.type == "cuda":      # libdevice: torch's own cosf / sinf
            assert torch.equal(x, w)
        else:                          # the interpreter's numpy cos / sin: within an ulp or two
            tol = 2e-6 if dtype == torch.float32 else 8e-3
            torch.testing.assert_close(x, w, rtol=0, atol=tol)


def test_reference_is_the_rotary_formula(device):
    embed, ids, pos, rope = _case(50, 64, 64, 9, torch.bfloat16, device)
    x, cos, sin = ref.embed_rope(ids, embed, pos, rope.inv_freq)
    want_cos, want_sin = rope.cos_sin(pos, torch.bfloat16)
    assert torch.equal(x, embed[ids]) and torch.equal(cos, want_cos) and torch.equal(sin, want_sin)


def test_pending_ids_read_last_tokens_by_slot(device):
    embed, ids, pos, rope = _case(50, 96, 32, 6, torch.bfloat16, device)
    last = torch.arange(100, 108, dtype=torch.long, device=device) % 50   # per state slot
    slots = torch.tensor([3, 0, 7, -1, 5, 2], dtype=torch.int32, device=device)
    ids = ids.clone()
    ids[0], ids[2], ids[5] = -1, -1, -1            # still being sampled: slots 3, 7, 2
    want_ids = ids.clone()
    want_ids[0], want_ids[2], want_ids[5] = last[3], last[7], last[2]
    for impl in (ref, tri):
        x, _, _ = impl.embed_rope(ids, embed, pos, rope.inv_freq, last_tokens=last, slots=slots)
        assert torch.equal(x, embed[want_ids]), impl.__name__
    with pytest.raises(ValueError, match="go together"):
        tri.embed_rope(ids, embed, pos, rope.inv_freq, last_tokens=last)
    with pytest.raises(ValueError, match="go together"):
        ref.embed_rope(ids, embed, pos, rope.inv_freq, slots=slots)


def test_empty_batch(device):
    embed, ids, pos, rope = _case(50, 64, 16, 0, torch.bfloat16, device)
    x, cos, sin = tri.embed_rope(ids, embed, pos, rope.inv_freq)
    assert x.shape == (0, 64) and cos.shape == sin.shape == (0, 16)


@pytest.mark.gpu
def test_real_shape_in_a_graph_gpu():
    """35B-A3B shape (V 248320, H 2048, rotary 64), 256 rows with pending ids: bit-equal to the reference,
    eager and replayed from a CUDA graph."""
    device = torch.device("cuda")
    embed, ids, pos, rope = _case(248320, 2048, 64, 256, torch.bfloat16, device)
    ids[::3] = -1
    last = torch.randint(0, 248320, (512,), device=device)
    slots = torch.randperm(512, device=device)[:256].to(torch.int32)
    want = ref.embed_rope(ids, embed, pos, rope.inv_freq, last_tokens=last, slots=slots)
    got = tri.embed_rope(ids, embed, pos, rope.inv_freq, last_tokens=last, slots=slots)
    for w, x in zip(want, got):
        assert torch.equal(x, w)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tri.embed_rope(ids, embed, pos, rope.inv_freq, last_tokens=last, slots=slots)
    pos.add_(17)
    last.add_(1).remainder_(248320)
    graph.replay()
    want = ref.embed_rope(ids, embed, pos, rope.inv_freq, last_tokens=last, slots=slots)
    for w, x in zip(want, out):
        assert torch.equal(x, w)
