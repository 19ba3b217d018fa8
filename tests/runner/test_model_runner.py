"""The model runner: the packed batch it builds from a SchedulerOutput, and that packing sequences together
(prefill chunks with decodes, in any scheduling order) gives what running them separately gives."""

from __future__ import annotations

import pytest
import torch

from deltaserve.config import ModelConfig
from deltaserve.models.loader import load_model
from deltaserve.ops import select_kernels
from deltaserve.runner.memory import allocate_cache
from deltaserve.runner.model_runner import ModelRunner
from deltaserve.sampling_params import SamplingParams
from deltaserve.step_io import NewSequence, ScheduledChunk, SchedulerOutput
from tests.conftest import TinySpec, random_ids

BS = 4


@pytest.fixture(scope="module")
def model(tiny_model):
    path = tiny_model(TinySpec(family="qwen3_5", layout="text", ratio=2, seed=3))
    return load_model(path, device="cpu", dtype=torch.float32, kernels=select_kernels("cpu"), show_progress=False)


def make_runner(model, num_slots=4, num_blocks=32) -> ModelRunner:
    cache = allocate_cache(model, num_slots=num_slots, num_blocks=num_blocks, block_size=BS, device=torch.device("cpu"),
                           dtype=torch.float32)
    return ModelRunner(model, cache, device="cpu", max_model_len=128, seed=0)


def new(seq_id, tokens, slot, blocks, logprobs=5, prompt_logprobs=None):
    return NewSequence(seq_id, list(tokens), len(tokens), SamplingParams(temperature=0, logprobs=logprobs),
                       None, frozenset(), prompt_logprobs, slot, list(blocks))


def test_batch_layout_packs_prefills_first(model):
    runner = make_runner(model)
    a, b = random_ids(6, seed=1), random_ids(9, seed=2)
    runner.execute(SchedulerOutput([new(0, a, 2, [5, 1])], [ScheduledChunk(0, 0, 6, [])], []))
    # step 2: seq 0 decodes (scheduled first), seq 1 prefills its first 5 tokens in slot 0, blocks 7, 3
    out = SchedulerOutput([new(1, b, 0, [7, 3])], [ScheduledChunk(0, 6, 1, []), ScheduledChunk(1, 0, 5, [])], [])
    runner._apply_changes(out)
    batch = runner.build_batch(sorted(out.chunks, key=runner.is_decode))
    assert batch.num_prefills == 1 and batch.num_prefill_tokens == 5 and batch.num_decodes == 1
    assert batch.max_prefill_len == 5  # the chunked prefill's kernel choice reads it (host int)
    assert batch.input_ids.tolist() == b[:5] + [runner._seqs[0].token_ids[6]]
    assert batch.positions.tolist() == [0, 1, 2, 3, 4, 6]
    assert batch.cu_seqlens.tolist() == [0, 5, 6] and batch.seq_lens.tolist() == [5, 7]
    assert batch.state_slots.tolist() == [0, 2] and batch.has_initial_state.tolist() == [False, True]
    assert batch.slot_mapping.tolist() == [7 * BS + 0, 7 * BS + 1, 7 * BS + 2, 7 * BS + 3, 3 * BS + 0, 1 * BS + 2]
    assert batch.block_tables.tolist() == [[7, 3], [5, 1]]


def test_mixed_batch_equals_separate_runs(model):
    a, b, c = random_ids(11, seed=3), random_ids(7, seed=4), random_ids(13, seed=5)
    # together: a prefills, then a decodes while b prefills (two chunks) and c prefills in one go
    together = make_runner(model)
    first = together.execute(SchedulerOutput([new(0, a, 3, [0, 1, 2])], [ScheduledChunk(0, 0, 11, [])], []))
    step2 = together.execute(SchedulerOutput(
        [new(1, b, 1, [4, 5]), new(2, c, 0, [8, 9, 10, 11])],
        [ScheduledChunk(0, 11, 1, [3]), ScheduledChunk(1, 0, 4, []), ScheduledChunk(2, 0, 13, [])], []))
    step3 = together.execute(SchedulerOutput([], [ScheduledChunk(1, 4, 3, []), ScheduledChunk(0, 12, 1, [])], []))
    # separately, each sequence alone with its own runner, other slots and blocks
    alone_a = make_runner(model)
    ra = [alone_a.execute(SchedulerOutput([new(0, a, 0, [6, 2, 9, 1])], [ScheduledChunk(0, 0, 11, [])], [])),
          alone_a.execute(SchedulerOutput([], [ScheduledChunk(0, 11, 1, [])], [])),
          alone_a.execute(SchedulerOutput([], [ScheduledChunk(0, 12, 1, [])], []))]
    alone_b = make_runner(model)
    rb = alone_b.execute(SchedulerOutput([new(1, b, 2, [0, 1])], [ScheduledChunk(1, 0, 7, [])], []))
    alone_c = make_runner(model)
    rc = alone_c.execute(SchedulerOutput([new(2, c, 3, [0, 1, 2, 3])], [ScheduledChunk(2, 0, 13, [])], []))

    def result(out, seq_id):
        i = out.seq_ids.index(seq_id)
        return out.token_ids[i], out.logprobs[i]

    pairs = [(result(first, 0), result(ra[0], 0)), (result(step2, 0), result(ra[1], 0)),
             (result(step3, 0), result(ra[2], 0)), (result(step2, 2), result(rc, 2)), (result(step3, 1), result(rb, 1))]
    assert 1 not in step2.seq_ids                  # b's first chunk does not reach its end: no token
    for (tok_t, lp_t), (tok_a, lp_a) in pairs:
        assert tok_t == tok_a
        assert lp_t.keys() == lp_a.keys()
        assert all(abs(lp_t[k].logprob - lp_a[k].logprob) < 1e-5 for k in lp_t)


def test_prompt_logprobs_across_chunks_equal_one_chunk(model):
    p = random_ids(10, seed=6)
    one = make_runner(model).execute(SchedulerOutput([new(0, p, 0, [0, 1, 2], prompt_logprobs=2)],
                                                     [ScheduledChunk(0, 0, 10, [])], []))
    r = make_runner(model)
    parts = [r.execute(SchedulerOutput([new(0, p, 1, [4, 5, 6], prompt_logprobs=2)],
                                       [ScheduledChunk(0, 0, 4, [])], [])),
             r.execute(SchedulerOutput([], [ScheduledChunk(0, 4, 5, [])], [])),
             r.execute(SchedulerOutput([], [ScheduledChunk(0, 9, 1, [])], []))]
    chunked = [lp for part in parts for lp in part.prompt_logprobs.get(0, [])]
    whole = one.prompt_logprobs[0]
    assert len(whole) == len(chunked) == 9
    for x, y, target in zip(whole, chunked, p[1:]):
        assert target in x and x.keys() == y.keys()
        assert all(abs(x[k].logprob - y[k].logprob) < 1e-5 for k in x)
    assert parts[2].token_ids == one.token_ids


def test_freed_sequences_are_forgotten_and_slots_reusable(model):
    r = make_runner(model, num_slots=1)
    p = random_ids(5, seed=7)
    t1 = r.execute(SchedulerOutput([new(0, p, 0, [0, 1])], [ScheduledChunk(0, 0, 5, [])], [])).token_ids
    # seq 0 is freed and seq 1 (same prompt) reuses slot 0 and block 0 from a fresh state
    t2 = r.execute(SchedulerOutput([new(1, p, 0, [1, 0])], [ScheduledChunk(1, 0, 5, [])], [0])).token_ids
    assert t1 == t2 and r.num_live_seqs == 1


def test_state_and_block_copies_fork_a_sequence(model):
    """A sequence forked after its prompt (GDN slot copied, full KV blocks shared, the partial last block
    copied) continues exactly like the original: the seam prefix caching and n > 1 forks will use."""
    r = make_runner(model)
    p = random_ids(10, seed=8)                  # blocks of 4: [0, 1, 2], block 2 holds positions 8, 9
    first = r.execute(SchedulerOutput([new(0, p, 0, [0, 1, 2])], [ScheduledChunk(0, 0, 10, [])], []))
    snap = r.cache.snapshot(0)
    fork = new(1, p + first.token_ids, 3, [0, 1, 7])
    out = r.execute(SchedulerOutput([fork], [ScheduledChunk(0, 10, 1, []), ScheduledChunk(1, 10, 1, [])], [],
                                    state_copies=[(0, 3)], block_copies=[(2, 7)]))
    assert out.token_ids[0] == out.token_ids[1]
    assert all(abs(out.logprobs[0][k].logprob - out.logprobs[1][k].logprob) < 1e-6 for k in out.logprobs[0])
    # the snapshot taken after the prompt restores that state: the same next token again
    r.cache.restore(3, snap)
    again = r.execute(SchedulerOutput([new(2, p + first.token_ids, 3, [0, 1, 9])],
                                      [ScheduledChunk(2, 10, 1, [])], [1], block_copies=[(7, 9)]))
    assert again.token_ids == [out.token_ids[0]]


def test_profiling_batch_is_a_valid_prefill(model):
    from deltaserve.runner.memory import dummy_prefill_batch

    n = 37
    cache = allocate_cache(model, num_slots=1, num_blocks=-(-n // BS), block_size=BS, device=torch.device("cpu"),
                           dtype=torch.float32)
    hidden = model(dummy_prefill_batch(n, BS, torch.device("cpu")), cache)
    assert hidden.shape == (n, model.config.hidden_size) and torch.isfinite(hidden).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_cache_budget_is_positive_and_below_free_memory(tiny_model):
    from deltaserve.runner.memory import profile_gpu_cache_budget

    path = tiny_model(TinySpec(family="qwen3_5", layout="text", ratio=2, seed=3))
    dev = torch.device("cuda")
    # the kernels for the model's shapes, as the engine selects them (its head dims 16 take the reference prefill)
    kernels = select_kernels(dev, shapes=ModelConfig.from_hf(path).kernel_shapes)
    net = load_model(path, device=dev, dtype=torch.bfloat16, kernels=kernels, show_progress=False)
    budget = profile_gpu_cache_budget(net, device=dev, dtype=torch.bfloat16, max_num_batched_tokens=512,
                                      max_num_seqs=8, block_size=16, utilization=0.5)
    free, total = torch.cuda.mem_get_info(dev)
    assert 0 < budget <= total * 0.5


def test_packed_sections_start_16_byte_aligned(model):
    """Every per-token and per-sequence tensor of an eager batch, and the decodes' own state-slot tensor,
    start on a 16-byte boundary whatever the counts (Triton builds a kernel variant per pointer alignment,
    so unaligned sections that move from step to step would trigger builds mid-serving)."""
    runner = make_runner(model, num_slots=4)
    prompts = [random_ids(n, seed=n) for n in (3, 5, 6)]
    runner.execute(SchedulerOutput([new(i, p, i, [4 * i, 4 * i + 1]) for i, p in enumerate(prompts[:2])],
                                   [ScheduledChunk(0, 0, 3, []), ScheduledChunk(1, 0, 5, [])], []))
    runner._add(new(2, prompts[2], 3, [9, 10]))
    chunks = [ScheduledChunk(2, 0, 5, []), ScheduledChunk(0, 3, 1, []), ScheduledChunk(1, 5, 1, [])]
    batch = runner.build_batch(chunks)       # 1 prefill of 5 tokens + 2 decodes: odd counts everywhere
    assert batch.num_prefills == 1 and batch.num_tokens == 7
    for name in ("input_ids", "positions", "slot_mapping", "cu_seqlens", "seq_lens", "state_slots",
                 "has_initial_state", "decode_state_slots"):
        assert getattr(batch, name).data_ptr() % 16 == 0, name
    assert batch.decode_slots().tolist() == batch.state_slots[1:].tolist() == [0, 1]
    assert batch.positions.tolist() == [0, 1, 2, 3, 4, 3, 5] and batch.cu_seqlens.tolist() == [0, 5, 6, 7]
