"""FP8 KV cache end to end (kv_cache_dtype="fp8"): an e4m3 pool, per-layer multipliers from the checkpoint's
k_scale / v_scale or calibrated at start-up, the GDN state left fp32, and logprobs within a stated bound of the
activation-dtype cache."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from deltaserve import LLM, SamplingParams
from deltaserve.ops import select_kernels
from deltaserve.ops.quant.fp8 import FP8_DTYPE
from tests.conftest import TinySpec, random_ids

SPEC = TinySpec(family="qwen3_next", ratio=2)
PARAMS = SamplingParams(temperature=0, max_tokens=8, prompt_logprobs=0, ignore_eos=True)
# |Δ prompt logprob| of the FP8 cache against the fp32 one on the tiny random model (its logits are scaled x4
# by the fixture; measured median 0.01-0.02, max 0.22)
MEDIAN_BOUND, MAX_BOUND = 0.05, 0.5


def _logprobs(llm: LLM, ids: list[int]) -> torch.Tensor:
    out = llm.generate({"prompt_token_ids": ids}, PARAMS, use_tqdm=False)[0]
    return torch.tensor([out.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))])


def test_fp8_kv_cache_within_a_bound_of_the_dense_cache(tiny_model):
    path = tiny_model(SPEC)
    ids = random_ids(150, seed=5)
    dense = _logprobs(LLM(path, device="cpu", dtype="float32"), ids)
    llm = LLM(path, device="cpu", dtype="float32", kv_cache_dtype="fp8")
    cache = llm.engine.runner.cache
    assert cache.kv.dtype == FP8_DTYPE and cache.ssm.dtype == torch.float32
    attn = llm.model.layers[3].self_attn
    assert attn.kv_scale_source == "calibration" and torch.isfinite(attn.kv_scale).all() and (attn.kv_scale > 0).all()
    fp8 = _logprobs(llm, ids)
    diff = (fp8 - dense).abs()
    assert 0 < diff.median() < MEDIAN_BOUND and diff.max() < MAX_BOUND, (diff.median(), diff.max())
    # a byte an element instead of four: at equal cache bytes, about 4x the blocks (the GDN slots take the same)
    blocks = lambda m: m.engine.runner.cache.kv.shape[2]  # noqa: E731
    assert blocks(llm) >= 3 * blocks(LLM(path, device="cpu", dtype="float32"))


def test_checkpoint_kv_scales_are_used_not_recalibrated(tiny_model, tmp_path):
    src = tiny_model(SPEC)
    path = shutil.copytree(src, tmp_path / "m")
    file = path / "model.safetensors"
    with safe_open(str(file), framework="pt") as st:
        tensors = {n: st.get_tensor(n) for n in st.keys()}
    tensors["model.layers.3.self_attn.k_scale"] = torch.tensor(0.0123)
    tensors["model.layers.3.self_attn.v_scale"] = torch.tensor([0.0456])
    save_file(tensors, str(file), metadata={"format": "pt"})
    llm = LLM(path, device="cpu", dtype="float32", kv_cache_dtype="fp8")
    attn = llm.model.layers[3].self_attn
    assert attn.kv_scale_source == "checkpoint"
    torch.testing.assert_close(attn.kv_scale.flatten(), torch.tensor([0.0123, 0.0456]))
    assert torch.isfinite(_logprobs(llm, random_ids(40, seed=1))).all()
    # with the default cache the scales load and are unused
    assert torch.isfinite(_logprobs(LLM(path, device="cpu", dtype="float32"), random_ids(40, seed=1))).all()


def test_kv_cache_dtype_is_validated_and_fp8_refused_with_other_attention_kernels(tiny_model, monkeypatch):
    path = tiny_model(SPEC)
    with pytest.raises(ValueError, match="kv_cache_dtype 'int8'"):
        LLM(path, device="cpu", kv_cache_dtype="int8")
    from deltaserve.runner import worker

    def other_attention(device, **kw):
        k = select_kernels(device, **kw)
        return type(k)(**{**k.__dict__, "backend": {**k.backend, "paged_attention": "decode-graph"}})

    monkeypatch.setattr(worker, "select_kernels", other_attention)
    with pytest.raises(ValueError, match=r"kv_cache_dtype='fp8'.*attention kernels paged_attention \(decode-graph\)"):
        LLM(path, device="cpu", kv_cache_dtype="fp8")
