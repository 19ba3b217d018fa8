"""The Gluon chain (deltaserve/ops/gdn/gluon_chain.py), the chunked prefill's state kernel on Hopper.

Gluon kernels do not run under the Triton interpreter, so on a CPU machine they are compiled for sm_90 (the
H200's target) and their resources checked: no register spills, shared memory within the device's. The
`gpu` tests run them against the Triton TMA chain on the same prep buffers (the same products: equal states,
outputs within bf16 rounding) and the fp32 reference, eager and inside a CUDA graph."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
import triton

from deltaserve.ops.gdn import gluon_chain as gc
from deltaserve.ops.gdn import reference as ref
from deltaserve.ops.gdn import triton_chunk as tc

from .helpers import assert_close, compile_for_sm90, cu_seqlens, gen, rel_err

H200_SMEM = 232448  # bytes of shared memory one block may use on sm_90
_BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


@pytest.mark.skipif(not os.path.exists(os.path.join(_BIN, "cuobjdump")), reason="Triton ships no CUDA binutils here")
@pytest.mark.parametrize("bv,ws,tu", [(32, True, False), (64, True, False), (32, False, False), (32, True, True),
                                      (64, True, True)])
def test_chain_compiles_for_sm90_without_spills(bv, ws, tu):
    """The chain compiles for sm_90 without register spills within the H200's shared memory, with U read from the
    prep or (tu, as the op runs it) formed from its factor's limbs and v's rows."""
    res = _compile(bv, int(ws), int(tu))
    assert res["hgmma"] > 0 and res["tma"] > 0, "the products are wgmma and the tiles arrive by TMA"
    assert res["spills"] == 0, f"register spills: {res['spills']} local stores"
    assert not res["serialized"], "ptxas serialises the wgmma (advisory C7512)"
    assert res["smem"] <= H200_SMEM, f"{res['smem']} bytes of shared memory"
    if ws:
        assert res["warps"] == 12 and res["setmaxnreg"] > 0, "two consumer warpgroups + the loader warp"


def _compile(*args) -> dict:
    return compile_for_sm90("_gluon_compile.py", *args)


@pytest.mark.skipif(not os.path.exists(os.path.join(_BIN, "cuobjdump")), reason="Triton ships no CUDA binutils here")
@pytest.mark.parametrize("bv,ws,tu,kr,tiles", [(32, 1, 0, 0, 2), (64, 1, 1, 1, 1), (32, 0, 0, 0, 2)])
def test_chain_o_tma_compiles_for_sm90_without_spills(bv, ws, tu, kr, tiles):
    """o_tma (as the op runs it): the outputs leave by TMA stores (UTMASTG) from `output_tiles` shared-memory tiles per
    consumer (two at bv 32; one at bv 64 with the chain inputs, whose ring leaves room for one), without spills,
    within the H200's shared memory, which `smem_bytes` predicts to within the compiler's padding."""
    res = _compile(bv, ws, tu, kr, 1)
    assert res["o_tiles"] == tiles and res["tma_stores"] > 0, res
    assert res["spills"] == 0, f"register spills: {res['spills']} local stores"
    assert not res["serialized"], "ptxas serialises the wgmma (advisory C7512)"
    assert res["smem"] <= H200_SMEM, f"{res['smem']} bytes of shared memory"
    assert 0 <= res["smem"] - res["est_smem"] <= gc.SMEM_SLACK, res


def test_output_tiles_fit_the_shared_memory():
    """Two output tiles per consumer where they fit, one where only one does, none (o_tma refused) where the ring
    leaves no room (3 stages at bv 64)."""
    assert gc.output_tiles(32, True, 2, False, 32) == 2
    assert gc.output_tiles(64, True, 2, True, 32) == 1
    assert gc.output_tiles(64, True, 3, True, 32) == 0
    for args in ((32, True, 2, False, 32), (64, True, 2, True, 32), (64, False, 2, False, 32)):
        t = gc.output_tiles(*args)
        assert gc.smem_bytes(*args, t) + gc.SMEM_SLACK <= gc.SMEM_LIMIT


def test_gluon_chain_head_counts():
    """The value-head counts the Gluon chain takes: Lb's fp32 rows 16-byte aligned and the e^{G_last} box of a ring
    stage exactly 128 bytes (TMA's shared-memory alignment; the 64-byte box at 16 heads faulted on the H200)."""
    assert [h for h in range(1, 80) if gc.heads_supported(h)] == [4, 8, 16] + list(range(32, 80, 4))
    assert gc.lb_box(16) == [2, 16] and gc.lb_box(48) == [1, 32] and gc.lb_box(4) == [8, 4]
    assert all(r * c * 4 == 128 for r, c in map(gc.lb_box, (4, 8, 16, 32, 48, 64)))


def test_supported_is_false_off_hopper(monkeypatch):
    assert not gc.supported(torch.device("cpu"))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    for cap, want in (((9, 0), True), ((8, 0), False), ((10, 0), False), ((12, 0), False)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, cap=cap: cap)
        assert gc.supported(torch.device("cuda", 0)) is want, cap  # wgmma / setmaxnreg are sm_90(a) only
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not gc.supported(torch.device("cuda", 0)), "the interpreter cannot run Gluon"


# ---- GPU --------------------------------------------------------------------------------------------------

def _mixed():
    """Real shape (16 key heads, 32 value heads, 128 x 128), lengths around the chunk size with an empty
    sequence, slots out of order, a padded row (slot -1), some sequences without an initial state."""
    from .test_gpu import HK, HV, D, _inputs

    lengths = [1, 63, 64, 0, 65, 1000, 129]
    q, k, v, g, beta = _inputs(lengths, HK, HV, seed=31)
    pool = torch.randn(len(lengths) + 2, HV, D, D, generator=gen(4)).mul(0.1).cuda()
    kw = dict(cu_seqlens=cu_seqlens(lengths, "cuda"),
              state_indices=torch.tensor([4, 0, -1, 7, 6, 2, 1], dtype=torch.int32, device="cuda"),
              has_initial_state=torch.tensor([1, 0, 1, 1, 1, 0, 1], dtype=torch.bool, device="cuda"))
    return lengths, q, k, v, g, beta, pool, kw


def _prep(q, k, v, g, beta, kw, N):
    from .test_gpu import D

    cfg = tc.ChunkConfig(prep="wide", layout="chunk")
    return cfg, tc.launch_prep(q, k, v, g, beta, False, None, None, D ** -0.5, kw["cu_seqlens"], N, True, cfg)


@pytest.mark.gpu
@pytest.mark.parametrize("bv,ws", [(32, True), (64, True), (32, False), (64, False)])
def test_gluon_chain_matches_triton_chain_gpu(bv, ws):
    from .test_gpu import TOL_BF16, D, _report

    lengths, q, k, v, g, beta, pool, kw = _mixed()
    cfg, bufs = _prep(q, k, v, g, beta, kw, len(lengths))
    has_init = kw["has_initial_state"].view(torch.uint8)
    o_t = torch.full(v.shape, 7.0, dtype=v.dtype, device="cuda")
    o_g = torch.full(v.shape, 7.0, dtype=v.dtype, device="cuda")
    p_t, p_g, p_r = pool.clone(), pool.clone(), pool.clone()
    tc.launch_chain(q, k, v, o_t, bufs, kw["cu_seqlens"], p_t, kw["state_indices"], kw["has_initial_state"], cfg)
    gc.launch_chain(q, o_g, bufs, kw["cu_seqlens"], p_g, kw["state_indices"], has_init, bv, ws=ws)
    o_r = ref.chunk_gated_delta_rule(q, k, v, g, beta, scale=D ** -0.5, ssm_state=p_r, **kw)
    torch.cuda.synchronize()
    _report(test="gluon_chain_vs_triton", config=f"bv{bv}{'-ws' if ws else ''}", out_rel=rel_err(o_g, o_t),
            state_rel=rel_err(p_g, p_t), identical_state=bool(torch.equal(p_g, p_t)), out_vs_ref=rel_err(o_g, o_r),
            state_vs_ref=rel_err(p_g, p_r))
    assert_close(p_g, p_t, 1e-6, "state vs the Triton chain (the same products)")
    assert_close(o_g, o_t, 1e-2, "output vs the Triton chain")
    assert_close(o_g, o_r, TOL_BF16, "output vs reference")
    assert_close(p_g, p_r, TOL_BF16, "state vs reference")
    cu = kw["cu_seqlens"].tolist()
    assert (o_g[cu[2]:cu[3]] == 0).all(), "the padded sequence's outputs are zeros"
    assert torch.equal(p_g[[5, 7, 8]], pool[[5, 7, 8]]), "the slots of the empty sequence and unused ones untouched"


@pytest.mark.gpu
def test_gluon_chain_graph_equals_eager_gpu():
    lengths, q, k, v, g, beta, pool, kw = _mixed()
    cfg, bufs = _prep(q, k, v, g, beta, kw, len(lengths))
    has_init = kw["has_initial_state"].view(torch.uint8)
    o_e, o_g = torch.zeros_like(v), torch.zeros_like(v)
    p_e, p_g = pool.clone(), pool.clone()
    gc.launch_chain(q, o_e, bufs, kw["cu_seqlens"], p_e, kw["state_indices"], has_init, 32, ws=True)
    p_w = pool.clone()
    gc.launch_chain(q, o_g, bufs, kw["cu_seqlens"], p_w, kw["state_indices"], has_init, 32, ws=True)  # warm
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gc.launch_chain(q, o_g, bufs, kw["cu_seqlens"], p_g, kw["state_indices"], has_init, 32, ws=True)
    p_g.copy_(pool)
    o_g.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(o_g, o_e) and torch.equal(p_g, p_e)


def test_default_config_picks_the_gluon_chain_only_where_it_runs():
    on = tc.default_chunk_config(1, 32, 128, torch.bfloat16, k=128, tokens=32768, gluon=True)
    assert (on.prep, on.layout, on.chain, on.bv) == ("wide", "chunk", "gluon", 32)
    # one CTA per (32-column slice, sequence, value head): past one wave of 132 SMs the transposed chain on 64
    assert [tc.default_chunk_config(n, 32, 128, torch.bfloat16, k=128, gluon=True).bv for n in (1, 2)] == [32, 64]
    assert [tc.default_chunk_config(n, 16, 128, torch.bfloat16, k=128, gluon=True).bv for n in (2, 3)] == [32, 64]
    assert tc.default_chunk_config(2, 32, 128, torch.bfloat16, k=128, gluon=True, sms=264).bv == 32
    assert tc.default_chunk_config(2, 32, 128, torch.bfloat16, k=128, gluon=True).chain == "gluon_t"
    off = tc.default_chunk_config(1, 32, 128, torch.bfloat16, k=128, tokens=32768)
    assert off.chain == "triton" and off.layout == "chunk"
    assert tc.default_chunk_config(1, 32, 128, torch.float32, k=128, gluon=True).chain == "triton"  # token layout
    assert tc.default_chunk_config(1, 4, 32, torch.bfloat16, k=16, gluon=True).chain == "triton"


@pytest.mark.parametrize("chain,match", [("gluon", "compute capability 9.0"), ("cuda", "not one of")])
def test_unsupported_chain_is_refused(chain, match, device):
    from .test_gdn_chunk import _batch, _run

    d = _batch([5, 70], 2, torch.bfloat16, device, seed=3)
    cfg = dataclasses.replace(tc.default_chunk_config(2, 2, 32, torch.bfloat16, k=16), chain=chain)
    with pytest.raises(ValueError, match=match):
        _run(tc.chunk_gated_delta_rule, d, d["pool"].clone(), config=cfg)



def _mixed_o():
    """_mixed's kind of batch for ChunkConfig.o_tma: sequences of 1, 63 (partial last chunks: pointer stores), 64
    and 128 (whole last chunks: TMA), 65, 1000, 129 (whole chunks then a partial one), an empty one, padded rows
    (slot -1) on a one-chunk and a two-chunk sequence (their zero outputs go by TMA too)."""
    from .test_gpu import HK, HV, D, _inputs

    lengths = [1, 63, 64, 0, 65, 1000, 128, 129, 64]
    q, k, v, g, beta = _inputs(lengths, HK, HV, seed=37)
    pool = torch.randn(len(lengths) + 2, HV, D, D, generator=gen(5)).mul(0.1).cuda()
    kw = dict(cu_seqlens=cu_seqlens(lengths, "cuda"),
              state_indices=torch.tensor([4, 0, -1, 7, 6, 2, -1, 1, 3], dtype=torch.int32, device="cuda"),
              has_initial_state=torch.tensor([1, 0, 1, 1, 1, 0, 1, 1, 0], dtype=torch.bool, device="cuda"))
    return lengths, q, k, v, g, beta, pool, kw


@pytest.mark.gpu
@pytest.mark.parametrize("bv,ws,inputs", [(32, True, False), (64, True, True), (64, True, False), (32, True, True),
                                          (32, False, False)])
def test_o_tma_equals_pointer_stores_gpu(bv, ws, inputs):
    """The chain's TMA output stores (launch_chain o_tma) change only how the outputs are stored: outputs and
    states bit for bit those of the pointer stores, on a real-shape batch with partial and whole last chunks and
    padded rows (zeros), with and without the inputs a Gluon chain reads itself (U's factor and v, k's rows)."""
    from .test_gpu import D, _report

    lengths, q, k, v, g, beta, pool, kw = _mixed_o()
    N = len(lengths)
    cfg = tc.ChunkConfig(prep="wide", layout="chunk", chain="gluon" if inputs else "triton")
    bufs = tc.launch_prep(q, k, v, g, beta, False, None, None, D ** -0.5, kw["cu_seqlens"], N, True, cfg)
    assert ("v" in bufs) == inputs and ("k" in bufs) == inputs
    has_init = kw["has_initial_state"].view(torch.uint8)
    outs, states = [], []
    for o_tma in (False, True):
        o = torch.full(v.shape, 7.0, dtype=v.dtype, device="cuda")
        p = pool.clone()
        gc.launch_chain(q, o, bufs, kw["cu_seqlens"], p, kw["state_indices"], has_init, bv, ws=ws, o_tma=o_tma)
        outs.append(o)
        states.append(p)
    torch.cuda.synchronize()
    _report(test="o_tma_vs_pointer_stores", config=f"bv{bv}{'-ws' if ws else ''}{'-inputs' if inputs else ''}",
            identical_out=bool(torch.equal(outs[0], outs[1])), identical_state=bool(torch.equal(*states)),
            out_max_abs=(outs[0].float() - outs[1].float()).abs().max().item())
    assert torch.equal(outs[1], outs[0]), "o_tma outputs differ from the pointer stores'"
    assert torch.equal(states[1], states[0])
    assert not (outs[1] == 7.0).all(dim=(1, 2)).any(), "every row written"
    cu = kw["cu_seqlens"].tolist()
    for i in (2, 6):  # the padded sequences
        assert (outs[1][cu[i]:cu[i + 1]] == 0).all(), f"padded sequence {i}: zeros"
