"""Block-FP8 checkpoints in Qwen's published layout, online FP8 and the refusals (issue 28, wave2.md §3).

Parity: a tiny checkpoint of each family written in the FP8 layout (tests/models/fp8_checkpoints.py: tiny dims,
so every N and K is below 128 and the fused projections' pieces do not fill their blocks) loads into FP8 holders
and its fp32 prompt logprobs equal transformers' on the dequantised twin within 1e-4."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from deltaserve import DEFAULT_MODEL_PATH, LLM, SamplingParams
from deltaserve.config import ONLINE_FP8_NOT_CONVERT, ConfigError, ModelConfig
from deltaserve.models.loader import CheckpointError
from deltaserve.ops.quant.fp8 import FP8_DTYPE, is_fp8
from tests.conftest import TinySpec, hf_logprobs, hf_reference, random_ids
from tests.models.fp8_checkpoints import write_fp8_checkpoint
from tests.models.oracle import target_logprobs

SPECS = {
    "next-r3-sparse-step2-mtp": TinySpec(family="qwen3_next", ratio=3, decoder_sparse_step=2, mtp=True, seed=2),
    "qwen3_5-vlm-r3": TinySpec(family="qwen3_5", ratio=3, seed=3),
    "qwen3_5_moe-vlm-r2-fused-mtp": TinySpec(family="qwen3_5_moe", ratio=2, fused_experts=True, mtp=True, seed=5),
}
PARAMS = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
# Online FP8 vs the bf16-weight model it came from, on the tiny random models (weights N(0, 0.08), logits
# scaled x4 by the fixture: far peakier than a trained model's). Measured 0.05-0.11 median |Δ logprob|.
ONLINE_MEDIAN_BOUND = 0.25


def prompt_logprobs(llm: LLM, ids: list[int]) -> torch.Tensor:
    out = llm.generate({"prompt_token_ids": ids}, PARAMS, use_tqdm=False)[0]
    return torch.tensor([out.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))])


@pytest.fixture(scope="module")
def fp8_model(tiny_model, tmp_path_factory):
    made = {}

    def make(name: str, **kw):
        key = (name, tuple(sorted(kw.items())))  # kw: write_fp8_checkpoint's (dense=...)
        if key not in made:
            root = tmp_path_factory.mktemp(f"fp8-{name}")
            made[key] = (write_fp8_checkpoint(tiny_model(SPECS[name]), root / "fp8", twin=root / "twin", **kw),
                         root / "twin")
        return made[key]

    return make


@pytest.mark.parametrize("name", list(SPECS))
def test_fp8_checkpoint_matches_transformers_on_the_dequantised_weights(fp8_model, name):
    path, twin = fp8_model(name)
    ids = random_ids(70, seed=len(name))
    llm = LLM(path, device="cpu", dtype="float32")
    ours = prompt_logprobs(llm, ids)
    ref = target_logprobs(hf_logprobs(hf_reference(twin), ids), ids)
    err = (ours - ref).abs().max().item()
    assert err < 1e-4, f"{name}: FP8 prompt logprobs differ from transformers on the dequantised weights by {err}"
    model = llm.model
    layer = model.layers[-1]                       # full attention, MoE or dense
    assert is_fp8(layer.self_attn.qkv_proj.weight) and is_fp8(layer.self_attn.o_proj.weight)
    assert is_fp8(model.layers[0].linear_attn.out_proj.weight)
    # bf16 in the checkpoint (in_proj_ba / in_proj_a, b) beside FP8 qkvz: the fused in_proj is dense
    assert not model.layers[0].linear_attn.in_proj.is_fp8
    assert model.lm_head is None or not model.lm_head.is_fp8
    ffn = layer.mlp
    if hasattr(ffn, "experts_fp8"):
        assert ffn.experts_fp8 and ffn.w13.qweight.dtype == FP8_DTYPE and not ffn.gate.is_fp8
    else:
        assert ffn.gate_up_proj.is_fp8 and ffn.down_proj.is_fp8
    if model.mtp is not None:                      # the MTP head's FP8 layers loaded as FP8; its fc stays dense
        mtp_layer = model.mtp.layers[0]
        assert is_fp8(mtp_layer.self_attn.o_proj.weight) and not model.mtp.fc.is_fp8
        with safe_open(str(path / "model.safetensors"), framework="pt") as st:
            q = st.get_tensor("mtp.layers.0.self_attn.o_proj.weight")
        assert torch.equal(mtp_layer.self_attn.o_proj.weight.qweight.float(), q.float())


def test_fp8_fused_gdn_projection_with_its_interleave(fp8_model):
    """Qwen3-Next's in_proj_qkvz and in_proj_ba both FP8 (not the published list): the per-key-head interleave
    regroups FP8 rows with their scales into the FP8 in_proj (scale groups of a few rows)."""
    dense = tuple(n for n in ONLINE_FP8_NOT_CONVERT if n != "linear_attn.in_proj_ba")
    path, twin = fp8_model("next-r3-sparse-step2-mtp", dense=dense)
    ids = random_ids(70, seed=9)
    llm = LLM(path, device="cpu", dtype="float32")
    assert llm.model.layers[0].linear_attn.in_proj.is_fp8
    err = (prompt_logprobs(llm, ids) - target_logprobs(hf_logprobs(hf_reference(twin), ids), ids)).abs().max()
    assert err < 1e-4, err


def test_fp8_weights_take_a_byte_each(fp8_model):
    path, twin = fp8_model("qwen3_5_moe-vlm-r2-fused-mtp")
    fp8 = LLM(path, device="cpu", dtype="bfloat16").model
    dense = LLM(twin, device="cpu", dtype="bfloat16").model
    size = lambda m: sum(p.numel() * p.element_size() for p in m.parameters())  # noqa: E731
    assert size(fp8) < 0.75 * size(dense)


def test_online_fp8_is_the_checkpoint_format_within_a_bound_of_bf16(tiny_model):
    path = tiny_model(SPECS["qwen3_5_moe-vlm-r2-fused-mtp"])
    ids = random_ids(70, seed=4)
    bf16 = prompt_logprobs(LLM(path, device="cpu", dtype="float32"), ids)
    llm = LLM(path, device="cpu", dtype="float32", quantization="fp8")
    online = prompt_logprobs(llm, ids)
    assert is_fp8(llm.model.layers[-1].self_attn.o_proj.weight) and llm.model.layers[-1].mlp.experts_fp8
    assert llm.config.quantization.online
    diff = (online - bf16).abs()
    assert 0 < diff.median() < ONLINE_MEDIAN_BOUND, diff.median()
    assert torch.isfinite(online).all()


def test_online_fp8_heldout_perplexity_of_the_embedded_model():
    """Accuracy of the embedded model under online FP8 (issue 28's target: perplexity delta <= 1 %)."""
    from tests.test_default_model import EXPECTED, heldout_windows

    def ppl(llm: LLM) -> float:
        windows = heldout_windows(llm.tokenizer)
        outs = llm.generate([{"prompt_token_ids": w} for w in windows], PARAMS, use_tqdm=False)
        nll = -sum(pos[t].logprob for w, out in zip(windows, outs) for pos, t in zip(out.prompt_logprobs[1:], w[1:]))
        return math.exp(nll / EXPECTED["scored_tokens"])

    dense = ppl(LLM(device="cpu", dtype="float32"))
    online = LLM(device="cpu", dtype="float32", quantization="fp8")
    assert sum(p.dtype == FP8_DTYPE for p in online.model.parameters()) > 10
    fp8 = ppl(online)
    delta = fp8 / dense - 1
    print(f"held-out perplexity: fp32 weights {dense:.3f}, online FP8 {fp8:.3f} ({100 * delta:+.2f} %)")
    assert abs(delta) < 0.01, (dense, fp8)


# ---- refusals -----------------------------------------------------------------------------------
def _config(**quant) -> dict:
    raw = json.loads((DEFAULT_MODEL_PATH / "config.json").read_text())
    raw["quantization_config"] = quant
    return raw


FP8 = dict(quant_method="fp8", fmt="e4m3", activation_scheme="dynamic", weight_block_size=[128, 128])


@pytest.mark.parametrize("quant, words", [
    (dict(quant_method="awq", bits=4), ["quant_method", "awq"]),
    (dict(quant_method="gptq", bits=4), ["quant_method", "gptq"]),
    (dict(quant_method="compressed-tensors"), ["quant_method", "compressed-tensors"]),
    (dict(quant_method="bitsandbytes"), ["quant_method", "bitsandbytes"]),
    (dict(quant_method="mxfp4"), ["quant_method", "mxfp4"]),
    (dict(quant_method="modelopt"), ["quant_method", "modelopt"]),
    ({}, ["quant_method", "None"]),
    ({**FP8, "weight_block_size": None}, ["weight_block_size", "per-tensor"]),
    ({k: v for k, v in FP8.items() if k != "weight_block_size"}, ["weight_block_size", "per-channel"]),
    ({**FP8, "weight_block_size": [64, 64]}, ["weight_block_size", "64"]),
    ({**FP8, "activation_scheme": "static"}, ["activation_scheme", "static"]),
    ({**FP8, "fmt": "e5m2"}, ["fmt", "e5m2"]),
    ({**FP8, "kv_cache_scheme": {"num_bits": 8}}, ["kv_cache_scheme"]),
])
def test_unimplemented_quantization_is_refused_by_name(quant, words):
    with pytest.raises(ConfigError) as err:
        ModelConfig.from_dict(_config(**quant))
    for word in words:
        assert word in str(err.value), str(err.value)


def test_online_quantization_other_than_fp8_is_refused():
    with pytest.raises(ConfigError, match="quantization 'int8'"):
        ModelConfig.from_hf(DEFAULT_MODEL_PATH).with_quantization("int8")


def _rewrite(src, dst, edit):
    shutil.copytree(src, dst)
    file = dst / "model.safetensors"
    with safe_open(str(file), framework="pt") as st:
        tensors = {n: st.get_tensor(n) for n in st.keys()}
    edit(tensors)
    save_file(tensors, str(file), metadata={"format": "pt"})
    return dst


def test_loader_refuses_fp8_checkpoint_problems_by_tensor(fp8_model, tiny_model, tmp_path):
    path, _ = fp8_model("qwen3_5-vlm-r3")
    name = "model.language_model.layers.3.self_attn.o_proj"
    # a missing weight_scale_inv
    bad = _rewrite(path, tmp_path / "noscale", lambda t: t.pop(f"{name}.weight_scale_inv"))
    with pytest.raises(CheckpointError, match=f"{name}.weight is float8_e4m3fn but has no weight_scale_inv"):
        LLM(bad, device="cpu", dtype="float32")
    # a converted module stored bf16 (the config says it is FP8)
    def to_bf16(t):
        t[f"{name}.weight"] = t[f"{name}.weight"].float().to(torch.bfloat16)
        t.pop(f"{name}.weight_scale_inv")
    bad = _rewrite(path, tmp_path / "bf16", to_bf16)
    with pytest.raises(CheckpointError, match=f"{name}.weight is torch.bfloat16 without a weight_scale_inv"):
        LLM(bad, device="cpu", dtype="float32")
    # a scale of the wrong shape
    def wide_scale(t):
        t[f"{name}.weight_scale_inv"] = torch.ones(1, 2)
    bad = _rewrite(path, tmp_path / "shape", wide_scale)
    with pytest.raises(CheckpointError, match="weight_scale_inv has shape"):
        LLM(bad, device="cpu", dtype="float32")
    # FP8 scales in a checkpoint whose config has no quantization_config
    bad = tmp_path / "noconfig"
    shutil.copytree(path, bad)
    cfg = json.loads((bad / "config.json").read_text())
    del cfg["quantization_config"]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="no quantization_config"):
        LLM(bad, device="cpu", dtype="float32")


@pytest.mark.parametrize("extra", ["model.layers.3.self_attn.k_proj.k_scale", "model.layers.0.mlp.down_proj.qweight",
                                   "model.layers.0.mlp.down_proj.qzeros", "model.layers.0.mlp.down_proj.g_idx",
                                   "model.layers.1.linear_attn.out_proj.weight_scale"])
def test_unconsumed_quantization_tensors_are_an_error(tiny_model, tmp_path, extra):
    path = _rewrite(tiny_model(TinySpec(family="qwen3_next", ratio=2)), tmp_path / "m",
                    lambda t: t.__setitem__(extra, torch.ones(1)))
    with pytest.raises(CheckpointError, match=extra.replace(".", r"\.")):
        LLM(path, device="cpu", dtype="float32")
