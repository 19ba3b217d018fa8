"""The user-facing side of speculative decoding: speculative_config from the LLM API and the CLI's JSON,
refusals by name (tensor parallelism, bad keys, mtp without a head), the MTP drafter's wiring, the engine's stats and
the Prometheus counters."""

from __future__ import annotations

import pytest

from deltaserve import LLM
from deltaserve.cli import build_parser
from deltaserve.config import ConfigError
from deltaserve.server.metrics import ServerMetrics
from deltaserve.spec.config import SpeculativeConfig
from tests.spec.helpers import generate, greedy, mixed_prompts


def test_mtp_builds_its_drafter_and_the_pools_mtp_kv_layer():
    from deltaserve.spec.mtp import MTPDrafter

    llm = LLM(device="cpu", speculative_config={"method": "mtp", "num_speculative_tokens": 3})
    eng = llm.engine
    assert isinstance(eng.runner.speculation.drafter, MTPDrafter)
    assert eng.runner.cache.kv.shape[0] == len(llm.config.attention_layer_ids) + 1
    assert eng.scheduler.config.draft_lookahead == 2
    plain = LLM(device="cpu", speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    assert plain.engine.runner.cache.kv.shape[0] == len(llm.config.attention_layer_ids)
    assert plain.engine.scheduler.config.draft_lookahead == 0


def test_mtp_on_a_checkpoint_without_a_head_is_refused():
    import dataclasses

    from deltaserve.config import ModelConfig
    from deltaserve.engine.llm_engine import DEFAULT_MODEL_PATH, check_speculation

    config = dataclasses.replace(ModelConfig.from_hf(DEFAULT_MODEL_PATH), mtp_num_layers=0)
    with pytest.raises(ConfigError, match="needs a checkpoint with an MTP head"):
        check_speculation(SpeculativeConfig("mtp", 3), config, 1)


def test_tensor_parallel_and_bad_keys_are_refused():
    with pytest.raises(ConfigError, match="tensor_parallel_size > 1"):
        LLM(device="cpu", tensor_parallel_size=2, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['draft_model'\]"):
        LLM(device="cpu", speculative_config={"method": "ngram", "num_speculative_tokens": 2, "draft_model": "x"})


def test_cli_reads_the_json():
    parser = build_parser()
    args = parser.parse_args(["generate", "--prompt", "hi", "--speculative-config",
                              '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}'])
    assert args.speculative_config == SpeculativeConfig("ngram", 4, 3, 3)
    args = parser.parse_args(["serve", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}'])
    from deltaserve.server.cli_args import engine_kwargs

    assert engine_kwargs(args)["speculative_config"] == SpeculativeConfig("ngram", 2)
    with pytest.raises(SystemExit):
        parser.parse_args(["generate", "--prompt", "hi", "--speculative-config", '{"method": "ngram"}'])


def test_prometheus_counters():
    llm = LLM(device="cpu", speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                                                "prompt_lookup_min": 1})
    generate(llm, mixed_prompts(2, seed=3), greedy(20))
    stats = llm.engine.get_stats()
    assert stats.spec_num_draft_tokens_total > 0
    text = ServerMetrics(llm.engine.get_stats).render().decode()
    assert f"deltaserve_spec_decode_num_drafts_total {float(stats.spec_num_drafts_total)}" in text
    assert f"deltaserve_spec_decode_num_draft_tokens_total {float(stats.spec_num_draft_tokens_total)}" in text
    assert f"deltaserve_spec_decode_num_accepted_tokens_total {float(stats.spec_num_accepted_tokens_total)}" in text
    for j in (0, 1):
        value = float(stats.spec_num_accepted_tokens_per_pos[j])
        assert f'deltaserve_spec_decode_num_accepted_tokens_per_pos_total{{position="{j}"}} {value}' in text


def test_constrained_requests_do_not_speculate_and_keep_their_output():
    from deltaserve import SamplingParams
    from deltaserve.sampling_params import StructuredOutputsParams

    kw = dict(temperature=0.0, max_tokens=12,
              structured_outputs=StructuredOutputsParams(regex=r"(one two three ){1,5}"))
    plain = LLM(device="cpu", enable_prefix_caching=False)
    spec = LLM(device="cpu", speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                 "prompt_lookup_min": 1})
    prompts = ["one two three one two three one two three", "Count: one two three"]
    free = SamplingParams(temperature=0.0, max_tokens=12)
    want = [o.outputs[0].text for o in plain.generate(prompts, [SamplingParams(**kw), free], use_tqdm=False)]
    got = [o.outputs[0].text for o in spec.generate(prompts, [SamplingParams(**kw), free], use_tqdm=False)]
    assert got == want
