"""The Gluon chain (deltaserve/ops/gdn/gluon_chain.py), the chunked prefill's state kernel on Hopper.

Gluon kernels do not run under the Triton interpreter, so on a CPU machine they are compiled for sm_90 (the
H200's target) and their resources checked: no register spills, shared memory within the device's. The
`gpu` tests run the op with it against the op with the Triton TMA chain (the same products: states within
1e-5, outputs within bf16 rounding) and the fp32 reference, eager and inside a CUDA graph."""

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
@pytest.mark.parametrize("kr", [0, 1])
def test_chain_compiles_for_sm90_without_spills(kr):
    """The chain as the op launches it (32 columns over two consumer warpgroups and a producer warp, U formed from
    its factor's limbs and v's rows, whole chunks' outputs by TMA stores from `output_tiles` shared-memory tiles;
    kr: whole chunks' K rows from k) compiles for sm_90 without register spills or serialised wgmma, within the
    H200's shared memory, which `smem_bytes` predicts to within the compiler's padding."""
    res = compile_for_sm90("_gluon_compile.py", 32, kr)
    assert res["hgmma"] > 0 and res["tma"] > 0, "the products are wgmma and the tiles arrive by TMA"
    assert res["o_tiles"] == 2 and res["tma_stores"] > 0, res
    assert res["spills"] == 0, f"register spills: {res['spills']} local stores"
    assert not res["serialized"], "ptxas serialises the wgmma (advisory C7512)"
    assert res["smem"] <= H200_SMEM, f"{res['smem']} bytes of shared memory"
    assert 0 <= res["smem"] - res["est_smem"] <= gc.SMEM_SLACK, res
    assert res["warps"] == 12 and res["setmaxnreg"] > 0, "two consumer warpgroups + the loader warp"


def test_output_tiles_fit_the_shared_memory():
    """Two output tiles per consumer where they fit (the two-stage ring at 32 columns), none where the ring leaves
    no room (3 stages)."""
    assert gc.output_tiles(32) == 2
    assert gc.smem_bytes(32, 2) + gc.SMEM_SLACK <= gc.SMEM_LIMIT
    assert gc.output_tiles(32, stages=3) == 0


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
    """The prep's buffers for a Gluon chain (U's factor limbs, v's rows, k's rows)."""
    from .test_gpu import D

    cfg = tc.ChunkConfig(prep="wide", layout="chunk", chain="gluon")
    return tc.launch_prep(q, k, v, g, beta, False, None, None, D ** -0.5, kw["cu_seqlens"], N, True, cfg)


@pytest.mark.gpu
def test_gluon_chain_matches_triton_chain_gpu():
    """The op with the Gluon chain (and prep) against the Triton chain behind the Triton prep, on a real-shape batch
    with an empty sequence, a padded row and slots out of order: the same products (U formed in the chain instead
    of the prep: states within 1e-5), outputs within bf16 rounding, both against the fp32 reference; the padded
    sequence's outputs zeros, the slots of the empty sequence and unused ones untouched."""
    from .test_gpu import TOL_BF16, D, _report

    if not gc.supported(torch.device("cuda")):
        pytest.skip("the Gluon chain needs compute capability 9.0")
    lengths, q, k, v, g, beta, pool, kw = _mixed()
    kw = dict(kw, scale=D ** -0.5)
    runs = {}
    for chain in ("gluon", "triton"):
        p = pool.clone()
        cfg = tc.ChunkConfig(prep="wide", layout="chunk", chain=chain)
        runs[chain] = (tc.chunk_gated_delta_rule(q, k, v, g, beta, ssm_state=p, config=cfg, **kw), p)
    p_r = pool.clone()
    o_r = ref.chunk_gated_delta_rule(q, k, v, g, beta, ssm_state=p_r, **kw)
    (o_g, p_g), (o_t, p_t) = runs["gluon"], runs["triton"]
    torch.cuda.synchronize()
    _report(test="gluon_chain_vs_triton", out_rel=rel_err(o_g, o_t), state_rel=rel_err(p_g, p_t),
            identical_state=bool(torch.equal(p_g, p_t)), out_vs_ref=rel_err(o_g, o_r), state_vs_ref=rel_err(p_g, p_r))
    assert_close(p_g, p_t, 1e-5, "state vs the Triton chain (the same products)")
    assert_close(o_g, o_t, 1e-2, "output vs the Triton chain")
    assert_close(o_g, o_r, TOL_BF16, "output vs reference")
    assert_close(p_g, p_r, TOL_BF16, "state vs reference")
    cu = kw["cu_seqlens"].tolist()
    assert (o_g[cu[2]:cu[3]] == 0).all(), "the padded sequence's outputs are zeros"
    assert torch.equal(p_g[[5, 7, 8]], pool[[5, 7, 8]]), "the slots of the empty sequence and unused ones untouched"


@pytest.mark.gpu
def test_gluon_chain_graph_equals_eager_gpu():
    if not gc.supported(torch.device("cuda")):
        pytest.skip("the Gluon chain needs compute capability 9.0")
    lengths, q, k, v, g, beta, pool, kw = _mixed()
    bufs = _prep(q, k, v, g, beta, kw, len(lengths))
    has_init = kw["has_initial_state"].view(torch.uint8)
    o_e, o_g = torch.zeros_like(v), torch.zeros_like(v)
    p_e, p_g = pool.clone(), pool.clone()
    gc.launch_chain(q, o_e, bufs, kw["cu_seqlens"], p_e, kw["state_indices"], has_init, 32)
    p_w = pool.clone()
    gc.launch_chain(q, o_g, bufs, kw["cu_seqlens"], p_w, kw["state_indices"], has_init, 32)  # warm
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gc.launch_chain(q, o_g, bufs, kw["cu_seqlens"], p_g, kw["state_indices"], has_init, 32)
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
