"""GPU checks of the FP8 paths (skipped without CUDA): FP8 weights on CUDA run the FP8 Triton kernels chosen in
select_kernels (fp32 activations: weight-only, so the prompt logprobs must equal the reference ops' on the same
FP8 checkpoint; bf16: W8A8 at prefill, within a looser bound), and the Triton attention kernels on an FP8 KV
cache agree with the reference ops on it.

    DELTASERVE_LOG_LEVEL=INFO python -m pytest -q tests/models/test_fp8_gpu.py
"""

from __future__ import annotations

import pytest
import torch

from deltaserve import LLM, SamplingParams
from tests.conftest import TinySpec, gpu, random_ids
from tests.models.fp8_checkpoints import write_fp8_checkpoint
from tests.models.test_fp8 import prompt_logprobs

pytestmark = [pytest.mark.gpu, gpu]   # -m gpu selects these; skipped without CUDA

# Several engines live at once in these tests: each takes a fixed KV pool and a small share of the GPU (the share is
# the process's, as in vLLM, so a first engine at the default 0.9 would leave the next one nothing).
CUDA = {"device": "cuda", "num_gpu_blocks": 512, "gpu_memory_utilization": 0.2}


@pytest.mark.parametrize("spec", [TinySpec(family="qwen3_5_moe", ratio=2, fused_experts=True, seed=5,
                                           gdn_head_dim=128, attn_head_dim=128),
                                  TinySpec(family="qwen3_next", ratio=2, seed=2, gdn_head_dim=128, attn_head_dim=128)])
def test_cuda_fp8_kernels_match_the_reference(tiny_model, tmp_path, spec):
    path = write_fp8_checkpoint(tiny_model(spec), tmp_path / "fp8")
    ids = random_ids(150, seed=3)
    ref = prompt_logprobs(LLM(path, **CUDA, dtype="float32", enforce_reference_ops=True), ids)
    llm = LLM(path, **CUDA, dtype="float32")
    assert llm.engine.runner.model.kernels.fp8_path.startswith("triton FP8 kernels")
    ours = prompt_logprobs(llm, ids)
    assert (ours - ref).abs().max() < 2e-3
    bf16 = prompt_logprobs(LLM(path, **CUDA, dtype="bfloat16"), ids)
    assert torch.isfinite(bf16).all() and (bf16 - ref).abs().median() < 0.05


def test_cuda_fp8_kv_cache_with_triton_attention_matches_the_reference(tiny_model):
    """The Triton attention kernels read and write the FP8 pool as the reference ops do (same multipliers:
    calibrated at start-up with the same seed), so the fp32 prompt logprobs agree; greedy decoding runs."""
    path = tiny_model(TinySpec(family="qwen3_next", ratio=2, gdn_head_dim=128, attn_head_dim=128))
    ids = random_ids(150, seed=4)
    llm = LLM(path, **CUDA, dtype="float32", kv_cache_dtype="fp8", seed=0)
    assert llm.engine.runner.cache.kv.dtype == torch.float8_e4m3fn
    assert llm.engine.runner.model.kernels.backend["fused_paged_attention"] == "triton"
    ref = prompt_logprobs(LLM(path, **CUDA, dtype="float32", kv_cache_dtype="fp8", seed=0,
                              enforce_reference_ops=True), ids)
    assert (prompt_logprobs(llm, ids) - ref).abs().max() < 2e-3
    out = llm.generate({"prompt_token_ids": ids[:20]}, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 8
