"""The Gluon prep (deltaserve/ops/gdn/gluon_prep.py, behind a Gluon chain) against the Triton wide prep whose bits
it reproduces (the one that runs where `gluon_prep.covers` says no): every buffer bit for bit on the H200 (whole
chunks by TMA, partial last chunks and padding programs by pointer loads, the gates in the kernel, the K copy of
partial chunks only), the whole op bit for bit with either prep (eager and in a CUDA graph), and on CPU: its sm_90
compile and the default choice."""

from __future__ import annotations

import os

import pytest
import torch
import triton

from deltaserve.ops.gdn import triton_chunk as tc
from deltaserve.ops.gdn.triton_prep import tma_rows

from .helpers import compile_for_sm90, cu_seqlens, gen

H200_SMEM = 232448
_BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
BUFS = ("Wb", "Ub", "Pb", "Kb", "Cb", "Lb")


@pytest.mark.skipif(not os.path.exists(os.path.join(_BIN, "cuobjdump")), reason="Triton ships no CUDA binutils here")
@pytest.mark.parametrize("kr,gates", [(1, 0), (1, 1), (0, 0)])
def test_prep_compiles_for_sm90(kr, gates):
    """One warpgroup at the wide prep's 168-register cap (three programs per SM): k / q by TMA, W / U limbs / P / K
    copy by TMA stores, the products on wgmma, at most a handful of spill stores (A held in registers across the
    inverse), within 65.6 KB of shared memory; kr 0: the K copy of every chunk too."""
    res = compile_for_sm90("_gluon_prep_compile.py", kr, gates)
    assert res["regs"] <= 168 and res["hgmma"] > 0 and res["tma_loads"] == 2 and res["tma_stores"] > 0, res
    assert res["spills"] <= 8, res
    assert not res["serialized"], "ptxas serialises the wgmma (advisory C7512)"
    assert res["smem"] <= 3 * 65552 <= H200_SMEM, res  # three programs per SM


def test_default_config_takes_the_gluon_prep_with_the_gluon_chain():
    on = tc.default_chunk_config(1, 32, 128, torch.bfloat16, k=128, tokens=32768, gluon=True)
    assert on.gluon and on.prep == "wide" and on.layout == "chunk"
    assert tc.default_chunk_config(4, 32, 128, torch.bfloat16, k=128, tokens=32768, gluon=True).gluon
    assert not tc.default_chunk_config(1, 32, 128, torch.bfloat16, k=128, tokens=32768).gluon
    assert not tc.default_chunk_config(1, 32, 128, torch.float32, k=128, gluon=True).gluon


def _triton_prep(monkeypatch, *args):
    """The Triton wide prep's buffers for a Gluon chain (what runs where the Gluon prep does not cover a call)."""
    from deltaserve.ops.gdn import gluon_prep

    with monkeypatch.context() as m:
        m.setattr(gluon_prep, "covers", lambda *a: False)
        return tc.launch_prep(*args)


def _layer_inputs(lengths, gates, seed=0):
    """q / k / v as views of one [T, 2 HK K + HV V] bf16 conv-output row (as the layer passes them), g / beta as
    gdn_gating's fp32 outputs or (gates) the raw a / b of gdn_prefill."""
    from .test_gpu import HK, HV, D

    g0 = gen(seed)
    T = sum(lengths)
    mixed = torch.randn(T, 2 * HK * D + HV * D, generator=g0).to("cuda", torch.bfloat16)
    q, k, v = (x.view(T, -1, D) for x in mixed.split([HK * D, HK * D, HV * D], dim=-1))
    a = torch.randn(T, HV, generator=g0).to("cuda", torch.bfloat16)
    b = torch.randn(T, HV, generator=g0).to("cuda", torch.bfloat16)
    A_log = torch.log(torch.empty(HV).uniform_(1, 16, generator=g0)).cuda()
    dt_bias = (torch.randn(HV, generator=g0) * 0.5).cuda()
    if gates:
        return q, k, v, a, b, A_log, dt_bias
    g = -A_log.exp() * torch.nn.functional.softplus(a.float() + dt_bias)
    return q, k, v, g.contiguous(), torch.sigmoid(b.float()).contiguous(), None, None


def _k_rows_written(lengths, C, hk):
    """Kb's rows the preps write: partial last chunks' and padding's (the chain reads whole chunks' from k)."""
    whole = [L - c * 64 >= 64 for L in lengths for c in range(triton.cdiv(L, 64))]
    whole += [False] * (C - len(whole))
    return torch.tensor([not w for w in whole], device="cuda").repeat_interleave(hk * 64)


@pytest.mark.gpu
@pytest.mark.parametrize("lengths,gates", [
    ([4096], False), ([1024] * 4, False), ([4096], True), ([1000, 3000, 77, 1999], False),
    ([1000, 3000, 77, 1999, 64, 1], True)])
def test_gluon_prep_buffers_equal_triton_prep_gpu(lengths, gates, monkeypatch):
    """Every buffer the chain reads, bit for bit: the whole-chunk (TMA) and partial / padding (pointer) bodies, with
    the gates in the kernel or not, the K copy of the partial chunks."""
    from deltaserve.ops.gdn import gluon_prep

    from .test_gpu import HK, HV, D

    q, k, v, g, beta, A_log, dt_bias = _layer_inputs(lengths, gates)
    N, T = len(lengths), sum(lengths)
    cfg = tc.default_chunk_config(N, HV, D, torch.bfloat16, k=D, tokens=T, gluon=True)
    assert cfg.gluon and gluon_prep.covers(q, k, v, True, tma_rows)
    cu = cu_seqlens(lengths, "cuda")
    args = (q, k, v, g, beta, gates, A_log, dt_bias, D ** -0.5, cu, N, True, cfg)
    ref = _triton_prep(monkeypatch, *args)
    rows = _k_rows_written(lengths, ref["Lb"].shape[0], HK)
    out = tc.launch_prep(*args)
    torch.cuda.synchronize()
    for n in BUFS:
        a, b = (ref[n][rows], out[n][rows]) if n == "Kb" else (ref[n], out[n])
        bits = torch.int16 if a.element_size() == 2 else torch.int32
        same = torch.equal(a.reshape(-1).view(bits), b.reshape(-1).view(bits))
        assert same, f"{n}: max diff {(a.float() - b.float()).abs().max().item()}"


@pytest.mark.gpu
@pytest.mark.parametrize("lengths", [[8192], [1000, 64, 2049, 63, 1024]])
def test_gluon_prep_whole_op_equals_triton_prep_gpu(lengths, monkeypatch):
    """The op (output and final states, from initial states in slots out of order) with the default configuration
    against the same with the Triton prep: bit for bit, eager and replayed in a CUDA graph."""
    from .test_gpu import HV, D

    q, k, v, g, beta, _, _ = _layer_inputs(lengths, False, seed=5)
    N = len(lengths)
    pool = torch.randn(N + 1, HV, D, D, generator=gen(6)).mul(0.1).cuda()
    kw = dict(scale=D ** -0.5, cu_seqlens=cu_seqlens(lengths, "cuda"),
              state_indices=torch.arange(N, dtype=torch.int32, device="cuda").flip(0),
              has_initial_state=torch.ones(N, dtype=torch.bool, device="cuda"))
    base = tc.default_chunk_config(N, HV, D, torch.bfloat16, k=D, tokens=sum(lengths), gluon=True)
    assert base.gluon
    from deltaserve.ops.gdn import gluon_prep

    res = []
    for covers in (gluon_prep.covers, lambda *a: False):
        p = pool.clone()
        with monkeypatch.context() as m:
            m.setattr(gluon_prep, "covers", covers)
            res.append((tc.chunk_gated_delta_rule(q, k, v, g, beta, ssm_state=p, config=base, **kw), p))
    p_g = pool.clone()
    tc.chunk_gated_delta_rule(q, k, v, g, beta, ssm_state=p_g, config=base, **kw)  # warm
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o_g = tc.chunk_gated_delta_rule(q, k, v, g, beta, ssm_state=p_g, config=base, **kw)
    p_g.copy_(pool)
    o_g.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(res[0][0], res[1][0]) and torch.equal(res[0][1], res[1][1])
    assert torch.equal(o_g, res[0][0]) and torch.equal(p_g, res[0][1]), "graph replay"
