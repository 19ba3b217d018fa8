"""Speculative decoding on a GPU (skipped without CUDA): the Triton verify / commit kernels in the engine,
verify steps replayed from their CUDA graphs (eager when a prefill rides in the step) beside graph-replayed
plain decode steps, async scheduling on. Greedy with oracle drafts
(some wrong) == plain greedy; a seeded sampled request is the same with and without drafts. Run:
  PYTHONPATH=. python -m pytest -q -m gpu tests/spec/test_spec_gpu.py
The MTP drafter likewise (greedy and seeded == plain)."""

from __future__ import annotations

import pytest
import torch

from deltaserve import LLM, SamplingParams
from tests.conftest import TinySpec
from tests.spec.helpers import generate, mixed_prompts, pin_k, tokens, use_oracle

# Two engines live in one process: each takes a fixed KV pool, so the first does not take the whole
# gpu_memory_utilization share (the process's, as in vLLM) and leave the second none.
TWO_ENGINES = {"num_gpu_blocks": 2048, "gpu_memory_utilization": 0.3}

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5", "qwen3_5_moe"])
@pytest.mark.parametrize("k", [1, 3, 4])
def test_greedy_and_seeded_with_drafts_match_plain_on_cuda(tiny_model, family, k):
    path = tiny_model(TinySpec(family=family, ratio=2, seed=41))
    kw = dict(device="cuda", dtype="float32", enable_prefix_caching=True, max_num_seqs=16, **TWO_ENGINES)
    plain = LLM(path, **kw)
    spec = LLM(path, speculative_config={"method": "ngram", "num_speculative_tokens": k}, **kw)
    assert spec.engine.runner.model.kernels.backend.get("gdn_verify") == "triton"
    vocab = spec.config.vocab_size
    prompts = mixed_prompts(9, seed=k, vocab=vocab)
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (20, 33, 7, 16, 25, 3, 40, 12, 9)]
    ref = generate(plain, prompts, params)
    pin_k(spec, k)
    use_oracle(spec, prompts, ref, reject_prob=0.25, seed=k)
    assert tokens(generate(spec, prompts, params)) == tokens(ref)
    assert spec.engine.runner.verify_graphs.num_replays > 0
    stats = spec.engine.get_stats()
    assert stats.spec_num_accepted_tokens_total > stats.spec_num_draft_tokens_total // 3
    seeded = SamplingParams(temperature=0.8, top_p=0.95, seed=7, max_tokens=24, ignore_eos=True)
    ref = generate(plain, prompts[:2], seeded)
    use_oracle(spec, prompts[:2], ref, reject_prob=0.25, seed=k)
    assert tokens(generate(spec, prompts[:2], seeded)) == tokens(ref)


@pytest.mark.parametrize("k", [1, 3])
def test_mtp_drafts_match_plain_on_cuda(tiny_model, tmp_path, k):
    """The MTP drafter on CUDA (Triton ops, decode and verify graphs, prefix caching, lookahead blocks): greedy
    and seeded output == plain."""
    path = with_mtp_declared(tiny_model(TinySpec(family="qwen3_next", ratio=3, decoder_sparse_step=2, mtp=True,
                                                 seed=2)), tmp_path)
    kw = {"device": "cuda", "dtype": "float32", "enable_prefix_caching": True, "max_num_seqs": 16, **TWO_ENGINES}
    plain = LLM(path, **kw)
    spec = LLM(path, speculative_config={"method": "mtp", "num_speculative_tokens": k}, **kw)
    pin_k(spec, k)
    vocab = spec.config.vocab_size
    prompts = mixed_prompts(6, seed=k, vocab=vocab)
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (20, 33, 7, 16, 25, 3)]
    assert tokens(generate(spec, prompts, params)) == tokens(generate(plain, prompts, params))
    assert spec.engine.get_stats().spec_num_draft_tokens_total > 0
    assert spec.engine.runner.verify_graphs.num_replays > 0
    seeded = SamplingParams(temperature=0.8, top_p=0.95, seed=7, max_tokens=24, ignore_eos=True)
    assert tokens(generate(spec, prompts[:2], seeded)) == tokens(generate(plain, prompts[:2], seeded))


def with_mtp_declared(path, tmp_path):
    """A copy of a tiny checkpoint whose config declares the mtp.* head its tensors hold (as released ones do)."""
    import json
    import shutil

    out = tmp_path / "mtp_model"
    shutil.copytree(path, out)
    config = json.loads((out / "config.json").read_text())
    config["num_nextn_predict_layers"] = 1
    (out / "config.json").write_text(json.dumps(config))
    return out
