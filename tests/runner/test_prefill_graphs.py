"""Piecewise prefill graphs (runner/prefill_graphs.py): the bucket ladder and when capture is refused (CPU),
the padded piecewise path against the plain eager forward (hidden states and every pool after the step) for
lone prompts, several prompts, mixed prefill + decode steps, chunked prefills and prefix-cache hits (CPU:
a "graph" is an eager call over the static buffers), engine tokens with the pieces on and off, and on a
GPU the same equality with real captured graphs."""

from __future__ import annotations

import gc
import logging

import pytest
import torch

from deltaserve import LLM, SamplingParams
from deltaserve.models.loader import load_model
from deltaserve.ops import REFERENCE_OPS, Kernels, select_kernels
from deltaserve.runner.memory import allocate_cache
from deltaserve.runner.model_runner import ModelRunner
from deltaserve.runner.prefill_graphs import (
    PIECE_OPS,
    PREFILL_LADDER,
    PrefillGraphs,
    bucket_for,
    eager_reason,
    prefill_capture_sizes,
)
from deltaserve.step_io import NewSequence, ScheduledChunk, SchedulerOutput
from tests.conftest import TinySpec, random_ids

BS = 4                              # KV block size of the runners here
SIZES = [8, 16, 64]                 # buckets of the CPU tests (steps of 1..64 tokens, most padded)


def gpu_test(fn):
    return pytest.mark.gpu(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")(fn))


# ---- buckets and refusal (no GPU) -------------------------------------------------------------------

def test_capture_sizes_climb_the_ladder_to_the_step_budget():
    assert prefill_capture_sizes(0) == []
    assert prefill_capture_sizes(8) == [8]
    assert prefill_capture_sizes(16) == [16]
    assert prefill_capture_sizes(48) == [16, 32, 48]
    assert prefill_capture_sizes(2048) == [16, 32, 64, 128, 256, 384, 512, 768, 1024, 1536, 2048]
    assert prefill_capture_sizes(5000) == [16, 32, 64, 128, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 5000]
    assert prefill_capture_sizes(100_000) == list(PREFILL_LADDER)
    assert [bucket_for(n, [16, 32, 48]) for n in (1, 16, 17, 48, 49)] == [16, 16, 32, 48, None]


def test_capture_is_refused_off_cuda_turned_off_or_with_reference_ops():
    ref = select_kernels("cpu")
    cuda = torch.device("cuda")
    assert "enforce_eager" in eager_reason(cuda, ref, enforce_eager=True)
    assert "prefill_cuda_graphs=False" in eager_reason(cuda, ref, enforce_eager=False, enabled=False)
    assert "cpu" in eager_reason(torch.device("cpu"), ref, enforce_eager=False)
    assert "fused_moe" in eager_reason(cuda, ref, enforce_eager=False)
    backend = {name: "triton" for name in REFERENCE_OPS}
    backend["chunk_gated_delta_rule"] = "reference"          # a core's op: it runs eagerly anyway
    assert eager_reason(cuda, Kernels(backend=backend, **REFERENCE_OPS), enforce_eager=False) is None
    backend["rms_norm_linear"] = "reference"
    why = eager_reason(cuda, Kernels(backend=backend, **REFERENCE_OPS), enforce_eager=False)
    assert why.count("rms_norm_linear") == 1 and set(PIECE_OPS) <= set(REFERENCE_OPS)


# ---- piecewise == eager on the model (CPU) ----------------------------------------------------------

@pytest.fixture(scope="module", params=["qwen3_next", "qwen3_5"])
def model(request, tiny_model):
    # qwen3_next: MoE with a shared expert; qwen3_5: dense MLPs. Both: 3 GDN layers and 1 attention layer.
    path = tiny_model(TinySpec(family=request.param, ratio=2, seed=7))
    return load_model(path, device="cpu", dtype=torch.float32, kernels=select_kernels("cpu"), show_progress=False)


def _runner(model) -> ModelRunner:
    cache = allocate_cache(model, num_slots=6, num_blocks=96, block_size=BS, device=torch.device("cpu"),
                           dtype=torch.float32)
    for pool in (cache.ssm, cache.conv, cache.kv):
        pool.zero_()
    return ModelRunner(model, cache, device="cpu", max_model_len=128)


def _new(seq_id: int, n: int, slot: int, first_block: int, seed: int) -> NewSequence:
    blocks = list(range(first_block, first_block + -(-max(n, 64) // BS)))    # at least 64 tokens' worth
    return NewSequence(seq_id, random_ids(n, seed=seed), n, SamplingParams(temperature=0), None, frozenset(), None,
                       slot, blocks)


def _compare(runner: ModelRunner, graphs: PrefillGraphs, chunks: list[ScheduledChunk], new=()) -> None:
    """The step's hidden states and every pool after it: eager forward == piecewise run (same start state)."""
    runner._apply_changes(SchedulerOutput(list(new), [], []))
    chunks = sorted(chunks, key=runner.is_decode)
    batch = runner.build_batch(chunks)
    cache = runner.cache
    start = [t.clone() for t in (cache.ssm, cache.conv, cache.kv)]
    want = runner.model(batch, cache)
    want_pools = [t.clone() for t in (cache.ssm, cache.conv, cache.kv)]
    for pool, saved in zip((cache.ssm, cache.conv, cache.kv), start):
        pool.copy_(saved)
    got = graphs.run(batch, cache).clone()
    assert got.shape == want.shape
    _close(got, want)
    for pool, saved in zip((cache.ssm, cache.conv, cache.kv), want_pools):
        _close(pool, saved)


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal to fp32 rounding: within 1e-5 of the tensor's largest magnitude (the GEMMs of a padded bucket
    and of the step's own row count may block their sums differently, by up to a few 1e-6 relative after three
    layers depending on the CPU's GEMM kernels; a padding row that leaked would differ by O(1))."""
    scale = max(want.abs().max().item(), 1e-30)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * scale)


def _graphs(model) -> PrefillGraphs:
    g = PrefillGraphs(model, SIZES, device=torch.device("cpu"))
    g.capture()
    return g


@pytest.mark.parametrize("n", [1, 7, 16, 37])
def test_lone_prompt_of_any_length(model, n):
    runner, graphs = _runner(model), _graphs(model)
    _compare(runner, graphs, [ScheduledChunk(0, 0, n, [])], [_new(0, n, 2, 0, seed=n)])


def test_several_prompts_in_one_step(model):
    runner, graphs = _runner(model), _graphs(model)
    news = [_new(i, n, i + 1, 16 * i, seed=i) for i, n in enumerate((5, 11, 1))]
    _compare(runner, graphs, [ScheduledChunk(i, 0, nw.num_prompt_tokens, []) for i, nw in enumerate(news)], news)


def test_mixed_prefill_and_decode_step_then_chunked_prefill(model):
    """Decodes of running sequences beside a new prompt and a prompt continuing from its saved state
    (a chunked prefill: conv window, recurrent state and KV of the first chunk)."""
    runner, graphs = _runner(model), _graphs(model)
    runs = [_new(0, 9, 0, 0, seed=1), _new(1, 4, 1, 16, seed=2), _new(2, 30, 2, 32, seed=3)]
    # eager steps that leave state behind: whole prompts 0 and 1, the first 12 tokens of prompt 2
    runner.execute(SchedulerOutput(runs, [ScheduledChunk(0, 0, 9, []), ScheduledChunk(1, 0, 4, []),
                                          ScheduledChunk(2, 0, 12, [])], []))
    new = _new(3, 6, 3, 48, seed=4)
    _compare(runner, graphs, [ScheduledChunk(0, 9, 1, []), ScheduledChunk(1, 4, 1, []), ScheduledChunk(2, 12, 18, []),
                              ScheduledChunk(3, 0, 6, [])], [new])


def test_prefix_cache_hit_starts_past_zero(model):
    """A prompt resuming at p > 0 from another sequence's KV blocks and a copy of its state snapshot."""
    runner, graphs = _runner(model), _graphs(model)
    first = _new(0, 12, 0, 0, seed=5)
    runner.execute(SchedulerOutput([first], [ScheduledChunk(0, 0, 12, [])], []))
    tokens = first.token_ids + random_ids(9, seed=6)
    hit = NewSequence(1, tokens, len(tokens), SamplingParams(temperature=0), None, frozenset(), None, 4,
                      first.block_ids[:3] + list(range(40, 53)))
    runner.cache.copy_slot(0, 4)                            # the snapshot at 12 tokens
    _compare(runner, graphs, [ScheduledChunk(1, 12, 9, [])], [hit])


def test_decode_batch_beyond_the_decode_graphs(model):
    """A decode-only step the piecewise path runs (no conv fold in its projection: the recurrence does it)."""
    runner, graphs = _runner(model), _graphs(model)
    news = [_new(i, 3 + i, i, 16 * i, seed=10 + i) for i in range(4)]
    runner.execute(SchedulerOutput(news, [ScheduledChunk(i, 0, 3 + i, []) for i in range(4)], []))
    _compare(runner, graphs, [ScheduledChunk(i, 3 + i, 1, []) for i in range(4)])


def test_padding_rows_hold_whatever_the_last_step_left(model):
    """A short step after a long one: the pad rows carry the earlier step's values, and the result is still
    the eager one (so no step depends on its padding being clean)."""
    runner, graphs = _runner(model), _graphs(model)
    _compare(runner, graphs, [ScheduledChunk(0, 0, 60, [])], [_new(0, 60, 0, 0, seed=20)])
    _compare(runner, graphs, [ScheduledChunk(1, 0, 50, [])], [_new(1, 50, 1, 16, seed=21)])
    _compare(runner, graphs, [ScheduledChunk(2, 0, 3, [])], [_new(2, 3, 2, 32, seed=22)])
    with pytest.raises(ValueError, match="outside the captured prefill buckets"):
        graphs.run(runner.build_batch([ScheduledChunk(0, 0, 60, [])] * 2), runner.cache)


# ---- the engine (CPU) --------------------------------------------------------------------------------

def _workload(n: int, seed: int):
    import random

    rng = random.Random(seed)
    prompts = [{"prompt_token_ids": random_ids(rng.randint(1, 70), vocab=128, seed=seed * 100 + i)} for i in range(n)]
    params = [SamplingParams(max_tokens=rng.randint(2, 10), ignore_eos=True, temperature=0) for _ in range(n)]
    return prompts, params


def test_engine_tokens_with_piecewise_graphs_equal_eager(tiny_model):
    """Greedy tokens of staggered requests (prompts longer than the step budget: chunked; arrivals beside
    decodes: mixed steps) with the piecewise path (and decode graphs beside it) on and off."""
    path = tiny_model(TinySpec(family="qwen3_next", ratio=2, seed=5))
    prompts, params = _workload(8, seed=3)
    results = []
    for graphs in (False, True):
        llm = LLM(path, device="cpu", max_num_seqs=6, max_num_batched_tokens=48)
        if graphs:
            llm.engine.runner.capture_decode_graphs(4)
            llm.engine.runner.capture_prefill_graphs(prefill_capture_sizes(48))
        outs = llm.generate(prompts, params, use_tqdm=False)
        results.append([o.outputs[0].token_ids for o in outs])
    runner = llm.engine.runner
    assert runner.prefill_graphs.num_runs > 0 and runner.graphs.num_replays > 0
    assert results[1] == results[0]


def test_cpu_engine_runs_prefills_eagerly_and_says_why(tiny_model, caplog):
    with caplog.at_level(logging.DEBUG):
        llm = LLM(tiny_model(TinySpec(family="qwen3_next", ratio=2, seed=5)), device="cpu")
    assert llm.engine.runner.prefill_graphs is None
    why = [r for r in caplog.records if "prefill steps run eagerly" in r.message]
    assert len(why) == 1 and "cpu" in why[0].message and why[0].levelno == logging.DEBUG


# ---- real graphs == eager on the GPU -----------------------------------------------------------------

@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5_moe"])
@gpu_test
def test_captured_pieces_give_the_eager_hidden_states_and_tokens(tiny_model, family):
    """Captured pieces (fp32) against the eager forward, step by step as in the CPU tests, then engine
    tokens with prefill graphs on and off."""
    from deltaserve.config import ModelConfig

    path = tiny_model(TinySpec(family=family, ratio=2, seed=41))
    config = ModelConfig.from_hf(path)
    kernels = select_kernels("cuda", shapes=config.kernel_shapes)        # as the worker selects them
    assert eager_reason(torch.device("cuda"), kernels, enforce_eager=False) is None
    model = load_model(path, device="cuda", dtype=torch.float32, kernels=kernels, show_progress=False)
    cache = allocate_cache(model, num_slots=6, num_blocks=96, block_size=BS, device=torch.device("cuda"),
                           dtype=torch.float32)
    runner = ModelRunner(model, cache, device="cuda", max_model_len=128)
    graphs = PrefillGraphs(model, SIZES, device=torch.device("cuda"))
    graphs.capture()
    assert graphs.num_graphs == len(SIZES) * (len(model.layers) + 1)
    runs = [_new(0, 9, 0, 0, seed=1), _new(1, 37, 1, 16, seed=2)]
    _compare(runner, graphs, [ScheduledChunk(0, 0, 9, []), ScheduledChunk(1, 0, 20, [])], runs)
    _compare(runner, graphs, [ScheduledChunk(0, 9, 1, []), ScheduledChunk(1, 20, 17, []), ScheduledChunk(2, 0, 5, [])],
             [_new(2, 5, 2, 32, seed=3)])
    del runner, graphs, model, cache
    gc.collect()
    torch.cuda.empty_cache()
    prompts, params = _workload(10, seed=4)
    results = []
    for on in (False, True):
        llm = LLM(path, device="cuda", dtype="float32", max_num_seqs=8, max_num_batched_tokens=64, num_gpu_blocks=256,
                  prefill_cuda_graphs=on)
        assert (llm.engine.runner.prefill_graphs is not None) == on
        results.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
        if on:
            assert llm.engine.runner.prefill_graphs.num_runs > 0
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    assert results[1] == results[0]


def test_step_chunk_offsets_are_built_once_per_step(model):
    """Every GDN layer of a step reads the same chunk offsets, built on first use (ops/chunks.py); a copy of the
    batch with other sequence bounds builds its own."""
    import dataclasses

    from deltaserve.ops.chunks import PREFILL_CHUNK, chunk_offsets

    runner = _runner(model)
    news = [_new(i, n, i, 32 * i, seed=30 + i) for i, n in enumerate((70, 3))]
    runner._apply_changes(SchedulerOutput(news, [], []))
    batch = runner.build_batch([ScheduledChunk(0, 0, 70, []), ScheduledChunk(1, 0, 3, [])])
    first = batch.prefill_chunk_offsets()
    assert first.tolist() == [0, 2, 3] and batch.prefill_chunk_offsets() is first
    assert torch.equal(first, chunk_offsets(batch.cu_seqlens, PREFILL_CHUNK))
    other = dataclasses.replace(batch, cu_seqlens=torch.tensor([0, 3, 73], dtype=torch.int32))
    assert other.prefill_chunk_offsets().tolist() == [0, 1, 3]


def test_budget_estimate_covers_the_static_buffers(model):
    """The cache budget sets static_buffer_bytes aside before the graphs exist: at least what they allocate."""
    from deltaserve.runner.prefill_graphs import static_buffer_bytes

    g = PrefillGraphs(model, SIZES, device=torch.device("cpu"))
    assert g.buffer_bytes <= static_buffer_bytes(model, max(SIZES)) <= 1.5 * g.buffer_bytes


def test_the_knob_reaches_the_engine_from_the_command_line():
    from deltaserve.cli import build_parser
    from deltaserve.server.cli_args import engine_kwargs

    parser = build_parser()
    assert engine_kwargs(parser.parse_args(["serve", "m"]))["prefill_cuda_graphs"] is True
    assert engine_kwargs(parser.parse_args(["serve", "m", "--no-prefill-cuda-graphs"]))["prefill_cuda_graphs"] is False


def test_start_up_prompts_leave_the_pools_as_allocated(model):
    """The lone prompts that build each bucket's kernels at start-up write slot 0 and the first blocks, then
    zero them again."""
    runner = _runner(model)
    graphs = _graphs(model)
    graphs.warm_up_cores(runner.cache, BS)
    for pool in (runner.cache.ssm, runner.cache.conv, runner.cache.kv):
        assert not pool.any()
    assert graphs.num_runs == len(SIZES)


def test_speculative_verify_steps_through_the_pieces_equal_eager(tiny_model):
    """Verify chunks (oracle drafts with rejections, K = 3 every step) in steps that run as piecewise graphs:
    the GDN cores verify and commit as the eager forward does, so the greedy tokens are plain greedy's."""
    from tests.spec.helpers import pin_k, use_oracle

    path = tiny_model(TinySpec(family="qwen3_next", ratio=2, seed=5))
    prompts, _ = _workload(6, seed=4)
    params = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0)
    plain = LLM(path, device="cpu", max_num_seqs=6, max_num_batched_tokens=48)
    ref = plain.generate(prompts, params, use_tqdm=False)
    want = [o.outputs[0].token_ids for o in ref]
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    for graphs in (False, True):
        llm = LLM(path, device="cpu", max_num_seqs=6, max_num_batched_tokens=48, speculative_config=spec)
        pin_k(llm, 3)
        use_oracle(llm, [p["prompt_token_ids"] for p in prompts], ref, reject_prob=0.3)
        if graphs:
            llm.engine.runner.capture_prefill_graphs(prefill_capture_sizes(48))
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == want, f"piecewise graphs {graphs}"
        assert llm.engine.get_stats().spec_num_accepted_tokens_total > 0
    assert llm.engine.runner.prefill_graphs.num_runs > 0
