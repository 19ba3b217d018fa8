"""Serving invariants on a real (tiny, random) hybrid model: batched == alone, chunked == whole,
preempted == not, everything freed afterwards, abort frees at once, and batched output == transformers."""

from __future__ import annotations

import random

import pytest
import torch

from deltaserve import LLM, SamplingParams
from deltaserve.engine.llm_engine import LLMEngine
from tests.conftest import TinySpec, hf_greedy, hf_reference

SPEC = TinySpec(family="qwen3_next", ratio=2)
VOCAB = 160


def ragged(n: int, seed: int, lo: int = 1, hi: int = 40) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randint(lo, hi))] for _ in range(n)]
    return prompts, [rng.randint(1, 10) for _ in range(n)]


def as_inputs(prompts):
    return [{"prompt_token_ids": p} for p in prompts]


def tokens(outs):
    return [[c.token_ids for c in o.outputs] for o in outs]


def assert_all_free(llm: LLM):
    stats = llm.engine.get_stats()
    assert stats.kv_blocks_used == 0 and stats.state_slots_used == 0
    assert stats.num_running == stats.num_waiting == 0
    llm.engine.cache.check_integrity()
    assert llm.engine.runner.num_live_seqs == 0 or not llm.engine.has_unfinished_requests()


@pytest.fixture(scope="module")
def model_path(tiny_model):
    return tiny_model(SPEC)


@pytest.mark.parametrize("mode", ["greedy", "seeded"])
def test_32_ragged_requests_together_equal_each_alone(model_path, mode):
    llm = LLM(model_path, device="cpu", max_num_seqs=32)
    prompts, max_toks = ragged(32, seed=1)
    if mode == "greedy":
        params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_toks]
    else:
        params = [SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=100 + i, max_tokens=m, ignore_eos=True)
                  for i, m in enumerate(max_toks)]
    together = llm.generate(as_inputs(prompts), params, use_tqdm=False)
    alone = [llm.generate(as_inputs([p]), [sp], use_tqdm=False)[0] for p, sp in zip(prompts, params)]
    assert tokens(together) == tokens(alone)
    assert [len(o.outputs[0].token_ids) for o in together] == max_toks
    assert_all_free(llm)


def test_token_budget_16_equals_unchunked(model_path):
    prompts, max_toks = ragged(12, seed=2, lo=20, hi=70)
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, logprobs=2, prompt_logprobs=1)
              for m in max_toks]
    whole = LLM(model_path, device="cpu").generate(as_inputs(prompts), params, use_tqdm=False)
    chunked_llm = LLM(model_path, device="cpu", max_num_batched_tokens=16)
    chunked = chunked_llm.generate(as_inputs(prompts), params, use_tqdm=False)
    assert tokens(chunked) == tokens(whole)
    for a, b in zip(chunked, whole):
        assert len(a.prompt_logprobs) == len(b.prompt_logprobs) == len(a.prompt_token_ids)
        for pa, pb in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            assert pa.keys() == pb.keys()
            assert all(abs(pa[t].logprob - pb[t].logprob) < 1e-4 for t in pa)
        for pa, pb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert pa.keys() == pb.keys()
            assert all(abs(pa[t].logprob - pb[t].logprob) < 1e-4 for t in pa)
    assert max(s for s in [chunked_llm.engine.get_stats().num_steps_total]) > len(prompts)
    assert_all_free(chunked_llm)


@pytest.mark.parametrize("mode", ["greedy", "seeded"])
def test_preemption_in_a_tiny_kv_pool_keeps_outputs_identical(model_path, mode):
    prompts, _ = ragged(10, seed=3, lo=5, hi=30)
    if mode == "greedy":
        params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, prompt_logprobs=1) for _ in prompts]
    else:
        params = [SamplingParams(temperature=1.0, seed=i, max_tokens=12, ignore_eos=True) for i in range(10)]
    roomy = LLM(model_path, device="cpu").generate(as_inputs(prompts), params, use_tqdm=False)
    tight_llm = LLM(model_path, device="cpu", block_size=4, num_gpu_blocks=14, max_num_batched_tokens=24)
    tight = tight_llm.generate(as_inputs(prompts), params, use_tqdm=False)
    assert tight_llm.engine.get_stats().num_preempted_total > 0
    assert tokens(tight) == tokens(roomy)
    if mode == "greedy":   # prompt logprobs survive preemption (recomputed when it hit mid-prompt)
        for a, b in zip(tight, roomy):
            assert len(a.prompt_logprobs) == len(b.prompt_logprobs) == len(a.prompt_token_ids)
            assert all(abs(x[t].logprob - y[t].logprob) < 1e-4 for x, y in zip(a.prompt_logprobs[1:],
                                                                              b.prompt_logprobs[1:]) for t in x)
    assert_all_free(tight_llm)


def test_request_that_can_never_fit_is_refused(model_path):
    llm = LLM(model_path, device="cpu", block_size=4, num_gpu_blocks=8)    # 32 tokens in all
    assert llm.max_model_len == 32
    with pytest.raises(ValueError, match="context limit"):
        llm.generate({"prompt_token_ids": list(range(32))}, SamplingParams(max_tokens=1), use_tqdm=False)
    out = llm.generate({"prompt_token_ids": list(range(20))}, SamplingParams(max_tokens=None, ignore_eos=True),
                       use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 12 and out.outputs[0].finish_reason == "length"


def test_abort_mid_generation_frees_at_once(model_path):
    # no prefix caching: its prompt-end commit point would add a step before the first token
    engine = LLMEngine.from_args(model_path, device="cpu", max_num_seqs=8, enable_prefix_caching=False)
    for i in range(4):
        engine.add_request(f"r{i}", list(range(1, 10 + i)), SamplingParams(temperature=0, max_tokens=50))
    for _ in range(3):
        engine.step()
    assert engine.get_stats().state_slots_used == 4
    engine.abort_request(["r1", "r2"])
    stats = engine.get_stats()
    assert stats.state_slots_used == 2 and stats.num_running == 2
    outs = {o.request_id: o for o in engine.step()}
    assert outs["r1"].finished and outs["r1"].outputs[0].finish_reason == "abort"
    assert len(outs["r1"].outputs[0].token_ids) == 3 and not outs["r0"].finished
    engine.abort_request(["r0", "r3"])
    stats = engine.get_stats()
    assert stats.kv_blocks_used == 0 and stats.state_slots_used == 0
    assert {o.request_id for o in engine.step()} == {"r0", "r3"}
    assert not engine.has_unfinished_requests() and engine.runner.num_live_seqs == 0


def test_batched_chunked_preempted_generation_matches_transformers(model_path):
    hf = hf_reference(model_path)
    prompts, max_toks = ragged(6, seed=4, lo=1, hi=45)
    llm = LLM(model_path, device="cpu", block_size=4, num_gpu_blocks=24, max_num_batched_tokens=16)
    outs = llm.generate(as_inputs(prompts), [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True)
                                              for m in max_toks], use_tqdm=False)
    for p, m, out in zip(prompts, max_toks, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf, p, m)
    assert llm.engine.get_stats().num_preempted_total > 0


def test_n_completions_with_a_seed_are_reproducible(model_path):
    llm = LLM(model_path, device="cpu")
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=8, ignore_eos=True)
    a = llm.generate({"prompt_token_ids": [1, 2, 3]}, params, use_tqdm=False)[0]
    b = llm.generate([{"prompt_token_ids": [9]}, {"prompt_token_ids": [1, 2, 3]}], params, use_tqdm=False)[1]
    assert [c.index for c in a.outputs] == [0, 1, 2]
    assert tokens([a]) == tokens([b])
    assert len({tuple(c.token_ids) for c in a.outputs}) > 1


def test_stats_count_tokens_and_finish_reasons(model_path):
    llm = LLM(model_path, device="cpu")
    llm.generate(as_inputs([[1, 2, 3], [4, 5]]), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                 use_tqdm=False)
    stats = llm.engine.get_stats()
    assert stats.prompt_tokens_total == 5 and stats.generation_tokens_total == 8
    assert stats.num_finished_total == {"length": 2}
    assert stats.state_slots_total >= 1 and stats.kv_blocks_total >= 1


def test_cpu_cache_budget_sizes_the_pools_and_clamps_concurrency(model_path, caplog):
    import logging

    with caplog.at_level(logging.INFO):
        engine = LLMEngine.from_args(model_path, device="cpu", cpu_cache_bytes=64 << 10, max_num_seqs=64,
                                     max_model_len=256)
    slot_bytes = engine.runner.cache.slot_bytes()
    assert engine.max_num_seqs < 64 and engine.cache.slots.num_slots == engine.max_num_seqs
    used = engine.cache.slots.num_slots * slot_bytes + engine.runner.cache.kv.numel() * 4
    assert used <= 64 << 10
    assert "clamped" in caplog.text and "KV blocks" in caplog.text
    assert torch.equal(torch.tensor(engine.runner.cache.kv.shape[2]), torch.tensor(engine.cache.blocks.num_blocks))


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_warm_up_leaves_no_trace(model_path, async_scheduling):
    """warm_up() (on by default on CUDA) frees every slot and block, resets the counters, and the engine then
    gives the same greedy and seeded outputs (and the same unseeded draws) as one that never warmed up."""
    kw = dict(device="cpu", max_num_seqs=16, max_num_batched_tokens=64, async_scheduling=async_scheduling)
    warm = LLM(model_path, warm_up=True, **kw)
    cold = LLM(model_path, warm_up=False, **kw)
    stats = warm.engine.get_stats()
    assert stats.num_steps_total == stats.prompt_tokens_total == stats.generation_tokens_total == 0
    assert stats.num_finished_total == {} and stats.num_preempted_total == 0
    assert_all_free(warm)
    prompts, max_toks = ragged(6, seed=5)
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_toks]
    params += [SamplingParams(temperature=1.0, seed=9, max_tokens=5, ignore_eos=True),
               SamplingParams(temperature=1.0, max_tokens=5, ignore_eos=True)]
    prompts += [[3, 4, 5], [6, 7]]
    assert tokens(warm.generate(as_inputs(prompts), params, use_tqdm=False)) == \
        tokens(cold.generate(as_inputs(prompts), params, use_tqdm=False))
    assert warm.engine.get_stats().num_finished_total == {"length": len(prompts)}
    with pytest.raises(RuntimeError, match="before serving"):
        warm.engine.add_request("x", {"prompt_token_ids": [1, 2]}, SamplingParams(max_tokens=1))
        warm.engine.warm_up()
