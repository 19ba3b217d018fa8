"""Layer-level fusions keep the function: the shared expert folded into the fused_moe call (as extra
experts) equals routed experts + sigmoid-gated shared MLP computed apart; the fused activations are
chosen once with the other ops; the GDN layer's code is one path whatever its ops fold (the composite ops
choose), equal to the references at fold and no-fold batch sizes; the layers name no backend nor rule."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from deltaserve.config import ModelConfig
from deltaserve.layers.moe import SparseMoeBlock
from deltaserve.ops import REFERENCE_OPS, select_kernels
from deltaserve.ops.moe import reference as moe_ref
from tests.ops import _interpret  # sets TRITON_INTERPRET before any Triton kernel module is imported


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


# ---- the GDN layer: the ops choose the fusions, the layer's code is the same ------------------------------

def _gdn_kernels(device):
    """name -> Kernels: the references (no fold); the references with the fold rules on (the fused steps
    composed in torch); the Triton linear / gdn_decode kernels with their own rules (the interpreter on the
    CPU), each recording the fused calls it makes."""
    from deltaserve.ops.gdn import triton_recurrent as tr
    from deltaserve.ops.linear import reference as lin_ref
    from deltaserve.ops.linear import triton as lin_tri

    ref = select_kernels(device, force_reference=True)
    calls: dict[str, list[int]] = {"conv": [], "gate": []}

    def recorded(kind, fn):
        def op(x, *args, **kw):
            calls[kind].append(x.shape[0])
            return fn(x, *args, **kw)
        return op

    wide = lin_tri.LinearConfig(block_n=128, block_k=64) if device.type == "cpu" else None

    def tiles(fn):   # few programs for the interpreter
        return (lambda x, *a, **kw: fn(x, *a, config=wide if x.shape[0] <= 4 else None, **kw)) if wide else fn

    rules = dict(conv_fold_rows=lin_tri.CONV_FOLD_ROWS, gate_fold_rows=lin_tri.GATE_FOLD_MAX_ROWS)
    folding_ref = dataclasses.replace(ref, rms_norm_linear_conv=recorded("conv", lin_ref.rms_norm_linear_conv),
                                      gated_linear=recorded("gate", lin_ref.gated_linear), **rules)
    triton = dataclasses.replace(
        ref, rms_norm_linear=tiles(lin_tri.rms_norm_linear), linear=lin_tri.linear, gdn_decode=tr.gdn_decode,
        rms_norm_linear_conv=recorded("conv", tiles(lin_tri.rms_norm_linear_conv)),
        gated_linear=recorded("gate", lin_tri.gated_linear), **rules)
    return {"reference": ref, "reference, folds on": folding_ref, "triton": triton}, calls


def _decode_batch(n: int, device, start: int = 0):
    from tests.ops.test_rms_norm_linear import _batch

    return _batch([([1], 3, start + s) for s in range(n)], device)


def test_gdn_layer_forward_is_the_same_function_whatever_the_ops_fold():
    """One GatedDeltaNet + pre-norm, the same code over three Kernels: a mixed batch, then decode steps of 1
    (conv and gated norm folded), 3 (conv folded) and CONV_FOLD_ROWS[1] + 1 sequences (nothing folded): outputs
    and both pools equal to the reference run (bit for bit where only the references compose, within fp32
    rounding on the Triton kernels), each fused kernel called exactly at the batches its rule names."""
    from deltaserve.layers.gated_deltanet import GatedDeltaNet
    from deltaserve.layers.norm import RMSNorm
    from deltaserve.ops.linear import triton as lin_tri
    from tests.ops.test_rms_norm_linear import _batch

    device = _interpret.DEVICE
    cfg = _config(16)
    variants, calls = _gdn_kernels(device)
    hi = lin_tri.CONV_FOLD_ROWS[1]
    slots = hi + 2
    g = torch.Generator().manual_seed(5)
    weights = None
    steps = [_batch([([1, 2, 3], 0, 0), ([4], 3, 1)], device)] + [_decode_batch(n, device) for n in (1, 3, hi + 1)]
    runs = {}
    for name, kernels in variants.items():
        layer = GatedDeltaNet(cfg, kernels, dtype=torch.float32, device=device)
        norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels, dtype=torch.float32, device=device)
        params = [*layer.parameters(), norm.weight]
        if weights is None:
            weights = [torch.randn(p.shape, generator=g) * 0.3 for p in params]
        for p, w in zip(params, weights):
            p.data.copy_(w)
        ssm = torch.zeros(slots, layer.nv, layer.dk, layer.dv, device=device)
        conv = torch.zeros(slots, layer.conv_width - 1, layer.conv_dim, device=device)
        calls["conv"].clear(), calls["gate"].clear()
        outs = []
        gx = torch.Generator().manual_seed(9)
        with torch.inference_mode():
            for batch in steps:
                x = torch.randn(batch.num_tokens, cfg.hidden_size, generator=gx).to(device)
                projection = layer.project_input(x, None, norm, batch, conv)
                outs.append(layer.forward_projected(projection, batch, ssm, conv))
        runs[name] = (torch.cat(outs), ssm, conv)
        if name != "reference":
            assert calls == {"conv": [1, 3], "gate": [1]}, (name, calls)
    want = runs["reference"]
    for name, got in runs.items():
        for a, b, what in zip(got, want, ("outputs", "state pool", "conv pool")):
            if name == "reference, folds on":
                assert torch.equal(a, b), f"{name}: {what}"
            else:
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=f"{name}: {what}")


def test_gdn_out_proj_refuses_a_folded_conv_beside_prefill_rows():
    k = select_kernels("cpu")
    z = torch.zeros(1, 4, 16)
    with pytest.raises(ValueError, match="conv_applied needs a decode-only batch"):
        k.gdn_out_proj(torch.zeros(2, 4, 16), torch.zeros(1, 96), z, torch.zeros(1, 4), torch.zeros(1, 4),
                       conv_weight=None, A_log=None, dt_bias=None, norm_weight=None, eps=1e-6, scale=0.25,
                       conv_state=None, ssm_state=None, state_indices=None, norm_activation="silu",
                       conv_applied=True, weight=None)


def test_layers_choose_no_kernels():
    """The layer modules read no backend names nor fold rules: those are the ops' (ops/fusion.py)."""
    import inspect

    from deltaserve import layers
    from deltaserve.layers import attention, gated_deltanet, linear, mlp, moe, norm
    from deltaserve.models import qwen3_next

    for module in (attention, gated_deltanet, linear, mlp, moe, norm, qwen3_next, layers):
        src = inspect.getsource(module)
        for word in (".backend", "fold_rows", "conv_fold", "folds_gate", "gated_norm=", "triton"):
            assert word not in src, f"{module.__name__} mentions {word!r}"
