"""Dummy weights at FP8 shapes (load_format="dummy" with a quantization_config) and the published FP8 configs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from deltaserve import LLM, SamplingParams
from deltaserve.config import ModelConfig
from deltaserve.models.loader import build_dummy_model
from deltaserve.ops import select_kernels
from deltaserve.ops.quant.fp8 import FP8_DTYPE, is_fp8
from tests.models.test_dummy_weights import tiny_config

CONFIGS = Path(__file__).resolve().parents[2] / "benchmarks" / "configs"
FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
              "modules_to_not_convert": ["lm_head", "mlp.gate", "mlp.shared_expert_gate", "linear_attn.in_proj_a",
                                         "linear_attn.in_proj_b", "linear_attn.conv1d"]}


@pytest.mark.parametrize("family", ["qwen3_5_moe", "qwen3_5", "qwen3_next"])
def test_dummy_fp8_weights_are_fp8_with_varying_scales_and_run(family):
    raw = {**tiny_config(family), "quantization_config": FP8_CONFIG}
    cfg = ModelConfig.from_dict(raw)
    model = build_dummy_model(cfg, device="cpu", dtype=torch.float32, kernels=select_kernels("cpu", fp8_weights=True))
    o_proj = model.layers[3].self_attn.o_proj.weight
    assert is_fp8(o_proj)
    scales = torch.cat([p.flatten() for n, p in model.named_parameters() if n.endswith("_scale_inv")])
    assert scales.unique().numel() == scales.numel() > 10
    w = o_proj.dequantize()
    assert 0.01 < w.std() < 0.03                      # the dense rule's N(0, 0.02)
    # the list keeps Qwen3.5's in_proj_a / in_proj_b dense, so its fused in_proj is dense; Qwen3-Next's
    # in_proj_ba is not listed: its whole in_proj is FP8 (scale groups of 4 rows: its heads' b / a rows)
    assert model.layers[0].linear_attn.in_proj.is_fp8 == (family == "qwen3_next")
    assert sum(p.dtype == FP8_DTYPE for p in model.parameters()) > 0
    llm = LLM(raw, load_format="dummy", device="cpu", dtype="float32")
    out = llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=2, prompt_logprobs=0,
                                                                       temperature=0), use_tqdm=False)[0]
    assert all(torch.isfinite(torch.tensor(lp[t].logprob)) for lp, t in zip(out.prompt_logprobs[1:], [2, 3]))


@pytest.mark.parametrize("name, billions, fp8_gib", [
    ("Qwen3-Next-80B-A3B-Instruct-FP8", 79.7, (74, 84)),
    ("Qwen3.5-35B-A3B-FP8", 35.5, (33, 39)),
])
def test_published_fp8_configs_build_at_fp8_sizes(name, billions, fp8_gib):
    cfg = ModelConfig.from_hf(CONFIGS / name)
    assert cfg.quantization is not None and cfg.quantization.weight_block_size == (128, 128)
    from deltaserve.models.qwen3_next import HybridForCausalLM

    model = HybridForCausalLM(cfg, select_kernels("cpu"), dtype=torch.bfloat16, device="meta",
                              mtp_layers=cfg.mtp_num_layers)
    fp8 = [p for n, p in model.named_parameters() if p.dtype == FP8_DTYPE]
    params = sum(p.numel() for n, p in model.named_parameters() if not n.endswith("_scale_inv")) / 1e9
    assert abs(params - billions) < 0.2
    gib = sum(p.numel() * p.element_size() for p in model.parameters()) / 2 ** 30
    assert fp8_gib[0] < gib < fp8_gib[1], gib
    assert sum(p.numel() for p in fp8) / 1e9 > 0.9 * billions       # experts and projections
    layer = model.layers[3]
    assert layer.mlp.experts_fp8 and not layer.mlp.gate.is_fp8 and is_fp8(layer.self_attn.o_proj.weight)
    assert not model.layers[0].linear_attn.in_proj.is_fp8 and model.layers[0].linear_attn.out_proj.is_fp8


def test_cli_generate_with_fp8_flags(tmp_path, capsys, caplog):
    import json

    from deltaserve.cli import main as cli_main

    (tmp_path / "config.json").write_text(json.dumps(tiny_config("qwen3_next")))
    rc = cli_main(["generate", "--model", str(tmp_path), "--load-format", "dummy", "--device", "cpu",
                   "--quantization", "fp8", "--kv-cache-dtype", "fp8", "--prompt-token-ids", "[5, 6, 7]",
                   "--max-tokens", "3", "--ignore-eos", "--json"])
    assert rc == 0
    assert len(json.loads(capsys.readouterr().out.strip())["token_ids"]) == 3
    with pytest.raises(SystemExit) as exit_:
        cli_main(["generate", "--model", str(tmp_path), "--load-format", "dummy", "--quantization", "awq",
                  "--prompt-token-ids", "[5]"])
    assert exit_.value.code == 2 and "--quantization" in capsys.readouterr().err
