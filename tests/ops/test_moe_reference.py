"""The fused-MoE reference's two forms (the few-token path of decode and verify steps, the grouped path of
larger batches) against the formula y_t = sum_j w_tj * w2[e] (silu(gate_e x_t) * up_e x_t), e = ids[t, j]."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from deltaserve.ops.moe import reference as moe_ref

from .helpers import assert_close, gen, randn

E, H, INTER = 6, 32, 16


def _formula(x, w13, w2, weights, ids) -> torch.Tensor:
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j, e in enumerate(ids[t].tolist()):
            h = w13[e].double() @ x[t].double()
            out[t] += weights[t, j].double() * (w2[e].double() @ (F.silu(h[:INTER]) * h[INTER:]))
    return out


def _case(T: int, seed: int, dtype=torch.float32):
    g = gen(seed)
    x = randn(T, H, g=g, dtype=dtype)
    w13, w2 = randn(E, 2 * INTER, H, g=g, dtype=dtype, scale=0.2), randn(E, H, INTER, g=g, dtype=dtype, scale=0.2)
    weights, ids = moe_ref.topk_softmax(randn(T, E - 1, g=g), 2, True, shared_slices=1)  # expert E-1: every token
    return x, w13, w2, weights, ids


@pytest.mark.parametrize("T", [1, 2, 3, 5])
def test_few_token_path_equals_grouped_path_and_formula(T, monkeypatch):
    x, w13, w2, weights, ids = _case(T, seed=T)
    assert ids.numel() <= moe_ref._FEW_PAIRS_MAX, "these sizes take the few-token path"
    few = moe_ref.fused_moe(x, w13, w2, weights, ids)
    monkeypatch.setattr(moe_ref, "_FEW_PAIRS_MAX", 0)
    grouped = moe_ref.fused_moe(x, w13, w2, weights, ids)
    assert torch.equal(few, grouped), "same products, same fp32 accumulation order (expert-index order per token)"
    assert_close(few, _formula(x, w13, w2, weights, ids).float(), 1e-5, "formula")


def test_few_token_path_repeated_and_scattered_experts():
    """A token listing one expert twice (as layers/moe.py's expert-parallel masking does, with weight 0) and an
    expert picked by non-adjacent tokens (a gather, not a slice)."""
    x, w13, w2, _, _ = _case(4, seed=7)
    ids = torch.tensor([[0, 0, 5], [3, 1, 5], [0, 2, 5], [4, 4, 5]])
    weights = torch.tensor([[0.6, 0.0, 0.5], [0.3, 0.7, 0.5], [0.2, 0.8, 0.5], [0.0, 1.0, 0.5]])
    got = moe_ref.fused_moe(x, w13, w2, weights, ids)
    assert_close(got, _formula(x, w13, w2, weights, ids).float(), 1e-5, "formula")


def test_few_token_path_bf16_rounds_once():
    x, w13, w2, weights, ids = _case(3, seed=11, dtype=torch.bfloat16)
    got = moe_ref.fused_moe(x, w13, w2, weights, ids)
    assert got.dtype == torch.bfloat16
    assert_close(got, _formula(x, w13, w2, weights, ids).float(), 2e-2, "bf16 formula")
