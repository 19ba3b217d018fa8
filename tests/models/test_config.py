"""ModelConfig.from_hf: every published layout, the fields that change the forward pass, and refusals."""

from __future__ import annotations

import json

import pytest

from deltaserve.config import ConfigError, ModelConfig
from tests.conftest import TinySpec

NEXT = {
    "model_type": "qwen3_next", "vocab_size": 100, "hidden_size": 64, "num_hidden_layers": 8,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "linear_num_key_heads": 2,
    "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
    "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16, "shared_expert_intermediate_size": 16,
    "intermediate_size": 48, "rope_theta": 1e7, "partial_rotary_factor": 0.25, "eos_token_id": 7,
}


def test_qwen3_next_flat_fields():
    cfg = ModelConfig.from_dict({**NEXT, "decoder_sparse_step": 2, "mlp_only_layers": [3], "norm_topk_prob": False})
    assert cfg.family == "qwen3_next" and cfg.weight_prefix == "model."
    assert cfg.layer_types == ("linear_attention",) * 3 + ("full_attention",) + ("linear_attention",) * 3 + (
        "full_attention",)
    assert cfg.moe_layers == (False, True, False, False, False, True, False, True)
    assert cfg.rotary_dim == 8 and cfg.rope_theta == 1e7 and cfg.head_dim == 32
    assert not cfg.norm_topk_prob and cfg.eos_token_ids == (7,)
    assert cfg.gdn_conv_dim == 2 * 2 * 16 + 4 * 16


def test_full_attention_interval_and_explicit_layer_types():
    assert ModelConfig.from_dict({**NEXT, "full_attention_interval": 2}).attention_layer_ids == (1, 3, 5, 7)
    types = ["full_attention"] + ["linear_attention"] * 7
    assert ModelConfig.from_dict({**NEXT, "layer_types": types}).layer_types == tuple(types)


def test_nested_vlm_config_reads_text_config_and_top_level_tie(tiny_model):
    path = tiny_model(TinySpec(family="qwen3_5_moe", ratio=2, tie=True, seed=5))
    raw = json.loads((path / "config.json").read_text())
    assert raw["model_type"] == "qwen3_5_moe" and "text_config" in raw
    cfg = ModelConfig.from_hf(path)
    assert cfg.family == "qwen3_5_moe" and cfg.tie_word_embeddings and cfg.norm_topk_prob
    assert cfg.moe_layers == (True,) * 4 and cfg.weight_prefix == "model.language_model."


def test_text_only_variant(tiny_model):
    cfg = ModelConfig.from_hf(tiny_model(TinySpec(family="qwen3_5", layout="text", ratio=1, tie=True, seed=4)))
    assert cfg.model_type == "qwen3_5_text" and cfg.family == "qwen3_5" and cfg.moe_layers == (False,) * 4


def test_published_rope_parameters_with_mrope_are_accepted():
    rope = {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25, "mrope_section": [11, 11, 10],
            "mrope_interleaved": True}
    text = {k: v for k, v in NEXT.items() if k not in ("rope_theta", "partial_rotary_factor", "model_type")}
    cfg = ModelConfig.from_dict({"model_type": "qwen3_5", "text_config": {**text, "model_type": "qwen3_5_text",
                                                                         "rope_parameters": rope}})
    assert cfg.rotary_dim == 8 and cfg.rope_theta == 1e7


@pytest.mark.parametrize("change, field", [
    ({"model_type": "llama"}, "model_type"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type"),
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0}}, "rope_type"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"attention_bias": True}, "attention_bias"),
    ({"layer_types": ["linear_attention"] * 7}, "layer_types"),
    ({"layer_types": ["mamba"] * 8}, "layer_types"),
    ({"linear_num_value_heads": 3}, "linear_num_value_heads"),
    ({"use_sliding_window": True}, "use_sliding_window"),
    ({"partial_rotary_factor": 0.0}, "partial_rotary_factor"),
])
def test_unrunnable_configs_are_refused_naming_the_field(change, field):
    with pytest.raises(ConfigError, match=field):
        ModelConfig.from_dict({**NEXT, **change})


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="config.json"):
        ModelConfig.from_hf(tmp_path)
