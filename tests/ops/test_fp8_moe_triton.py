"""The FP8 fused MoE (ops/moe/triton_fp8.py) against the reference MoE on the same block-FP8 experts (which
dequantises them, fp32 math): the GEMV path (decode batches) and the grouped path, with the shared expert's
slots, small scale groups, fp32 and bf16; dense experts untouched; refusals. Real shapes on the GPU."""

from __future__ import annotations

import pytest
import torch

from deltaserve.ops.moe import reference as ref
from deltaserve.ops.moe import triton_fp8
from deltaserve.ops.moe.config import GEMV_MAX_ASSIGNMENTS
from deltaserve.ops.quant.fp8 import BlockFp8Weight, quantize_blocks

from .helpers import assert_close, gen


def _experts(E, N, K, device, groups=(128, 128), seed=0):
    w = torch.randn(E, N, K, generator=gen(seed)) * torch.logspace(-2, -1, N)[:, None]
    q, s = quantize_blocks(w, groups)
    return BlockFp8Weight(q.to(device), s.to(device), *groups)


def _moe(device, T, E, inter, H, groups, dtype, seed=0, extra=0):
    w13 = _experts(E + extra, 2 * inter, H, device, groups, seed)
    w2 = _experts(E + extra, H, inter, device, groups, seed + 1)
    x = torch.randn(T, H, generator=gen(seed + 2)).to(device, dtype)
    logits = torch.randn(T, E + (1 if extra else 0), generator=gen(seed + 3)).to(device, dtype)
    return x, w13, w2, logits


@pytest.mark.parametrize("T", [1, 3, 40])          # 40 x 3 slots: past the GEMV path (grouped GEMMs)
@pytest.mark.parametrize("groups", [(128, 128), (16, 32)])
def test_fp8_moe_matches_the_reference_fp32(device, T, groups):
    x, w13, w2, logits = _moe(device, T, 6, 64, 160, groups, torch.float32, seed=T)
    assert (T * 3 <= GEMV_MAX_ASSIGNMENTS) == (T < 40)
    got = triton_fp8.fused_moe_routed(x, w13, w2, logits, 3, True)
    torch.testing.assert_close(got, ref.fused_moe_routed(x, w13, w2, logits, 3, True), rtol=1e-5, atol=1e-6)


def test_fp8_moe_gemv_path_steps_over_long_rows(device):
    """The GEMV path's K steps: I = 300 in groups of 32 (10 groups: two w2 steps, the last partial), H = 200."""
    x, w13, w2, logits = _moe(device, 3, 4, 300, 200, (4, 32), torch.float32, seed=11)
    got = triton_fp8.fused_moe_routed(x, w13, w2, logits, 2, True)
    torch.testing.assert_close(got, ref.fused_moe_routed(x, w13, w2, logits, 2, True), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("T", [2, 40])
def test_fp8_moe_with_shared_slots_bf16(device, T):
    x, w13, w2, logits = _moe(device, T, 5, 48, 128, (16, 64), torch.bfloat16, seed=7, extra=1)
    got = triton_fp8.fused_moe_routed(x, w13, w2, logits, 2, False, shared_slices=1)
    want = ref.fused_moe_routed(x, w13, w2, logits, 2, False, shared_slices=1)
    assert got.dtype == torch.bfloat16
    # bf16: the grouped path rounds the intermediate to bf16 (the w2 dot's operand), the GEMV path keeps fp32
    assert_close(got, want, 2e-2 if T > 2 else 1e-2, f"fp8 moe T={T}")


def test_fp8_fused_moe_with_given_routing(device):
    x, w13, w2, _ = _moe(device, 4, 4, 32, 64, (32, 32), torch.float32, seed=3)
    ids = torch.tensor([[0, 3], [3, 3], [1, 2], [2, 0]], device=device)
    weights = torch.rand(4, 2, generator=gen(9)).to(device)
    torch.testing.assert_close(triton_fp8.fused_moe(x, w13, w2, weights, ids), ref.fused_moe(x, w13, w2, weights, ids),
                               rtol=1e-5, atol=1e-6)


def test_dense_experts_reach_the_dense_kernels(device):
    from deltaserve.ops.moe import triton as dense

    x, w13, w2, logits = _moe(device, 2, 4, 32, 64, (32, 32), torch.float32)
    d13, d2 = w13.dequantize(), w2.dequantize()
    torch.testing.assert_close(triton_fp8.fused_moe_routed(x, d13, d2, logits, 2, True),
                               dense.fused_moe_routed(x, d13, d2, logits, 2, True), rtol=0, atol=0)


def test_fp8_moe_refuses_what_it_cannot_take(device):
    x, w13, w2, logits = _moe(device, 2, 4, 32, 64, (32, 32), torch.float32)
    with pytest.raises(ValueError, match="both be block-FP8 or both dense"):
        triton_fp8.fused_moe_routed(x, w13, w2.dequantize(), logits, 2, True)
    with pytest.raises(ValueError, match="column group 8"):
        q, s = quantize_blocks(w2.dequantize(), (32, 8))
        triton_fp8.fused_moe_routed(x, w13, BlockFp8Weight(q, s, 32, 8), logits, 2, True)
    with pytest.raises(ValueError, match="w2 must be"):
        triton_fp8.fused_moe_routed(x, w13, w13, logits, 2, True)


# ---- real shapes (GPU): Qwen3.5-35B-A3B's experts (E 256 + the shared expert, top-8, H 2048, I 512) ----------

@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 2, 8, 64, 512, 4096])
def test_fp8_moe_real_shapes(T):
    x, w13, w2, logits = _moe("cuda", T, 256, 512, 2048, (128, 128), torch.bfloat16, seed=T, extra=1)
    x = x * 0.5
    got = triton_fp8.fused_moe_routed(x, w13, w2, logits, 8, True, shared_slices=1)
    want = ref.fused_moe_routed(x, w13, w2, logits, 8, True, shared_slices=1)
    assert_close(got, want, 2e-2, f"fp8 moe T={T}")


@pytest.mark.gpu
def test_fp8_moe_graph_equals_eager():
    for T in (1, 8, 64):
        x, w13, w2, logits = _moe("cuda", T, 64, 512, 2048, (128, 128), torch.bfloat16, seed=T, extra=1)
        eager = triton_fp8.fused_moe_routed(x, w13, w2, logits, 8, True, shared_slices=1)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = triton_fp8.fused_moe_routed(x, w13, w2, logits, 8, True, shared_slices=1)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)
