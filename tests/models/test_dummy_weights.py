"""load_format="dummy": a model from its config alone with seeded random weights on the device; the
published-shape configs in benchmarks/configs parse; deep bf16 stacks stay finite; no tokenizer means
token-id prompts only, with a clear error otherwise."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from deltaserve import LLM, SamplingParams
from deltaserve.cli import main as cli_main
from deltaserve.config import ModelConfig
from deltaserve.models.dummy_weights import A_RANGE, DT_RANGE, init_dummy_weights
from deltaserve.models.loader import build_dummy_model
from deltaserve.ops import select_kernels
from deltaserve.tokenizer import NoTokenizerError

CONFIGS = Path(__file__).resolve().parents[2] / "benchmarks" / "configs"


def tiny_config(family: str = "qwen3_5_moe", layers: int = 4, **extra) -> dict:
    text = dict(vocab_size=128, hidden_size=64, num_hidden_layers=layers,
                layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)],
                linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=4096, **extra)
    if family == "qwen3_5":
        text.update(intermediate_size=96)
    else:
        text.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
    if family == "qwen3_next":
        return dict(model_type="qwen3_next", **text)
    return dict(model_type=family, text_config=text)


def _model(raw: dict, dtype=torch.float32, seed: int = 0):
    cfg = ModelConfig.from_dict(raw)
    return build_dummy_model(cfg, device="cpu", dtype=dtype, kernels=select_kernels(torch.device("cpu")), seed=seed)


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5", "qwen3_5_moe"])
def test_dummy_weights_follow_the_checkpoint_conventions(family):
    model = _model(tiny_config(family, mtp_num_hidden_layers=1))
    assert model.mtp is not None, "an MTP head when the config declares one (as published checkpoints have)"
    for name, p in model.named_parameters():
        assert torch.isfinite(p).all(), name
    layer = model.layers[0]
    assert torch.all(layer.input_layernorm.weight == 0), "zero-centred norms (x̂·(1+w)) start at 0"
    assert torch.all(model.layers[3].self_attn.q_norm.weight == 0)
    gdn = layer.linear_attn
    assert torch.all(gdn.norm_weight == 1), "the GDN gated norm is a plain x̂·w"
    A = gdn.A_log.exp()
    assert A.min() >= A_RANGE[0] - 1e-4 and A.max() <= A_RANGE[1] + 1e-3
    dt = F.softplus(gdn.dt_bias)
    assert dt.min() >= DT_RANGE[0] * 0.99 and dt.max() <= DT_RANGE[1] * 1.01
    std = layer.mlp.w13.std().item() if family != "qwen3_5" else layer.mlp.gate_up_proj.weight.std().item()
    assert 0.015 < std < 0.025


def test_dummy_weights_are_seeded():
    a, b, c = (_model(tiny_config(), seed=s) for s in (0, 0, 1))
    assert torch.equal(a.layers[0].mlp.w13, b.layers[0].mlp.w13)
    assert not torch.equal(a.layers[0].mlp.w13, c.layers[0].mlp.w13)


def test_a_parameter_without_a_rule_is_an_error():
    model = _model(tiny_config())
    model.layers[0].extra = torch.nn.Parameter(torch.empty(3), requires_grad=False)
    with pytest.raises(TypeError, match="layers.0.extra"):
        init_dummy_weights(model)


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_deep_bf16_stack_stays_finite_and_routes_across_experts(family):
    """64 layers in bf16 (the 27B depth): the residual stream grows slowly and the logits stay finite."""
    llm = LLM(tiny_config(family, layers=64), device="cpu", dtype="bfloat16", load_format="dummy",
              enforce_reference_ops=True)
    out = llm.generate([{"prompt_token_ids": list(range(1, 33))}],
                       SamplingParams(max_tokens=4, ignore_eos=True, logprobs=1), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4
    assert all(abs(lp[t].logprob) < 50 for lp, t in zip(out.outputs[0].logprobs, out.outputs[0].token_ids))
    if family == "qwen3_5_moe":
        moe = llm.model.layers[10].mlp
        x = F.rms_norm(torch.randn(256, 64), (64,)).to(torch.bfloat16)
        _, ids = moe.kernels.topk_softmax(moe.gate(x), moe.top_k, True, shared_slices=moe.shared_slices)
        ids = ids[:, : moe.top_k]
        counts = torch.bincount(ids.flatten(), minlength=moe.num_experts)
        assert counts.min() > 0.4 * counts.float().mean(), f"routing far from uniform: {counts.tolist()}"


def test_llm_from_config_dict_token_ids_only():
    llm = LLM(tiny_config(), device="cpu", load_format="dummy")
    out = llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=5, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 5
    assert llm.tokenizer is None
    with pytest.raises(NoTokenizerError, match="token ids"):
        llm.generate("some text", use_tqdm=False)


def test_bad_load_format_and_dict_without_dummy():
    with pytest.raises(ValueError, match="load_format 'pt'"):
        LLM(tiny_config(), device="cpu", load_format="pt")
    with pytest.raises(ValueError, match="load_format='dummy'"):
        LLM(tiny_config(), device="cpu")


def test_cli_generate_with_dummy_weights(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(tiny_config("qwen3_next")))
    rc = cli_main(["generate", "--model", str(tmp_path), "--load-format", "dummy", "--device", "cpu",
                   "--prompt-token-ids", "[5, 6, 7]", "--max-tokens", "3", "--ignore-eos", "--json"])
    assert rc == 0
    assert len(json.loads(capsys.readouterr().out.strip())["token_ids"]) == 3


@pytest.mark.parametrize("name,family,layers,hidden,experts", [
    ("Qwen3.5-35B-A3B", "qwen3_5_moe", 40, 2048, 256),
    ("Qwen3.5-27B", "qwen3_5", 64, 5120, 0),
    ("Qwen3-Next-80B-A3B-Instruct", "qwen3_next", 48, 2048, 512),
])
def test_published_shape_configs(name, family, layers, hidden, experts):
    cfg = ModelConfig.from_hf(CONFIGS / name)
    assert (cfg.family, cfg.num_hidden_layers, cfg.hidden_size, cfg.num_experts) == (family, layers, hidden, experts)
    assert cfg.layer_types.count("full_attention") * 4 == layers
    assert cfg.head_dim == 256 and cfg.rotary_dim == 64 and cfg.rope_theta == 1e7
    assert not cfg.tie_word_embeddings
    # the whole model builds (no memory: meta device) with the parameter count the name promises
    model = _meta_model(cfg)
    billions = sum(p.numel() for p in model.parameters()) / 1e9
    assert abs(billions - {40: 35.5, 64: 27.3, 48: 79.7}[layers]) < 0.2, billions


def _meta_model(cfg: ModelConfig):
    from deltaserve.models.qwen3_next import HybridForCausalLM

    return HybridForCausalLM(cfg, select_kernels(torch.device("cpu")), dtype=torch.bfloat16, device="meta",
                             mtp_layers=cfg.mtp_num_layers)
