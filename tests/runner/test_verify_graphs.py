"""Speculative verify graphs without a GPU: the bucket and width choice, when capture is refused, that padded
rows touch no state, and that the padded static-buffer path (on CPU each "graph" is an eager forward over the
static buffers) gives plain greedy's tokens and seeded sampling's, with n-gram drafts (rows of fewer drafts
than the width, plain decodes beside verify chunks) and oracle drafts with rejections, for K = 1..4.
On a GPU tests/spec/test_spec_gpu.py runs the captured graphs against plain decoding."""

from __future__ import annotations

import logging

import pytest
import torch

from deltaserve import LLM, SamplingParams
from deltaserve.ops import REFERENCE_OPS, Kernels
from deltaserve.runner.verify_graphs import VerifyGraphs, plan_verify_graphs, verify_capture_sizes
from tests.spec.helpers import generate, greedy, mixed_prompts, pin_k, spec_llm, tokens, use_oracle


def _capture(llm: LLM, sizes=(1, 2, 4, 8)) -> VerifyGraphs:
    runner = llm.engine.runner
    k = llm.engine.config.speculative_config.num_speculative_tokens
    runner.verify_graphs = VerifyGraphs(runner.model, runner.cache, list(sizes), k,
                                        max_blocks_per_seq=runner._block_table.shape[1], device=runner.device)
    runner.verify_graphs.capture()
    return runner.verify_graphs


@pytest.fixture(scope="module")
def plain():
    return LLM(device="cpu", enable_prefix_caching=False)


@pytest.fixture(scope="module")
def spec():
    llm = spec_llm(4, max_num_seqs=8)
    _capture(llm)
    return llm


def test_buckets_and_widths():
    assert verify_capture_sizes(64) == [1, 2, 4, 8, 16]
    assert verify_capture_sizes(5) == [1, 2, 4, 8]
    assert verify_capture_sizes(0) == []


def test_capture_is_refused_off_cuda_or_with_reference_ops(caplog):
    backend = {name: "triton" for name in REFERENCE_OPS}
    assert plan_verify_graphs(torch.device("cuda"), Kernels(backend=dict(backend), **REFERENCE_OPS), max_batch=64,
                              enforce_eager=False) == [1, 2, 4, 8, 16]
    backend["gdn_commit"] = "reference"          # the decode path is all Triton, the commit is not
    with caplog.at_level(logging.DEBUG):
        assert plan_verify_graphs(torch.device("cpu"), Kernels(backend=backend, **REFERENCE_OPS), max_batch=8,
                                  enforce_eager=False) == []
        assert plan_verify_graphs(torch.device("cuda"), Kernels(backend=backend, **REFERENCE_OPS), max_batch=8,
                                  enforce_eager=False) == []
    why = [r for r in caplog.records if "verify steps run without CUDA graphs" in r.message]
    assert len(why) == 2 and "cpu" in why[0].message and why[0].levelno == logging.DEBUG
    assert "gdn_commit" in why[1].message and why[1].levelno == logging.INFO   # graphs were possible there


def test_key_is_the_smallest_bucket_and_the_longest_chunk(spec):
    g = spec.engine.runner.verify_graphs
    assert g.widths == [2, 3, 4, 5]
    assert g.key_for(1, 2) == (1, 2) and g.key_for(3, 5) == (4, 5) and g.key_for(8, 1) == (8, 2)
    assert g.key_for(9, 2) is None and g.key_for(2, 6) is None


def test_capture_touches_no_state():
    llm = spec_llm(2, max_num_seqs=4)
    cache = llm.engine.runner.cache
    cache.ssm.normal_()
    cache.conv.normal_()
    cache.kv.normal_()
    before = (cache.ssm.clone(), cache.conv.clone(), cache.kv.clone())
    _capture(llm, sizes=(1, 2, 4))
    for got, want in zip((cache.ssm, cache.conv, cache.kv), before):
        assert torch.equal(got, want)


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_ngram_drafts_through_the_padded_path_match_plain(plain, spec, k):
    prompts = mixed_prompts(6, seed=40 + k)
    params = [greedy(m) for m in (5, 17, 9, 30, 1, 12)]
    want = tokens(generate(plain, prompts, params))
    g = spec.engine.runner.verify_graphs
    pin_k(spec, k)
    before = g.num_replays, spec.engine.get_stats().spec_num_accepted_tokens_total
    try:
        assert tokens(generate(spec, prompts, params)) == want
    finally:
        pin_k(spec, 4)
    assert g.num_replays > before[0], "no verify step replayed a verify graph"
    assert spec.engine.get_stats().spec_num_accepted_tokens_total > before[1]


def test_oracle_drafts_with_rejections_and_seeded_sampling_match_plain(plain, spec):
    from deltaserve.spec.drafter import make_drafter

    prompts = mixed_prompts(5, seed=7)
    params = [greedy(m) for m in (24, 7, 31, 16, 3)]
    ref = generate(plain, prompts, params)
    use_oracle(spec, prompts, ref, reject_prob=0.25, seed=3)
    g = spec.engine.runner.verify_graphs
    before = g.num_replays
    try:
        assert tokens(generate(spec, prompts, params)) == tokens(ref)
        seeded = SamplingParams(temperature=0.8, top_p=0.95, seed=7, max_tokens=20, ignore_eos=True)
        ref = generate(plain, prompts[:3], seeded)
        use_oracle(spec, prompts[:3], ref, reject_prob=0.25, seed=4)
        assert tokens(generate(spec, prompts[:3], seeded)) == tokens(ref)
    finally:
        spec.engine.runner.speculation.drafter = make_drafter(spec.engine.config.speculative_config, spec.model,
                                                              spec.engine.runner.cache, "cpu")
    assert g.num_replays > before
