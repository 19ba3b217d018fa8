"""Model-level invariants on the packed-batch path: prefill + N one-token decodes == one forward, a prefill
split into chunks continuing from the saved state == one prefill, batched == one at a time, and a
snapshot / restore of a state slot reproduces the continuation."""

from __future__ import annotations

import pytest
import torch

from deltaserve.batch import CacheBuffers, ForwardBatch
from deltaserve.models.loader import load_model
from deltaserve.ops import select_kernels
from tests.conftest import TinySpec, random_ids

BLOCK = 16


@pytest.fixture(scope="module", params=["qwen3_next", "qwen3_5"])
def model(request, tiny_model):
    path = tiny_model(TinySpec(family=request.param, ratio=2, seed=21))
    return load_model(path, device="cpu", dtype=torch.float32, kernels=select_kernels("cpu"), show_progress=False)


def new_cache(model, slots=4, blocks=64) -> CacheBuffers:
    return CacheBuffers.allocate(model.config, num_slots=slots, num_blocks=blocks, block_size=BLOCK,
                                 device="cpu", dtype=torch.float32)


def batch_of(seqs: list[tuple[list[int], int, int, list[int]]]) -> ForwardBatch:
    """seqs: (new tokens, tokens already cached, state slot, block ids). Prefills must come first."""
    ids, pos, mapping, cu, tables = [], [], [], [0], []
    width = max(len(s[3]) for s in seqs)
    for toks, done, _, blocks in seqs:
        ids += toks
        pos += list(range(done, done + len(toks)))
        mapping += [blocks[p // BLOCK] * BLOCK + p % BLOCK for p in range(done, done + len(toks))]
        cu.append(cu[-1] + len(toks))
        tables.append(blocks + [0] * (width - len(blocks)))
    n_pre = sum(not (len(t) == 1 and d > 0) for t, d, _, _ in seqs)
    t = lambda x, dt: torch.tensor(x, dtype=dt)  # noqa: E731
    return ForwardBatch(
        input_ids=t(ids, torch.long), positions=t(pos, torch.long), cu_seqlens=t(cu, torch.int32),
        seq_lens=t([d + len(x) for x, d, _, _ in seqs], torch.int32), state_slots=t([s[2] for s in seqs], torch.int32),
        has_initial_state=t([d > 0 for _, d, _, _ in seqs], torch.bool), slot_mapping=t(mapping, torch.long),
        block_tables=t(tables, torch.int32), num_prefills=n_pre, num_prefill_tokens=cu[n_pre])


def logits(model, cache, seqs) -> torch.Tensor:
    with torch.inference_mode():
        return model.compute_logits(model(batch_of(seqs), cache))


def test_prefill_then_decode_equals_one_forward(model):
    ids = random_ids(100, seed=1)
    whole = logits(model, new_cache(model), [(ids, 0, 0, list(range(8)))])
    cache = new_cache(model)
    steps = [logits(model, cache, [(ids[:70], 0, 2, list(range(8)))])]
    for p in range(70, 100):
        steps.append(logits(model, cache, [([ids[p]], p, 2, list(range(8)))]))
    assert (torch.cat(steps) - whole).abs().max() < 1e-4


@pytest.mark.parametrize("cuts", [(1, 2, 3), (63, 64, 65), (17, 80, 81, 129)])
def test_chunked_prefill_equals_one_prefill(model, cuts):
    ids = random_ids(150, seed=2)
    whole_cache = new_cache(model)
    whole = logits(model, whole_cache, [(ids, 0, 1, list(range(10)))])
    cache = new_cache(model)
    bounds = [0, *cuts, len(ids)]
    parts = [logits(model, cache, [(ids[a:b], a, 1, list(range(10)))]) for a, b in zip(bounds, bounds[1:])]
    assert (torch.cat(parts) - whole).abs().max() < 1e-4
    assert torch.allclose(cache.ssm[:, 1], whole_cache.ssm[:, 1], atol=1e-5)
    assert torch.allclose(cache.conv[:, 1], whole_cache.conv[:, 1], atol=1e-5)


def test_mixed_batch_equals_one_at_a_time(model):
    """Two prefills (one continuing from state) and two decodes in one forward, slots out of order."""
    a, b, c, d = (random_ids(n, seed=s) for n, s in ((40, 3), (90, 4), (30, 5), (66, 6)))
    alone, cache_alone = {}, new_cache(model)
    for name, ids, slot, blocks in (("a", a, 3, [0, 1, 2]), ("b", b, 1, [3, 4, 5, 6, 7, 8]),
                                    ("c", c, 0, [9, 10]), ("d", d, 2, [11, 12, 13, 14, 15])):
        alone[name] = logits(model, cache_alone, [(ids, 0, slot, blocks)])
    cache = new_cache(model)
    # warm-up: prefixes of a and b, all of c and d but their last token (so they can decode)
    logits(model, cache, [(a[:25], 0, 3, [0, 1, 2]), (c[:-1], 0, 0, [9, 10]), (d[:-1], 0, 2, [11, 12, 13, 14, 15])])
    out = logits(model, cache, [
        (a[25:], 25, 3, [0, 1, 2]), (b, 0, 1, [3, 4, 5, 6, 7, 8]),
        ([c[-1]], len(c) - 1, 0, [9, 10]), ([d[-1]], len(d) - 1, 2, [11, 12, 13, 14, 15])])
    expect = torch.cat([alone["a"][25:], alone["b"], alone["c"][-1:], alone["d"][-1:]])
    assert (out - expect).abs().max() < 1e-4


def test_snapshot_restore_reproduces_continuation(model):
    ids = random_ids(80, seed=7)
    cache = new_cache(model)
    logits(model, cache, [(ids[:50], 0, 1, list(range(6)))])
    snap = cache.snapshot(1)
    first = logits(model, cache, [(ids[50:], 50, 1, list(range(6)))])
    logits(model, cache, [(random_ids(20, seed=8), 50, 1, list(range(6)))])  # diverge: clobbers slot 1
    cache.restore(1, snap)
    again = logits(model, cache, [(ids[50:], 50, 1, list(range(6)))])
    assert torch.equal(first, again)
    cache.copy_slot(1, 3)
    assert torch.equal(cache.ssm[:, 3], cache.ssm[:, 1]) and torch.equal(cache.conv[:, 3], cache.conv[:, 1])


def test_padded_decode_rows_touch_nothing(model):
    ids = random_ids(20, seed=9)
    cache = new_cache(model)
    logits(model, cache, [(ids, 0, 0, [0, 1])])
    before = (cache.ssm.clone(), cache.conv.clone())
    batch = batch_of([([ids[-1]], 20, 0, [0, 1]), ([5], 3, 1, [2])])
    batch.state_slots[1] = -1
    batch.slot_mapping[1] = -1
    with torch.inference_mode():
        model(batch, cache)
    assert torch.equal(cache.ssm[:, 1:], before[0][:, 1:]) and torch.equal(cache.conv[:, 1:], before[1][:, 1:])
