"""Session 8 (prep8): the latency-cut forms of the session-7 bf16 prep (triton_chunk.PREP8: every load first, the
heads-first grid, a register cap for 3 programs per SM) form the same products of the same
operands in the same order as that prep (PREP7 "wide-fp16-lean"), so their buffers must equal its buffers
(exactly under the interpreter), and the whole op must match the reference. The `gpu` tests run them at the real
Qwen3-Next shape (mixed batch, and one 8192-token sequence against FLA)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from deltaserve.ops.gdn import reference as ref
from deltaserve.ops.gdn import triton_chunk as tc

from .helpers import assert_close, cu_seqlens, rel_err
from .test_gdn_chunk import TOL, _batch, _run

BUFFERS = {"chunk": ("Wb", "Ub", "Pb", "Kb", "Cb", "Lb"), "token": ("Wb", "Ub", "Pb", "Gb", "rq", "rk")}


def _session7(cfg):
    """`cfg` with the session-7 bf16 prep (PREP7 wide-fp16-lean: loads where used, the (chunks, heads) grid, no
    register cap), the prep every PREP8 form must reproduce exactly."""
    return tc.prep7_config("wide-fp16-lean", dataclasses.replace(cfg, hoist=False, heads_first=False))


def _base(layout, dims):
    """The session-7 bf16 prep in `layout`, on the default configuration at `dims`."""
    return _session7(dataclasses.replace(tc.default_chunk_config(3, 2, dims, torch.bfloat16, k=dims), layout=layout))


def _prep_buffers(d, g, beta, lengths, cfg):
    return tc._launch_prep(d["q"], d["k"], d["v"], g, beta, False, None, None, d["scale"], d["cu"], len(lengths),
                           True, cfg)


@pytest.mark.parametrize("layout", ["chunk", "token"])
@pytest.mark.parametrize("name", list(tc.PREP8))
def test_prep8_buffers_equal_session7_prep(name, layout, device):
    """Each PREP8 prep's buffers against the session-7 prep's (same products, same order): exactly equal under the
    interpreter, in both store layouts."""
    if device.type == "cuda":
        pytest.skip("the GPU refuses the lean prep at these head dims; test_prep8_real_shape_gpu covers it")
    lengths = [65, 1, 70]
    d = _batch(lengths, 2, torch.bfloat16, device, seed=31, dk=32, dv=32)
    g, beta = ref.gdn_gating(d["A_log"], d["a"], d["dt_bias"], d["b"])
    base = _base(layout, 32)
    want = _prep_buffers(d, g, beta, lengths, base)
    got = _prep_buffers(d, g, beta, lengths, tc.prep8_config(name, base))
    for b in BUFFERS[layout]:
        assert torch.equal(got[b], want[b]), f"{name} {layout} {b}: max diff {(got[b].float() - want[b].float()).abs().max()}"


@pytest.mark.parametrize("name", list(tc.PREP8))
def test_prep8_matches_reference_with_fused_gates(name, device):
    """The whole op with a PREP8 prep and the gates from their pre-activations (gdn_prefill), both layouts,
    against the reference and the session-7 prep."""
    if device.type == "cuda":
        pytest.skip("the GPU refuses the lean prep at these head dims; test_prep8_real_shape_gpu covers it")
    d = _batch([65, 1, 70], 2, torch.bfloat16, device, seed=32, dk=32, dv=32)
    kw = dict(A_log=d["A_log"], dt_bias=d["dt_bias"], scale=d["scale"], cu_seqlens=d["cu"], state_indices=d["idx"],
              has_initial_state=d["has_init"])
    p_ref = d["pool"].clone()
    o_ref = ref.gdn_prefill(d["q"], d["k"], d["v"], d["a"], d["b"], ssm_state=p_ref, **kw)
    for layout in ("chunk", "token"):
        base = _base(layout, 32)
        p_def, p_var = d["pool"].clone(), d["pool"].clone()
        o_def = tc.gdn_prefill(d["q"], d["k"], d["v"], d["a"], d["b"], ssm_state=p_def, config=base, **kw)
        o_var = tc.gdn_prefill(d["q"], d["k"], d["v"], d["a"], d["b"], ssm_state=p_var,
                               config=tc.prep8_config(name, base), **kw)
        assert_close(o_var, o_ref, TOL[torch.bfloat16], f"{layout} output")
        assert_close(p_var, p_ref, TOL[torch.bfloat16], f"{layout} state pool")
        assert torch.equal(o_var, o_def) and torch.equal(p_var, p_def), f"{layout}: differs from the session-7 prep"


def test_prep8_rejects_unsupported_combinations(device):
    """hoist needs the lean prep with the wide inverse and full-width W / U; heads_first the tc prep (head dims
    128, which the GPU accepts, so the same checks fire on both devices; nothing is launched)."""
    d = _batch([10], 1, torch.bfloat16, device, seed=1, dk=128, dv=128)
    for cfg, what in ((tc.ChunkConfig(hoist=True), "hoist"),
                      (tc.ChunkConfig(ut="wide", lean=True, hoist=True, wu_cols=16), "hoist"),
                      (tc.ChunkConfig(solve="subst", heads_first=True), "heads_first")):
        with pytest.raises(ValueError, match=what):
            _run(tc.chunk_gated_delta_rule, d, d["pool"].clone(), config=cfg)


def test_prep8_configs_keep_the_default_fields():
    """A PREP8 entry changes only prep fields of the shape's configuration; the new fields default off; the bf16
    default at head dims 128 is "tma-r168" (fp32 activations and other dims keep the session-7 forms)."""
    assert not (tc.ChunkConfig().hoist or tc.ChunkConfig().heads_first or tc.ChunkConfig().tma_load
                or tc.ChunkConfig().tma_store)
    base = tc.default_chunk_config(1, 32, 128, torch.bfloat16, k=128)
    for name in tc.PREP8:
        cfg = tc.prep8_config(name, base)
        assert (cfg.layout, cfg.bv, cfg.prec, cfg.chain) == (base.layout, base.bv, base.prec, base.chain)
        assert (cfg.ut, cfg.ut_prec, cfg.lean) == ("wide", "fp16", True)
    assert tc.prep8_config("tma-r168", base) == base
    for other in (tc.default_chunk_config(1, 32, 128, torch.float32, k=128),
                  tc.default_chunk_config(1, 32, 64, torch.bfloat16, k=64)):
        assert not (other.hoist or other.heads_first or other.maxnreg_tc or other.tma_load or other.tma_store)


# ---- GPU: the real Qwen3-Next shape ---------------------------------------------------------------------------

def _real_base(N):
    """The session-7 prep on the default configuration of the real shape with N sequences."""
    return _session7(tc.default_chunk_config(N, 32, 128, torch.bfloat16, k=128))


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(tc.PREP8))
def test_prep8_real_shape_gpu(name):
    """The real-shape mixed batch (lengths 1 / 63 / 64 / 65 / 1000, a padded row, slots out of order, half without
    initial state): the whole op against the reference, and against the session-7 prep (the same products:
    equality reported, a tight tolerance asserted); the prep's chunk-layout buffers against the session-7 prep's."""
    from .test_gdn_chunk import _real_shape_mixed_batch
    from .test_gpu import TOL_BF16, _report

    q, k, v, g, beta, pool, kw = _real_shape_mixed_batch()
    base = _real_base(5)
    cand = tc.prep8_config(name, base)
    p_ref, p_def, p_var = pool.clone(), pool.clone(), pool.clone()
    o_ref = ref.chunk_gated_delta_rule(q, k, v, g, beta, ssm_state=p_ref, **kw)
    o_def = tc.chunk_gated_delta_rule(q, k, v, g, beta, ssm_state=p_def, config=base, **kw)
    o_var = tc.chunk_gated_delta_rule(q, k, v, g, beta, ssm_state=p_var, config=cand, **kw)
    bd = tc._launch_prep(q, k, v, g, beta, False, None, None, kw["scale"], kw["cu_seqlens"], 5, True, base)
    bv = tc._launch_prep(q, k, v, g, beta, False, None, None, kw["scale"], kw["cu_seqlens"], 5, True, cand)
    buf_err = {b: rel_err(bv[b], bd[b]) for b in BUFFERS["chunk"]}
    _report(test="prep8_real_shape", config=name, out_rel=rel_err(o_var, o_ref), state_rel=rel_err(p_var, p_ref),
            identical_out=bool(torch.equal(o_var, o_def)), identical_state=bool(torch.equal(p_var, p_def)),
            identical_buffers=all(torch.equal(bv[b], bd[b]) for b in BUFFERS["chunk"]),
            tma_rows=all(tc._tma_rows(x) for x in (q, k, v)), **buf_err)
    assert_close(o_var, o_ref, TOL_BF16, "output")
    assert_close(p_var, p_ref, TOL_BF16, "state")
    assert (o_var[64:128] == 0).all(), "padded sequence gives zeros"
    assert_close(o_var, o_def, 1e-2, "output vs the session-7 prep")
    assert_close(p_var, p_def, 1e-5, "state vs the session-7 prep")
    for b, err in buf_err.items():
        assert err < 1e-5, f"{name} {b}: relative error {err:.3g} against the session-7 prep"


@pytest.mark.gpu
def test_prep8_token_layout_buffers_gpu():
    """The PREP8 preps in the token layout at the real shape (the layout of batches of many short sequences):
    buffers equal to the session-7 prep's within a tight tolerance."""
    from .test_gpu import HK, HV, D, _inputs, _report

    lengths = [1, 63, 64, 65, 300]
    q, k, v, g, beta = _inputs(lengths, HK, HV, seed=12)
    base = dataclasses.replace(_real_base(len(lengths)), layout="token")
    args = (q, k, v, g, beta, False, None, None, D ** -0.5, cu_seqlens(lengths, "cuda"), len(lengths), True)
    want = tc._launch_prep(*args, base)
    for name in tc.PREP8:
        got = tc._launch_prep(*args, tc.prep8_config(name, base))
        errs = {b: rel_err(got[b], want[b]) for b in BUFFERS["token"]}
        _report(test="prep8_token_buffers", config=name, **errs)
        for b, err in errs.items():
            assert err < 1e-5, f"{name} {b}: relative error {err:.3g} against the session-7 prep"


@pytest.mark.gpu
def test_prep8_8k_not_less_accurate_than_fla_gpu():
    """One 8192-token sequence with slow decay against the fp32 token recurrence: every PREP8 prep's output and
    final-state errors must not exceed FLA's (reported beside the default's)."""
    from .test_gpu import check_8k_not_less_accurate_than_fla

    configs = {"default": None, "session7": _real_base(1)}
    configs.update({name: tc.prep8_config(name, _real_base(1)) for name in tc.PREP8})
    check_8k_not_less_accurate_than_fla(configs, "prep8_8k")


# ---- sessions 8-9 (prep9, prep10): the hoist prep with TMA loads / stores (PREP8 "tma-r168") -------------------

TMA_NAMES = [n for n in tc.PREP8 if tc.PREP8[n].tma_load or tc.PREP8[n].tma_store]


def _packed(d, pad):
    """q, k, v as the model hands them over: views of one projection row [q | k | v | pad columns], so the row
    stride is not the heads' width (pad = 1 makes it an odd number of bf16, which TMA cannot address)."""
    T = d["q"].shape[0]
    parts = [d[x].reshape(T, -1) for x in "qkv"]
    mixed = torch.cat(parts + [torch.zeros(T, pad, dtype=parts[0].dtype, device=parts[0].device)], 1)
    out, c0 = [], 0
    for x, part in zip("qkv", parts):
        out.append(mixed[:, c0:c0 + part.shape[1]].view(d[x].shape))
        c0 += part.shape[1]
    return out


@pytest.mark.parametrize("pad", [0, 1])
@pytest.mark.parametrize("layout", ["chunk", "token"])
def test_prep9_tma_buffers_equal_session7_prep(layout, pad, device):
    """The TMA forms with two key heads (column offsets inside the projection row) on strided views of a packed
    projection: with pad 0 TMA reads the whole chunks (a sequence's partial last chunk takes the pointer loads), with
    pad 1 the row stride is unaligned and the pointer loads run throughout. Buffers exactly equal to the session-7
    prep's in both layouts (the token layout stores by pointers)."""
    if device.type == "cuda":
        pytest.skip("the GPU refuses the lean prep at these head dims; test_prep8_real_shape_gpu covers it")
    lengths = [65, 1, 70, 3, 128]
    d = _batch(lengths, 2, torch.bfloat16, device, seed=33, dk=32, dv=32, hk=2)
    q, k, v = _packed(d, pad)
    assert all(tc._tma_rows(x) for x in (q, k, v)) == (pad == 0)
    d = dict(d, q=q, k=k, v=v)
    g, beta = ref.gdn_gating(d["A_log"], d["a"], d["dt_bias"], d["b"])
    base = _base(layout, 32)
    want = _prep_buffers(d, g, beta, lengths, base)
    for name in TMA_NAMES:
        got = _prep_buffers(d, g, beta, lengths, tc.prep8_config(name, base))
        for b in BUFFERS[layout]:
            assert torch.equal(got[b], want[b]), (
                f"{name} {layout} pad {pad} {b}: max diff {(got[b].float() - want[b].float()).abs().max()}")


def test_prep9_tma_needs_the_hoist_prep(device):
    """tma_load / tma_store are forms of the hoist prep: refused without it (nothing is launched)."""
    d = _batch([10], 1, torch.bfloat16, device, seed=1, dk=128, dv=128)
    for cfg in (tc.ChunkConfig(ut="wide", lean=True, tma_load=True), tc.ChunkConfig(ut="wide", lean=True,
                                                                                   tma_store=True)):
        with pytest.raises(ValueError, match="tma_load / tma_store"):
            _run(tc.chunk_gated_delta_rule, d, d["pool"].clone(), config=cfg)


def test_prep9_tma_rows_rule():
    """TMA reads [T, H, D] as [T, H * D] rows: contiguous heads, 16-byte aligned base and row stride."""
    x = torch.zeros(8, 3, 16, dtype=torch.bfloat16)
    assert tc._tma_rows(x)
    assert not tc._tma_rows(x[:, :, :8])                      # heads not contiguous
    assert not tc._tma_rows(torch.zeros(8, 3 * 16 + 1, dtype=torch.bfloat16)[:, :48].view(8, 3, 16))  # row stride
    assert not tc._tma_rows(torch.zeros(8 * 48 + 1, dtype=torch.bfloat16)[1:].view(8, 3, 16))  # base alignment


@pytest.mark.gpu
def test_prep9_tma_packed_projection_gpu():
    """The TMA preps at the real shape on q / k / v as views of one packed projection row (as the model hands them
    over): chunk-layout buffers against the session-7 prep's (equality reported, a tight tolerance asserted)."""
    from .test_gdn_chunk import _real_shape_mixed_batch
    from .test_gpu import _report

    q, k, v, g, beta, pool, kw = _real_shape_mixed_batch()
    q, k, v = _packed(dict(q=q, k=k, v=v), 0)
    assert all(tc._tma_rows(x) for x in (q, k, v))
    base = _real_base(5)
    args = (q, k, v, g, beta, False, None, None, kw["scale"], kw["cu_seqlens"], 5, True)
    want = tc._launch_prep(*args, base)
    for name in TMA_NAMES:
        got = tc._launch_prep(*args, tc.prep8_config(name, base))
        errs = {b: rel_err(got[b], want[b]) for b in BUFFERS["chunk"]}
        _report(test="prep9_tma_packed", config=name, identical=all(torch.equal(got[b], want[b])
                                                                     for b in BUFFERS["chunk"]), **errs)
        for b, err in errs.items():
            assert err < 1e-5, f"{name} {b}: relative error {err:.3g} against the session-7 prep"
