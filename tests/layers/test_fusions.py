"""Layer-level fusions keep the function: the shared expert folded into the fused_moe call (as extra
experts) equals routed experts + sigmoid-gated shared MLP computed apart; the fused activations are
chosen once with the other ops."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from deltaserve.config import ModelConfig
from deltaserve.layers.moe import SparseMoeBlock
from deltaserve.ops import REFERENCE_OPS, select_kernels
from deltaserve.ops.moe import reference as moe_ref


def _config(shared: int) -> ModelConfig:
    return ModelConfig.from_dict(dict(
        model_type="qwen3_next", vocab_size=64, hidden_size=48, num_hidden_layers=1, layer_types=["linear_attention"],
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=128,
        num_experts=6, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=shared,
        intermediate_size=32))


@pytest.mark.parametrize("shared, slices", [(16, 1), (32, 2), (24, 0)])
@pytest.mark.parametrize("tokens", [1, 3, 40])          # the reference's pair loop (<= 4 pairs) and grouped path
def test_shared_expert_folded_into_fused_moe_is_the_same_function(shared, slices, tokens):
    cfg = _config(shared)
    block = SparseMoeBlock(cfg, select_kernels("cpu"), dtype=torch.float32, device="cpu")
    assert block.shared_slices == slices and (block.shared_expert is None) == (slices > 0)
    g = torch.Generator().manual_seed(shared + tokens)
    H, E = 48, 6
    ckpt = {name: torch.randn(t.shape, generator=g) * 0.3 for name, t in block.checkpoint_weights(False).items()}
    for name, t in block.checkpoint_weights(False).items():
        t.load(ckpt[name])
    x = torch.randn(tokens, H, generator=g)
    routed_w13 = torch.stack([torch.cat([ckpt[f"experts.{e}.gate_proj.weight"], ckpt[f"experts.{e}.up_proj.weight"]])
                              for e in range(E)])
    routed_w2 = torch.stack([ckpt[f"experts.{e}.down_proj.weight"] for e in range(E)])
    weights, ids = moe_ref.topk_softmax(x @ ckpt["gate.weight"].t(), 2, cfg.norm_topk_prob)
    routed = moe_ref.fused_moe(x, routed_w13, routed_w2, weights, ids)
    sh = F.silu(x @ ckpt["shared_expert.gate_proj.weight"].t()) * (x @ ckpt["shared_expert.up_proj.weight"].t())
    want = routed + torch.sigmoid(x @ ckpt["shared_expert_gate.weight"].t()) * (sh @ ckpt["shared_expert.down_proj.weight"].t())
    torch.testing.assert_close(block(x), want, rtol=1e-5, atol=1e-5)
    assert block.w13.shape[0] == E + slices


def test_activation_ops_are_chosen_with_the_others():
    k = select_kernels("cpu")
    assert k.silu_and_mul is REFERENCE_OPS["silu_and_mul"] and k.sigmoid_mul is REFERENCE_OPS["sigmoid_mul"]
    assert k.backend["silu_and_mul"] == k.backend["sigmoid_mul"] == "reference"
