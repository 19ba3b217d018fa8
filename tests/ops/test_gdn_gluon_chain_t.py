"""The transposed Gluon chain (deltaserve/ops/gdn/gluon_chain_t.py): the state held as S^T in the consumers'
registers. On a CPU machine it is compiled for sm_90 and its resources checked; the `gpu` tests run it against the
untransposed Gluon chain on the same prep buffers (the same products in another accumulation order: states within
fp32 rounding, outputs within bf16 rounding) and the fp32 reference, eager and inside a CUDA graph, and check where
the default configuration takes it."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
import triton

from deltaserve.ops.gdn import dispatch
from deltaserve.ops.gdn import gluon_chain as gc
from deltaserve.ops.gdn import gluon_chain_t as gt
from deltaserve.ops.gdn import reference as ref
from deltaserve.ops.gdn import triton_chunk as tc

from .helpers import assert_close, compile_for_sm90, rel_err

H200_SMEM = 232448
_BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


@pytest.mark.skipif(not os.path.exists(os.path.join(_BIN, "cuobjdump")), reason="Triton ships no CUDA binutils here")
@pytest.mark.parametrize("consumers", [1, 2])
def test_chain_t_compiles_for_sm90(consumers):
    """44 wgmma per consumer and chunk (8 of them 64 x 128: the state update), pipelined (ptxas serialised every one
    of them while V_new^T had an accumulator of its own, 1.06-1.38x slower), tiles by TMA, outputs by TMA stores,
    setmaxnreg for the consumers, within the H200's shared memory; at most a few scalar spills (the second consumer's
    loop reloads a few scalars; the products and the state stay in registers)."""
    res = compile_for_sm90("_gluon_chain_t_compile.py", consumers)
    assert res["hgmma"] == 44 * consumers and res["hgmma_n128"] == 8 * consumers, res
    assert not res["serialized"], "ptxas serialises the wgmma (advisory C7512)"
    assert res["tma"] > 0 and res["tma_stores"] == consumers and res["setmaxnreg"] > 0, res
    assert res["spills"] <= 4 * consumers, f"register spills: {res['spills']} local stores"
    assert res["smem"] <= H200_SMEM, f"{res['smem']} bytes of shared memory"


def test_default_config_picks_the_chain_by_its_estimate():
    """With the caller's longest length (max_seqlen) the Gluon chain and its width come from chain_step_estimate:
    the transposed chain with two consumers (128 columns) where sequences of about the longest length fill the SMs,
    with one (64 columns) where they fill them only at that width, the untransposed chain at 32 columns where one
    long sequence is the critical path. Head dim 128 and the Gluon chain only; without max_seqlen 64 columns (the
    one-consumer transposed chain) past one wave of 32-column programs."""
    def pick(lengths, hv=32, **kw):
        cfg = tc.default_chunk_config(len(lengths), hv, 128, torch.bfloat16, k=128, gluon=True, tokens=sum(lengths),
                                      max_seqlen=max(lengths), **kw)
        return cfg.chain, cfg.bv

    assert [pick([1000] * n) for n in (1, 2, 3, 4, 32)] == [
        ("gluon", 32), ("gluon_t", 64), ("gluon_t", 128), ("gluon_t", 128), ("gluon_t", 128)]
    assert pick([32768]) == ("gluon", 32) and pick([16384] * 2) == ("gluon_t", 64)
    assert pick([8192] * 4) == ("gluon_t", 128) and pick([1024] * 8) == ("gluon_t", 128)
    assert pick([8192, 128, 128, 128]) == ("gluon", 32) and pick([128, 128, 128, 8192]) == ("gluon", 32)
    assert pick([8192, 8192, 1024, 1024]) == ("gluon_t", 64) and pick([8192, 4096]) == ("gluon_t", 64)
    cfg = tc.default_chunk_config(4, 32, 128, torch.bfloat16, k=128, gluon=True, tokens=4000, max_seqlen=1000)
    assert cfg.gluon and (cfg.prep, cfg.layout) == ("wide", "chunk")
    # 16 value heads: a (sequence, value head) program fills fewer SMs; 64: a 32-column slice of one sequence fills two
    # waves
    assert pick([1000] * 4, hv=16) == ("gluon_t", 64) and pick([1000] * 5, hv=16) == ("gluon_t", 128)
    assert pick([32768], hv=64) == ("gluon_t", 64) and pick([16384], hv=16) == ("gluon", 32)
    assert pick([1000] * 3, sms=264) == ("gluon_t", 64)  # a bigger device: 192 64-column programs in one wave
    assert tc.default_chunk_config(4, 32, 128, torch.bfloat16, k=128).chain == "triton"  # no Gluon here
    # unknown lengths: 64 columns (the one-consumer transposed chain) past one wave of 32-column programs
    unknown = tc.default_chunk_config(4, 32, 128, torch.bfloat16, k=128, tokens=4000, gluon=True)
    assert (unknown.chain, unknown.bv) == ("gluon_t", 64)
    one = tc.default_chunk_config(1, 32, 128, torch.bfloat16, k=128, tokens=4000, gluon=True)
    assert (one.chain, one.bv) == ("gluon", 32)
    assert tc.default_chunk_config(4, 32, 64, torch.bfloat16, k=64, gluon=True, tokens=4000,
                                   max_seqlen=1000).chain != "gluon_t"


def test_chain_step_estimate_counts_waves_and_the_critical_path():
    """The estimate's two bounds: the longest sequences' programs in waves of one CTA per SM, and all programs' chunk
    steps spread over the SMs."""
    est = dispatch.chain_step_estimate
    step32, step64 = dispatch.CHAIN_STEP_US[("gluon", 32)], dispatch.CHAIN_STEP_US[("gluon_t", 64)]
    # one 8192-token sequence at 32 value heads: 128 programs of 128 chunks, one wave
    assert est("gluon", 32, 32, 128, 8192, 8192, 132) == pytest.approx(128 * step32)
    # two of them: 256 programs, two waves of 128 chunk steps
    assert est("gluon", 32, 32, 128, 16384, 8192, 132) == pytest.approx(256 * step32)
    # two of them at 64 columns: 128 programs, one wave
    assert est("gluon_t", 64, 32, 128, 16384, 8192, 132) == pytest.approx(128 * step64)
    # two of them and 4096 tokens of short sequences: the spread bound, (2 x 128 + 64) chunks x 64 programs over 132 SMs
    assert est("gluon_t", 64, 32, 128, 2 * 8192 + 4096, 8192, 132) == pytest.approx(
        step64 * (2 * 128 + 64) * 64 / 132)


def test_transposed_chain_refusal_names_what_is_missing(device):
    """A configuration naming the transposed chain without what it needs is refused, the message naming every
    requirement and what the configuration has (on a CPU machine the device is one of them)."""
    from .test_gdn_chunk import _batch, _run

    d = _batch([5, 70], 2, torch.bfloat16, device, seed=3)
    cfg = dataclasses.replace(tc.default_chunk_config(2, 2, 32, torch.bfloat16, k=16), chain="gluon_t")
    with pytest.raises(ValueError, match="chain='gluon_t' needs") as err:
        _run(tc.chunk_gated_delta_rule, d, d["pool"].clone(), config=cfg)
    assert "layout='token'" in str(err.value) and "bv=32" in str(err.value)


@pytest.mark.parametrize("bad,match", [(70, "less than the longest"), (-1, "non-negative int"),
                                       (2.5, "non-negative int")])
def test_max_seqlen_hint_is_checked(bad, match, device):
    """max_seqlen is a hint for the GPU op's kernel choice: both ops refuse a malformed one; the reference (which
    reads cu_seqlens on the host anyway) also one shorter than the longest sequence. A right one changes nothing."""
    from .test_gdn_chunk import _batch, _run

    d = _batch([5, 71], 2, torch.float32, device, seed=3)
    if not isinstance(bad, int) or bad < 0:
        with pytest.raises(ValueError, match=match):
            _run(tc.chunk_gated_delta_rule, d, d["pool"].clone(), max_seqlen=bad)
    with pytest.raises(ValueError, match=match):
        _run(ref.chunk_gated_delta_rule, d, d["pool"].clone(), max_seqlen=bad)
    p1, p2 = d["pool"].clone(), d["pool"].clone()
    assert torch.equal(_run(ref.chunk_gated_delta_rule, d, p1, max_seqlen=71),
                       _run(ref.chunk_gated_delta_rule, d, p2)) and torch.equal(p1, p2)


def test_gdn_layer_passes_the_longest_prefill_to_the_op(tiny_model):
    """The GDN layer hands ForwardBatch.max_prefill_len (the runner's longest prefill chunk) to the chunked prefill as
    max_seqlen: without it the op cannot take the transposed chain. A mixed batch (prefills of 5 and 3 tokens, one
    decode): the prefill op sees 5."""
    from deltaserve.models.loader import load_model
    from deltaserve.ops import select_kernels
    from tests.conftest import TinySpec

    from .test_rms_norm_linear import _batch

    k = select_kernels("cpu")
    seen = []

    def chunk(*args, **kw):
        seen.append(kw.get("max_seqlen"))
        return ref.chunk_gated_delta_rule(*args, **kw)

    path = tiny_model(TinySpec(family="qwen3_5", layout="text", ratio=2, seed=3))
    kernels = dataclasses.replace(k, chunk_gated_delta_rule=chunk)
    model = load_model(path, device="cpu", dtype=torch.float32, kernels=kernels, show_progress=False)
    gdn = model.layers[0].linear_attn
    batch = dataclasses.replace(_batch([([1, 2, 3, 4, 5], 0, 0), ([6, 7, 8], 0, 1), ([9], 4, 2)], "cpu"),
                                max_prefill_len=5)
    x = torch.randn(9, gdn.in_proj.in_features, generator=torch.Generator().manual_seed(0))
    ssm = torch.zeros(3, gdn.nv, gdn.dk, gdn.dv)
    conv = torch.zeros(3, gdn.conv_weight.shape[1] - 1, gdn.conv_dim)
    gdn(x, batch, ssm, conv)
    assert seen == [5]


# ---- GPU --------------------------------------------------------------------------------------------------

def _prep_u(q, k, v, g, beta, kw, N):
    """The prep's chunk-layout buffers for a Gluon chain: U's factor limbs and v's rows, k's rows."""
    from .test_gpu import D

    cfg = tc.ChunkConfig(bv=64, prep="wide", layout="chunk", chain="gluon_t")
    return tc.launch_prep(q, k, v, g, beta, False, None, None, D ** -0.5, kw["cu_seqlens"], N, True, cfg)


@pytest.mark.gpu
@pytest.mark.parametrize("consumers", [1, 2])
def test_chain_t_matches_the_gluon_chain_gpu(consumers):
    """The mixed real-shape batch (lengths 1..1000 with partial chunks, an empty sequence, a padded row, slots out of
    order, some without initial state): the transposed chain against the untransposed one on the same buffers and
    against the fp32 reference; the padded row's outputs zeros, unused slots untouched."""
    from .test_gdn_gluon_chain import _mixed
    from .test_gpu import TOL_BF16, D, _report

    if not gc.supported(torch.device("cuda")):
        pytest.skip("the Gluon chains need compute capability 9.0")
    lengths, q, k, v, g, beta, pool, kw = _mixed()
    bufs = _prep_u(q, k, v, g, beta, kw, len(lengths))
    has_init = kw["has_initial_state"].view(torch.uint8)
    o_u, o_t = (torch.full(v.shape, 7.0, dtype=v.dtype, device="cuda") for _ in range(2))
    p_u, p_t, p_r = pool.clone(), pool.clone(), pool.clone()
    gc.launch_chain(q, o_u, bufs, kw["cu_seqlens"], p_u, kw["state_indices"], has_init, 32)
    gt.launch_chain_t(q, o_t, bufs, kw["cu_seqlens"], p_t, kw["state_indices"], has_init, consumers=consumers)
    o_r = ref.chunk_gated_delta_rule(q, k, v, g, beta, scale=D ** -0.5, ssm_state=p_r, **kw)
    torch.cuda.synchronize()
    _report(test="gluon_chain_t", consumers=consumers, out_rel=rel_err(o_t, o_u), state_rel=rel_err(p_t, p_u),
            out_vs_ref=rel_err(o_t, o_r), state_vs_ref=rel_err(p_t, p_r))
    assert_close(p_t, p_u, 1e-5, "state vs the untransposed chain (the same products)")
    assert_close(o_t, o_u, 1e-2, "output vs the untransposed chain")
    assert_close(o_t, o_r, TOL_BF16, "output vs reference")
    assert_close(p_t, p_r, TOL_BF16, "state vs reference")
    cu = kw["cu_seqlens"].tolist()
    assert (o_t[cu[2]:cu[3]] == 0).all(), "the padded sequence's outputs are zeros"
    assert torch.equal(p_t[[5, 7, 8]], pool[[5, 7, 8]]), "the slots of the empty sequence and unused ones untouched"


@pytest.mark.gpu
def test_chain_t_graph_equals_eager_gpu():
    from .test_gdn_gluon_chain import _mixed

    if not gc.supported(torch.device("cuda")):
        pytest.skip("the Gluon chains need compute capability 9.0")
    lengths, q, k, v, g, beta, pool, kw = _mixed()
    bufs = _prep_u(q, k, v, g, beta, kw, len(lengths))
    has_init = kw["has_initial_state"].view(torch.uint8)
    cu, idx = kw["cu_seqlens"], kw["state_indices"]
    o_e, o_g = torch.zeros_like(v), torch.zeros_like(v)
    p_e, p_g, p_w = pool.clone(), pool.clone(), pool.clone()
    gt.launch_chain_t(q, o_e, bufs, cu, p_e, idx, has_init)
    gt.launch_chain_t(q, o_g, bufs, cu, p_w, idx, has_init)  # warm
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gt.launch_chain_t(q, o_g, bufs, cu, p_g, idx, has_init)
    p_g.copy_(pool)
    o_g.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(o_g, o_e) and torch.equal(p_g, p_e)


@pytest.mark.gpu
def test_default_op_takes_the_transposed_chain_gpu():
    """The op on a full batch (4 x 1000 tokens at 32 value heads) runs the transposed chain by default and matches the
    reference and the op forced onto the untransposed chain."""
    from .test_gpu import HK, HV, TOL_BF16, D, _inputs, _report

    if not gc.supported(torch.device("cuda")):
        pytest.skip("the Gluon chains need compute capability 9.0")
    lengths = [1000, 1000, 1000, 999]
    q, k, v, g, beta = _inputs(lengths, HK, HV, seed=61)
    pool = torch.randn(4, HV, D, D).mul(0.1).cuda()
    kw = dict(scale=D ** -0.5, cu_seqlens=torch.tensor([0, 1000, 2000, 3000, 3999], dtype=torch.int32, device="cuda"),
              state_indices=torch.tensor([2, 0, 3, 1], dtype=torch.int32, device="cuda"),
              has_initial_state=torch.tensor([1, 1, 0, 1], dtype=torch.bool, device="cuda"))
    cfg = tc.default_chunk_config(4, HV, D, torch.bfloat16, k=D, tokens=3999, gluon=True, max_seqlen=1000,
                                  sms=torch.cuda.get_device_properties(0).multi_processor_count)
    assert cfg.chain == "gluon_t"
    p_d, p_u, p_r = pool.clone(), pool.clone(), pool.clone()
    o_d = tc.chunk_gated_delta_rule(q, k, v, g, beta, ssm_state=p_d, max_seqlen=1000, **kw)
    o_u = tc.chunk_gated_delta_rule(q, k, v, g, beta, ssm_state=p_u, config=dataclasses.replace(cfg, chain="gluon",
                                                                                                 bv=32), **kw)
    o_r = ref.chunk_gated_delta_rule(q, k, v, g, beta, ssm_state=p_r, **kw)
    _report(test="default_op_chain_t", out_rel=rel_err(o_d, o_u), state_rel=rel_err(p_d, p_u),
            out_vs_ref=rel_err(o_d, o_r), state_vs_ref=rel_err(p_d, p_r))
    assert_close(p_d, p_u, 1e-5, "state vs the untransposed chain")
    assert_close(o_d, o_r, TOL_BF16, "output vs reference")
    assert_close(p_d, p_r, TOL_BF16, "state vs reference")


@pytest.mark.gpu
def test_chain_t_8k_not_less_accurate_than_fla():
    """The transposed chain with one and two consumers (forced: one sequence takes the untransposed chain) and the
    default on the 8k sequence of slow decay: output and final-state errors against the fp32 token recurrence within
    FLA's on the same inputs."""
    from .test_gpu import HV, D, check_8k_not_less_accurate_than_fla

    if not gc.supported(torch.device("cuda")):
        pytest.skip("the Gluon chains need compute capability 9.0")
    base = tc.default_chunk_config(1, HV, D, torch.bfloat16, k=D, tokens=8192, gluon=True, max_seqlen=8192)
    configs = {"default": None}
    configs.update({f"gluon_t bv{bv}": dataclasses.replace(base, chain="gluon_t", bv=bv) for bv in gt.BVS})
    check_8k_not_less_accurate_than_fla(configs, "chain_t_8k")
