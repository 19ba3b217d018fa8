"""Session 10: inputs the chain reads itself instead of the prep's copies.

ChunkConfig.u_in_chain: the prep stores U's factor T diag(beta) as two bf16 limbs instead of U = (T diag(beta)) V
in fp32, and the chain forms U = hi V + lo V from them and the chunk's rows of v: the products the prep's bf16x2 U
makes, moved. Under the interpreter the Triton chain does it with the same `tl.dot` nesting as the prep's
`_dot_raw`, so the whole op must be bit for bit the one without it; on the H200 the Gluon chain's warpgroup
products sum in their own order (a tight tolerance), and the 8k case must stay at least as accurate as FLA.

ChunkConfig.k_in_chain: the chain reads whole chunks' K rows from k (TMA) instead of the prep's zero-padded copy,
which the prep then stores only for a sequence's partial last chunk: the same operands, so bit for bit everywhere.

The cross-request isolation cases run both (tests/ops/test_gdn_isolation.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from deltaserve.ops.gdn import reference as ref
from deltaserve.ops.gdn import triton_chunk as tc

from .helpers import assert_close, rel_err
from .test_gdn_chunk import TOL, _batch, _run
from .test_gdn_prep8 import _packed


def _default(N: int, hv: int, gluon: bool = False) -> tc.ChunkConfig:
    """The bf16 default of head dims 128 (chunk layout, the TMA prep); its Triton chain unless gluon."""
    return tc.default_chunk_config(N, hv, 128, torch.bfloat16, k=128, gluon=gluon)


FLAGS = [dict(u_in_chain=True), dict(k_in_chain=True), dict(u_in_chain=True, k_in_chain=True)]
FLAG_IDS = ["u", "k", "u+k"]


@pytest.mark.parametrize("flags", FLAGS, ids=FLAG_IDS)
@pytest.mark.parametrize("pad", [0, 1])
def test_chain_inputs_bitwise_equal_under_interpreter(pad, flags, device):
    """Lengths around the chunk (partial last chunks whose k / v rows reach into the next sequence, a 1-token
    sequence), a padded row, slots out of order, 2 value heads per key head, on q / k / v as views of one packed
    projection (pad 1: an unaligned row stride: v is copied for the chain's TMA reads, and k_in_chain has no
    effect since the prep cannot read k by TMA): outputs and the pool bit for bit those without the flags, and
    within the bf16 tolerance of the reference."""
    if device.type == "cuda":
        pytest.skip("the GPU refuses head dims 32 in bf16; test_chain_inputs_real_shape_gpu covers it")
    lengths = [65, 1, 70, 64]
    d = _batch(lengths, 2, torch.bfloat16, device, seed=51, dk=32, dv=32)
    d["q"], d["k"], d["v"] = _packed(d, pad)
    base = _default(len(lengths), 2)
    assert base.layout == "chunk" and base.hoist and not base.u_in_chain and not base.k_in_chain
    p_ref, p_base, p_cand = d["pool"].clone(), d["pool"].clone(), d["pool"].clone()
    o_ref = _run(ref.chunk_gated_delta_rule, d, p_ref)
    o_base = _run(tc.chunk_gated_delta_rule, d, p_base, config=base)
    o_cand = _run(tc.chunk_gated_delta_rule, d, p_cand, config=dataclasses.replace(base, **flags))
    assert torch.equal(o_cand, o_base), f"output: max diff {(o_cand.float() - o_base.float()).abs().max()}"
    assert torch.equal(p_cand, p_base), f"state: max diff {(p_cand - p_base).abs().max()}"
    assert_close(o_cand, o_ref, TOL[torch.bfloat16], "output vs reference")
    assert_close(p_cand, p_ref, TOL[torch.bfloat16], "state vs reference")


def _prep_buffers(lengths, seed, device, **flags):
    """The batch and the default prep's buffers at head dims 32 (interpreter only), without and with `flags`."""
    if device.type == "cuda":
        pytest.skip("the GPU refuses head dims 32 in bf16; test_chain_inputs_real_shape_gpu covers it")
    d = _batch(lengths, 2, torch.bfloat16, device, seed=seed, dk=32, dv=32)
    g, beta = ref.gdn_gating(d["A_log"], d["a"], d["dt_bias"], d["b"])
    base = _default(len(lengths), 2)
    args = (d["q"], d["k"], d["v"], g, beta, False, None, None, d["scale"], d["cu"], len(lengths), True)
    return d, tc._launch_prep(*args, base), tc._launch_prep(*args, dataclasses.replace(base, **flags))


def test_u_in_chain_factor_buffer(device):
    """The prep's Ub under u_in_chain holds the two limbs of T diag(beta) per chunk row: hi + lo times the chunk's
    v rows (zeros past the sequence) gives the U the prep stores without it."""
    lengths = [65, 1, 70]
    d, base, got = _prep_buffers(lengths, 52, device, u_in_chain=True)
    want = base["Ub"]
    assert got["Ub"].dtype == torch.bfloat16 and got["Ub"].shape == (want.shape[0], 2 * tc.CHUNK)
    hv, dv = d["v"].shape[1:]
    coff = got["coff"].tolist()
    cu = d["cu"].tolist()
    for n, L in enumerate(lengths):
        for c in range(-(-L // tc.CHUNK)):
            t0, left = cu[n] + c * tc.CHUNK, min(tc.CHUNK, L - c * tc.CHUNK)
            vrows = torch.zeros(tc.CHUNK, hv, dv, dtype=torch.float32, device=device)
            vrows[:left] = d["v"][t0:t0 + left].float()
            for h in range(hv):
                r = ((coff[n] + c) * hv + h) * tc.CHUNK
                fac = got["Ub"][r:r + tc.CHUNK].float()
                u = fac[:, :tc.CHUNK] @ vrows[:, h] + fac[:, tc.CHUNK:] @ vrows[:, h]
                assert_close(u, want[r:r + tc.CHUNK], 1e-6, f"sequence {n} chunk {c} head {h}")


def test_k_in_chain_prep_stores_only_partial_chunks_k(device):
    """With k_in_chain the TMA prep leaves the K copy of whole chunks unwritten (the chain reads k) and writes the
    zero-padded rows of each sequence's partial last chunk as before."""
    lengths = [65, 64, 70]
    d, want, got = _prep_buffers(lengths, 54, device, k_in_chain=True)
    assert got["k"] is d["k"] and "k" not in want
    hk = d["k"].shape[1]
    coff, cu = got["coff"].tolist(), d["cu"].tolist()
    for n, L in enumerate(lengths):
        for c in range(-(-L // tc.CHUNK)):
            rows = slice((coff[n] + c) * hk * tc.CHUNK, (coff[n] + c + 1) * hk * tc.CHUNK)
            if L - c * tc.CHUNK < tc.CHUNK:
                assert torch.equal(got["Kb"][rows], want["Kb"][rows]), f"sequence {n} chunk {c}: the padded copy"


def test_u_in_chain_needs_the_chunk_layout_hoist_prep(device):
    """u_in_chain is a choice of the hoist prep in the chunk layout with bf16x2 W / U and bf16 activations."""
    lengths = [70]
    d = _batch(lengths, 2, torch.bfloat16, device, seed=53, dk=128, dv=128)
    base = _default(1, 2)
    for bad in (dataclasses.replace(base, u_in_chain=True, layout="token"),
                dataclasses.replace(base, u_in_chain=True, hoist=False, tma_load=False, tma_store=False),
                dataclasses.replace(base, u_in_chain=True, wu_prec="tf32")):
        with pytest.raises(ValueError, match="u_in_chain"):
            _run(tc.chunk_gated_delta_rule, d, d["pool"].clone(), config=bad)


def test_chain_inputs_default_rule():
    """The default forms U in the chain with the Gluon chain (session 10: on 64-column slices, the batches; session
    11, with the outputs' TMA stores: for one sequence's 32-column slices too), not with the Triton chain; k_in_chain
    likewise (session 10: the batches; session 12, behind the Gluon prep: one sequence too)."""
    assert _default(4, 32, gluon=True).u_in_chain
    assert _default(32, 32, gluon=True).u_in_chain
    assert _default(1, 32, gluon=True).u_in_chain and _default(1, 32, gluon=True).bv == 32
    assert not _default(4, 32).u_in_chain
    assert not tc.default_chunk_config(4, 32, 128, torch.bfloat16, k=128, tokens=256, gluon=True).u_in_chain  # token
    assert not tc.default_chunk_config(4, 32, 128, torch.float32, k=128, gluon=True).u_in_chain
    # k_in_chain likewise (H200: run S10-7 for batches; run S12-4 for one sequence behind the Gluon prep)
    assert _default(4, 32, gluon=True).k_in_chain and _default(1, 32, gluon=True).k_in_chain
    assert not _default(4, 32).k_in_chain
    assert not tc.default_chunk_config(4, 32, 128, torch.bfloat16, k=128, tokens=256, gluon=True).k_in_chain


def test_named_preps_keep_only_the_chain_inputs_they_support():
    """The named prep variants on a batch default of the Gluon chain (u_in_chain and k_in_chain on): the session-7
    preps (PREP7) drop both (no hoist prep), the session-8 prep without TMA loads drops k_in_chain (the isolation
    and prep tests build their configurations this way; run S10-8 found them raising)."""
    base = _default(4, 32, gluon=True)
    assert base.u_in_chain and base.k_in_chain
    for name in tc.PREP7:
        cfg = tc.prep7_config(name, base)
        assert not cfg.u_in_chain and not cfg.k_in_chain, name
    for name, prep in tc.PREP8.items():
        cfg = tc.prep8_config(name, base)
        assert cfg.u_in_chain and cfg.k_in_chain == prep.tma_load, name
    assert not tc.prep8_config("hoist-heads-r168", base).k_in_chain


def test_k_in_chain_needs_the_tma_prep(device):
    """k_in_chain is a choice of the TMA prep (hoist, tma_load) in the chunk layout."""
    d = _batch([70], 2, torch.bfloat16, device, seed=55, dk=128, dv=128)
    base = _default(1, 2)
    for bad in (dataclasses.replace(base, k_in_chain=True, layout="token"),
                dataclasses.replace(base, k_in_chain=True, tma_load=False)):
        with pytest.raises(ValueError, match="k_in_chain"):
            _run(tc.chunk_gated_delta_rule, d, d["pool"].clone(), config=bad)


# ---- GPU: the real Qwen3-Next shape ---------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("flags", FLAGS, ids=FLAG_IDS)
@pytest.mark.parametrize("chain", ["gluon", "triton"])
def test_chain_inputs_real_shape_gpu(chain, flags):
    """The real-shape mixed batch (lengths 1 / 63 / 64 / 65 / 1000, a padded row, slots out of order, half without
    initial state): against the same chain without the flags (the same products: a tight tolerance, equality
    reported; k_in_chain alone bit for bit) and against the reference."""
    from .test_gdn_chunk import _real_shape_mixed_batch
    from .test_gpu import TOL_BF16, _report

    q, k, v, g, beta, pool, kw = _real_shape_mixed_batch()
    base = dataclasses.replace(_default(5, 32, gluon=True), chain=chain, bv=64, u_in_chain=False, k_in_chain=False,
                               o_tma=chain == "gluon")
    if chain == "gluon" and not tc.gluon_chain.supported(q.device):
        pytest.skip("the Gluon chain needs compute capability 9.0")
    p_ref, p_base, p_cand = pool.clone(), pool.clone(), pool.clone()
    o_ref = ref.chunk_gated_delta_rule(q, k, v, g, beta, ssm_state=p_ref, **kw)
    o_base = tc.chunk_gated_delta_rule(q, k, v, g, beta, ssm_state=p_base, config=base, **kw)
    o_cand = tc.chunk_gated_delta_rule(q, k, v, g, beta, ssm_state=p_cand,
                                       config=dataclasses.replace(base, **flags), **kw)
    _report(test="chain_inputs_real_shape", config=f"{chain} {flags}", identical_out=bool(torch.equal(o_cand, o_base)),
            identical_state=bool(torch.equal(p_cand, p_base)), out_rel=rel_err(o_cand, o_base),
            state_rel=rel_err(p_cand, p_base), out_rel_ref=rel_err(o_cand, o_ref), state_rel_ref=rel_err(p_cand, p_ref))
    assert_close(o_cand, o_base, 1e-2, "output")
    assert_close(p_cand, p_base, 1e-5, "state")
    assert (o_cand[64:128] == 0).all(), "padded sequence gives zeros"
    assert_close(o_cand, o_ref, TOL_BF16, "output vs reference")
    assert_close(p_cand, p_ref, TOL_BF16, "state vs reference")
    if not flags.get("u_in_chain"):
        assert torch.equal(o_cand, o_base) and torch.equal(p_cand, p_base), "k_in_chain reads the same K operand"


@pytest.mark.gpu
def test_chain_inputs_8k_not_less_accurate_than_fla_gpu():
    """One 8192-token sequence with slow decay against the fp32 token recurrence: the output and final state
    errors with u_in_chain / k_in_chain must not exceed FLA's (reported beside the default's)."""
    from .test_gpu import check_8k_not_less_accurate_than_fla

    cfg = _default(1, 32, gluon=tc.gluon_chain.supported(torch.device("cuda")))
    check_8k_not_less_accurate_than_fla({"default": None, "u_in_chain": dataclasses.replace(cfg, u_in_chain=True),
                                         "k_in_chain": dataclasses.replace(cfg, k_in_chain=not cfg.k_in_chain),
                                         "without u_in_chain": dataclasses.replace(cfg, u_in_chain=False)},
                                        "chain_inputs_8k")
