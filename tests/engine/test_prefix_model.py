"""Prefix caching on a real (tiny, random, fp32) hybrid model on CPU: every hit must give the cache-off
result (greedy tokens equal, logprobs within 1e-5), which checks the device half: snapshot copies of the
recurrent state and conv window, the copy-on-write of a partly filled block, and the restored slot's
first chunk. The cache must be consistent afterwards."""

from __future__ import annotations

import pytest

from deltaserve import LLM, SamplingParams
from tests.conftest import TinySpec, random_ids

SPEC = TinySpec(family="qwen3_next", ratio=2)
TOL = 1e-5


@pytest.fixture(scope="module")
def model_path(tiny_model):
    return tiny_model(SPEC)


@pytest.fixture(scope="module")
def llms(model_path):
    kw = {"device": "cpu", "max_model_len": 2048, "max_num_batched_tokens": 512}
    return LLM(model_path, **kw), LLM(model_path, enable_prefix_caching=False, **kw)


def params(n=1, max_tokens=6, **kw):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=2, n=n, **kw)


def assert_same(hit, miss):
    assert len(hit.outputs) == len(miss.outputs)
    for a, b in zip(hit.outputs, miss.outputs):
        assert a.token_ids == b.token_ids
        for pa, pb in zip(a.logprobs, b.logprobs):
            assert pa.keys() == pb.keys()
            for t in pa:
                assert abs(pa[t].logprob - pb[t].logprob) < TOL


def run(llm, prompts, sp):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    llm.engine.cache.check_integrity()
    assert llm.engine.get_stats().kv_blocks_used == 0
    return outs


def test_resent_prompt_and_shared_prefix_with_long_suffixes(llms):
    cached, plain = llms
    cached.engine.reset_prefix_cache()
    prefix = random_ids(101, seed=1)
    prompts = [prefix + random_ids(n, seed=10 + n) for n in (40, 376, 1296, 40)]
    prompts.append(prompts[0])                                        # resent
    hits = []
    for p in prompts:
        a, b = run(cached, [p], params())[0], run(plain, [p], params())[0]
        assert_same(a, b)
        hits.append(a.num_cached_tokens)
    assert hits[0] == 0 and hits[2] >= 101 and hits[3] >= 101
    assert hits[4] == len(prompts[0]) - 1


def test_branch_inside_an_earlier_prompt_and_a_mixed_batch(llms):
    cached, plain = llms
    cached.engine.reset_prefix_cache()
    long = random_ids(300, seed=2)
    run(cached, [long], params())
    run(cached, [long[:170] + random_ids(20, seed=3)], params())      # saves the branch at 170
    batch = [long[:170] + random_ids(25, seed=4), random_ids(60, seed=5), long, random_ids(9, seed=6)]
    outs = run(cached, batch, params())
    for a, b in zip(outs, run(plain, batch, params())):
        assert_same(a, b)
    assert [o.num_cached_tokens for o in outs] == [170, 0, 299, 0]


def test_n4_seeded_children_resume_from_the_prompt(llms):
    cached, plain = llms
    cached.engine.reset_prefix_cache()
    prompt = random_ids(77, seed=7)
    sp = SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=6, ignore_eos=True, logprobs=1, n=4)
    before = cached.engine.get_stats().num_batched_tokens_total
    a, b = run(cached, [prompt], sp)[0], run(plain, [prompt], sp)[0]
    assert_same(a, b)
    assert cached.engine.get_stats().num_batched_tokens_total - before == 77 + 3 + 4 * 5


def test_second_turn_hits_the_first_turns_prompt_and_answer(llms):
    cached, plain = llms
    cached.engine.reset_prefix_cache()
    turn1 = random_ids(50, seed=8)
    out = run(cached, [turn1], params(max_tokens=10))[0]
    turn2 = turn1 + out.outputs[0].token_ids + random_ids(15, seed=9)
    a, b = run(cached, [turn2], params())[0], run(plain, [turn2], params())[0]
    assert_same(a, b)
    assert a.num_cached_tokens == 50 + 10 - 1


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_preemption_and_eviction_in_tiny_pools(model_path, async_scheduling):
    """14 KV blocks of 16 tokens and a handful of snapshots for 12 requests over 2 shared prefixes."""
    kw = {"device": "cpu", "block_size": 16, "num_gpu_blocks": 14, "max_num_batched_tokens": 64,
          "async_scheduling": async_scheduling}
    cached = LLM(model_path, cpu_cache_bytes=8 << 20, prefix_cache_state_fraction=0.03, **kw)
    plain = LLM(model_path, enable_prefix_caching=False, **kw)
    prefixes = [random_ids(40, seed=20), random_ids(30, seed=21)]
    prompts = [prefixes[i % 2][: 20 + i] + random_ids(5 + i, seed=30 + i) for i in range(12)]
    sp = params(max_tokens=30)
    a, b = run(cached, prompts, sp), run(plain, prompts, sp)
    for x, y in zip(a, b):
        assert_same(x, y)
    stats = cached.engine.get_stats()
    assert stats.num_preempted_total > 0 and stats.prefix_cache_hits_total > 0
    assert stats.prefix_cache_snapshot_evictions_total > 0


@pytest.mark.gpu
def test_hits_equal_misses_on_cuda_with_graphs_and_async_scheduling(model_path):
    """The device half on CUDA (fp32, so that hit == miss holds to 1e-5): snapshot copies between the live
    slots and the snapshot pool, the block copy, and restored slots feeding CUDA-graph decodes (when the
    model's kernels allow graphs) with async scheduling (the CUDA default)."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    kw = {"device": "cuda", "dtype": "float32", "max_model_len": 2048, "max_num_batched_tokens": 512}
    # gpu_memory_utilization is the process's share of the GPU (vLLM's meaning): the second engine's budget
    # counts the first one's memory as used, so it gets the first one's share on top of its own.
    cached = LLM(model_path, gpu_memory_utilization=0.3, **kw)
    plain = LLM(model_path, enable_prefix_caching=False, gpu_memory_utilization=0.6, **kw)
    assert cached.engine.async_scheduling
    prefix = random_ids(101, seed=1)
    prompts = [prefix + random_ids(n, seed=10 + n) for n in (40, 376, 1296, 40)] + [prefix + random_ids(40, seed=50)]
    for p in prompts:
        for sp in (params(), params(n=4, max_tokens=8)):
            a = cached.generate([{"prompt_token_ids": p}], sp, use_tqdm=False)[0]
            b = plain.generate([{"prompt_token_ids": p}], sp, use_tqdm=False)[0]
            for x, y in zip(a.outputs, b.outputs):
                assert x.token_ids == y.token_ids
                for px, py in zip(x.logprobs, y.logprobs):
                    for t in px:
                        assert abs(px[t].logprob - py[t].logprob) < TOL
    cached.engine.cache.check_integrity()
    assert cached.engine.get_stats().prefix_cache_hits_total > 3 * 101
