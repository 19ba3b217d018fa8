"""Tensor parallelism beside the other engine features: prefix caching (on by default; the scheduler's snapshot
and tail-block copies travel in the broadcast SchedulerOutput, so every rank copies its own heads), and the
refusal, by name, of an FP8 KV cache with tensor_parallel_size > 1 (not sharded yet; FP8 weights:
test_tp_fp8.py)."""

from __future__ import annotations

import pytest

from deltaserve import LLM, SamplingParams
from tests.conftest import TinySpec, random_ids

ENGINE = {"device": "cpu", "dtype": "float32", "max_model_len": 512, "max_num_batched_tokens": 64, "block_size": 16}
PARAMS = SamplingParams(temperature=0, max_tokens=6, logprobs=2, ignore_eos=True)


def _generate(llm: LLM, prompt: list[int]):
    return llm.generate({"prompt_token_ids": prompt}, PARAMS, use_tqdm=False)[0]


def test_tp2_prefix_hit_equals_a_miss(tiny_model):
    path = tiny_model(TinySpec(family="qwen3_next", ratio=2))
    prefix = random_ids(75, seed=1)
    first = prefix + random_ids(20, seed=2)
    # the second saves the branch point at 75, the third resumes there; the last resends the first
    prompts = [first, prefix + random_ids(30, seed=3), prefix + random_ids(9, seed=4), first]
    plain = LLM(path, enable_prefix_caching=False, **ENGINE)
    misses = [_generate(plain, p) for p in prompts]
    llm = LLM(path, tensor_parallel_size=2, **ENGINE)
    try:
        hits = [_generate(llm, p) for p in prompts]
    finally:
        llm.shutdown()
    cached = [h.num_cached_tokens for h in hits]
    assert cached[0] == 0 and cached[2] >= 75 and cached[3] == len(first) - 1, cached
    for hit, miss in zip(hits, misses):
        assert hit.outputs[0].token_ids == miss.outputs[0].token_ids
        for a, b in zip(hit.outputs[0].logprobs, miss.outputs[0].logprobs):
            assert a.keys() == b.keys()
            assert max(abs(a[t].logprob - b[t].logprob) for t in a) < 1e-4


def test_tp_with_an_fp8_kv_cache_is_refused_by_name(tiny_model):
    with pytest.raises(ValueError, match="tensor_parallel_size > 1 with kv_cache_dtype"):
        LLM(tiny_model(TinySpec(family="qwen3_5")), tensor_parallel_size=2, kv_cache_dtype="fp8", **ENGINE)
