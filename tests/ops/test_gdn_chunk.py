"""Chunked prefill (Triton) against the plain-torch references: mixed lengths around the chunk size in
one batch, GVA head ratios, slots out of order and padded, with and without initial state."""

from __future__ import annotations

import pytest
import torch

from deltaserve.ops.gdn import reference as ref
from deltaserve.ops.gdn import triton_chunk as tc

from .helpers import assert_close, cu_seqlens, gdn_inputs, gen

# bf16 activations: outputs are rounded to bf16 (on the GPU kernel 2 also rounds its operands to tf32).
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


def _batch(lengths, ratio, dtype, device, seed, dk=16, dv=32, hk=1):
    hv = hk * ratio
    g = gen(seed)
    T = sum(lengths)
    N = len(lengths)
    slots = N + 3
    q, k, v, a, b, A_log, dt_bias, pool = gdn_inputs(T, hk, hv, dk, dv, slots, g=g, dtype=dtype, device=device)
    perm = torch.randperm(slots, generator=g)[:N]
    idx = perm.to(torch.int32)
    idx[N // 2] = -1                                      # one padded row in the middle
    has_init = (torch.arange(N) % 2 == 0)                 # half start from the pool, half from zero
    return dict(q=q, k=k, v=v, a=a, b=b, A_log=A_log, dt_bias=dt_bias, pool=pool,
                cu=cu_seqlens(lengths, device), idx=idx.to(device), has_init=has_init.to(device), scale=dk ** -0.5)


def _run(fn, d, pool, **extra):
    g, beta = ref.gdn_gating(d["A_log"], d["a"], d["dt_bias"], d["b"])
    return fn(d["q"], d["k"], d["v"], g, beta, scale=d["scale"], cu_seqlens=d["cu"], ssm_state=pool,
              state_indices=d["idx"], has_initial_state=d["has_init"], **extra)


@pytest.mark.parametrize("ratio,dtype", [(1, torch.float32), (2, torch.float32), (4, torch.float32),
                                         (2, torch.bfloat16)])
def test_chunk_matches_reference(ratio, dtype, device):
    # lengths around the chunk size in one batch; the 1000-token sequence once (interpreter time)
    lengths = [65, 1, 1000, 64, 63] if (ratio, dtype) == (2, torch.float32) else [1, 63, 64, 65, 130]
    d = _batch(lengths, ratio, dtype, device, seed=ratio)
    p_ref, p_tri = d["pool"].clone(), d["pool"].clone()
    o_ref = _run(ref.chunk_gated_delta_rule, d, p_ref)
    o_tri = _run(tc.chunk_gated_delta_rule, d, p_tri)
    assert_close(o_tri, o_ref, TOL[dtype], "output")
    assert_close(p_tri, p_ref, TOL[dtype], "state pool")
    padded = d["cu"][len(lengths) // 2].item(), d["cu"][len(lengths) // 2 + 1].item()
    assert (o_tri[padded[0]:padded[1]] == 0).all(), "padded sequence must produce zeros"
    untouched = torch.ones(p_ref.shape[0], dtype=torch.bool)
    untouched[d["idx"][d["idx"] >= 0].long().cpu()] = False
    assert torch.equal(p_tri[untouched.to(device)], d["pool"][untouched.to(device)]), "only live slots may change"


def test_chunk_matches_token_recurrence(device):
    """The chunked form against the literal token-by-token recurrence (fp32)."""
    d = _batch([70, 7, 64], 2, torch.float32, device, seed=7)
    p_rec, p_tri = d["pool"].clone(), d["pool"].clone()
    o_rec = _run(ref.recurrent_gated_delta_rule, d, p_rec)
    o_tri = _run(tc.chunk_gated_delta_rule, d, p_tri)
    assert_close(o_tri, o_rec, 2e-5, "output")
    assert_close(p_tri, p_rec, 2e-5, "state pool")


def test_fused_gates_prefill_matches_reference(device):
    d = _batch([70, 1, 64], 2, torch.bfloat16, device, seed=3)
    kw = dict(A_log=d["A_log"], dt_bias=d["dt_bias"], scale=d["scale"], cu_seqlens=d["cu"],
              state_indices=d["idx"], has_initial_state=d["has_init"])
    p_ref, p_tri = d["pool"].clone(), d["pool"].clone()
    o_ref = ref.gdn_prefill(d["q"], d["k"], d["v"], d["a"], d["b"], ssm_state=p_ref, **kw)
    o_tri = tc.gdn_prefill(d["q"], d["k"], d["v"], d["a"], d["b"], ssm_state=p_tri, **kw)
    assert_close(o_tri, o_ref, TOL[torch.bfloat16], "output")
    assert_close(p_tri, p_ref, TOL[torch.bfloat16], "state pool")


def test_split_prefill_equals_whole(device):
    """A prompt prefilled in two pieces (the second continuing from the pool) == prefilled at once."""
    d = _batch([200], 2, torch.float32, device, seed=11)
    d["idx"][:] = 2
    whole, split = d["pool"].clone(), d["pool"].clone()
    g, beta = ref.gdn_gating(d["A_log"], d["a"], d["dt_bias"], d["b"])
    common = dict(scale=d["scale"], state_indices=d["idx"])
    o_whole = tc.chunk_gated_delta_rule(d["q"], d["k"], d["v"], g, beta, cu_seqlens=d["cu"], ssm_state=whole,
                                        has_initial_state=torch.ones(1, dtype=torch.bool, device=device), **common)
    outs = []
    for lo, hi, init in ((0, 77, False), (77, 200, True)):
        outs.append(tc.chunk_gated_delta_rule(
            d["q"][lo:hi], d["k"][lo:hi], d["v"][lo:hi], g[lo:hi], beta[lo:hi],
            cu_seqlens=cu_seqlens([hi - lo], device), ssm_state=split,
            has_initial_state=torch.tensor([init or True], device=device), **common))
    assert_close(torch.cat(outs), o_whole, 2e-5, "output")
    assert_close(split, whole, 2e-5, "state")


def test_strided_inputs_from_one_projection(device):
    """q, k, v as views into one packed activation (how the layer passes them)."""
    g = gen(5)
    T, hk, hv, dk, dv = 90, 2, 4, 16, 16
    mixed = torch.randn(T, 2 * hk * dk + hv * dv + 8, generator=g).to(device)
    q = mixed[:, : hk * dk].view(T, hk, dk)
    k = mixed[:, hk * dk : 2 * hk * dk].view(T, hk, dk)
    v = mixed[:, 2 * hk * dk : 2 * hk * dk + hv * dv].view(T, hv, dv)
    gg = -torch.rand(T, hv, generator=g).to(device)
    beta = torch.rand(T, hv, generator=g).to(device)
    kw = dict(scale=dk ** -0.5, cu_seqlens=cu_seqlens([T], device),
              state_indices=torch.tensor([0], dtype=torch.int32, device=device),
              has_initial_state=torch.tensor([False], device=device))
    p1 = torch.zeros(1, hv, dk, dv, device=device)
    p2 = p1.clone()
    o_ref = ref.chunk_gated_delta_rule(q, k, v, gg, beta, ssm_state=p1, **kw)
    o_tri = tc.chunk_gated_delta_rule(q, k, v, gg, beta, ssm_state=p2, **kw)
    assert_close(o_tri, o_ref, 2e-5, "output")


def test_unsupported_inputs_raise(device):
    d = _batch([10], 1, torch.float32, device, seed=1, dk=24, dv=16)
    with pytest.raises(ValueError, match="K = 24"):
        _run(tc.chunk_gated_delta_rule, d, d["pool"])
    d = _batch([10], 1, torch.float32, device, seed=1)
    with pytest.raises(ValueError, match="chunk_size"):
        _run(tc.chunk_gated_delta_rule, d, d["pool"], chunk_size=32)
    with pytest.raises(ValueError, match="ssm_state must be float32"):
        _run(tc.chunk_gated_delta_rule, d, d["pool"].to(torch.bfloat16))


@pytest.mark.parametrize("prec", tc.PRECISIONS)
def test_chunk_operand_precisions(prec, device):
    """Every operand precision of the state kernel (bf16 limbs, tf32, exact) runs and matches the reference
    (the interpreter computes all of them in fp32; the GPU tests check the real roundings)."""
    d = _batch([65, 1, 64], 2, torch.bfloat16, device, seed=9)
    p_ref, p_tri = d["pool"].clone(), d["pool"].clone()
    o_ref = _run(ref.chunk_gated_delta_rule, d, p_ref)
    o_tri = _run(tc.chunk_gated_delta_rule, d, p_tri, config=tc.ChunkConfig(prec=prec))
    assert_close(o_tri, o_ref, TOL[torch.bfloat16], "output")
    assert_close(p_tri, p_ref, TOL[torch.bfloat16], "state pool")


def test_chunk_rejects_unknown_precision(device):
    d = _batch([10], 1, torch.bfloat16, device, seed=1)
    with pytest.raises(ValueError, match="prec='fp8'"):
        _run(tc.chunk_gated_delta_rule, d, d["pool"], config=tc.ChunkConfig(prec="fp8"))
    with pytest.raises(ValueError, match="merge_prec='bf16'"):
        _run(tc.chunk_gated_delta_rule, d, d["pool"], config=tc.ChunkConfig(merge_prec="bf16"))


@pytest.mark.parametrize("change", [dict(split_prep=False), dict(p_in_wu=True)])
def test_chunk_prep_layouts_agree(change, device):
    """W and U formed inside the solve kernel (16-row blocks), or P formed in the W/U kernel, == the
    default split prep."""
    d = _batch([65, 1, 64], 2, torch.float32, device, seed=4)
    p_base, p_var = d["pool"].clone(), d["pool"].clone()
    o_base = _run(tc.chunk_gated_delta_rule, d, p_base, config=tc.ChunkConfig(prec="ieee"))
    o_var = _run(tc.chunk_gated_delta_rule, d, p_var, config=tc.ChunkConfig(prec="ieee", **change))
    assert_close(o_var, o_base, 2e-5, "output")
    assert_close(p_var, p_base, 2e-5, "state pool")


def test_state_stages_fit_the_operand_dtype():
    """3 pipeline stages only with bf16 operand tiles: fp32 W / P tiles at 3 stages overflow shared memory."""
    assert tc.ChunkConfig().state_stages() == 3
    assert tc.ChunkConfig(prec="tf32").state_stages() == 2
    assert tc.ChunkConfig(prec="ieee").state_stages() == 2
    assert tc.ChunkConfig(prec="tf32", stages_state=1).state_stages() == 1


def test_chunk_wide_state_slices(device):
    """64-column state slices (one program per 64 value columns) == the reference."""
    d = _batch([65, 1, 70], 2, torch.bfloat16, device, seed=6, dk=16, dv=64)
    p_ref, p_tri = d["pool"].clone(), d["pool"].clone()
    o_ref = _run(ref.chunk_gated_delta_rule, d, p_ref)
    o_tri = _run(tc.chunk_gated_delta_rule, d, p_tri, config=tc.ChunkConfig(bv=64))
    assert_close(o_tri, o_ref, TOL[torch.bfloat16], "output")
    assert_close(p_tri, p_ref, TOL[torch.bfloat16], "state pool")
