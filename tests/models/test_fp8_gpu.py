"""GPU checks of the FP8 paths (skipped without CUDA): FP8 weights on CUDA run the FP8 Triton kernels chosen in
select_kernels (fp32 activations: weight-only, so the prompt logprobs must equal the reference ops' on the same
FP8 checkpoint; bf16: W8A8 at prefill, within a looser bound), and an FP8 KV cache must be refused with the
Triton attention kernels.

    DELTASERVE_LOG_LEVEL=INFO python -m pytest -q tests/models/test_fp8_gpu.py
"""

from __future__ import annotations

import pytest
import torch

from deltaserve import LLM
from tests.conftest import TinySpec, gpu, random_ids
from tests.models.fp8_checkpoints import write_fp8_checkpoint
from tests.models.test_fp8 import prompt_logprobs

pytestmark = gpu


@pytest.mark.parametrize("spec", [TinySpec(family="qwen3_5_moe", ratio=2, fused_experts=True, seed=5,
                                           gdn_head_dim=128, attn_head_dim=128),
                                  TinySpec(family="qwen3_next", ratio=2, seed=2, gdn_head_dim=128, attn_head_dim=128)])
def test_cuda_fp8_kernels_match_the_reference(tiny_model, tmp_path, spec):
    path = write_fp8_checkpoint(tiny_model(spec), tmp_path / "fp8")
    ids = random_ids(150, seed=3)
    ref = prompt_logprobs(LLM(path, device="cuda", dtype="float32", enforce_reference_ops=True), ids)
    llm = LLM(path, device="cuda", dtype="float32")
    assert llm.engine.runner.model.kernels.fp8_path.startswith("triton FP8 kernels")
    ours = prompt_logprobs(llm, ids)
    assert (ours - ref).abs().max() < 2e-3
    bf16 = prompt_logprobs(LLM(path, device="cuda", dtype="bfloat16"), ids)
    assert torch.isfinite(bf16).all() and (bf16 - ref).abs().median() < 0.05


def test_cuda_fp8_kv_cache_refused_with_triton_attention(tiny_model):
    path = tiny_model(TinySpec(family="qwen3_next", ratio=2, gdn_head_dim=128, attn_head_dim=128))
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8'"):
        LLM(path, device="cuda", kv_cache_dtype="fp8")
    llm = LLM(path, device="cuda", kv_cache_dtype="fp8", enforce_reference_ops=True)
    assert llm.engine.runner.cache.kv.dtype == torch.float8_e4m3fn
