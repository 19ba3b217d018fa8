"""The gated output projection (the attention output gate, or the GDN per-head gated RMSNorm, folded into
the GEMV) against its reference (the gate op, then linear): both activations, with and without the norm,
fp32 and bf16, several K steps per program, odd N, strided gate rows; the two-launch path where the
default does not fold; bad inputs; the GDN decode without its norm + this op == gdn_decode + linear; real
shapes and CUDA-graph replay on the GPU."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch
import torch.nn.functional as F

from deltaserve.ops.activation import triton as act_tri
from deltaserve.ops.gdn import reference as gdn_ref
from deltaserve.ops.gdn import triton_recurrent as tr
from deltaserve.ops.gdn.triton_steps import group_counters
from deltaserve.ops.linear import reference as ref
from deltaserve.ops.linear import triton as tri
from deltaserve.ops.norm import reference as norm_ref
from deltaserve.ops.norm import triton as norm_tri

from .helpers import assert_close, gen, randn

# fp32: summation order; bf16: one rounding of y (the gated operand is rounded as the two ops round it,
# but the gate / norm arithmetic may differ from torch's in the last bit of that rounding)
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
C = tri.LinearConfig
CONFIGS = {"n4-k32": C(block_n=4, block_k=32, warps=2), "n1-k64": C(block_n=1, block_k=64, warps=4, stages=1),
           "n2-k16": C(block_n=2, block_k=16, warps=1), "default": None}


def _inputs(N, K, D, dtype, device, seed, *, strided_gate=True):
    g = gen(seed)
    x = randn(1, K, g=g, dtype=dtype, device=device, scale=2.0)
    if strided_gate:  # a column slice of a wider projection output, as the layers pass it
        gate = randn(1, K + 24, g=g, dtype=dtype, device=device, scale=2.0)[:, 8:8 + K]
    else:
        gate = randn(1, K, g=g, dtype=dtype, device=device, scale=2.0)
    nw = None if D is None else (torch.rand(D, generator=g) + 0.5).to(dtype=dtype, device=device)
    w = randn(N, K, g=g, dtype=dtype, device=device, scale=K ** -0.5)
    return x, gate, nw, w


def _want(x, gate, nw, w, eps, activation):
    """The reference's gated operand (rounded to x's dtype), then the product in fp32, rounded once."""
    if nw is None:
        act = torch.sigmoid(gate.float()) if activation == "sigmoid" else F.silu(gate.float())
        h = (x.float() * act).to(x.dtype)
    else:
        D = nw.numel()
        h = norm_ref.rms_norm_gated(x.view(1, -1, D), gate.reshape(1, -1, D), nw, eps,
                                    activation=activation).view(x.shape)
    return F.linear(h.float(), w.float()).to(x.dtype)


@pytest.mark.parametrize("cfg", list(CONFIGS), ids=list(CONFIGS))
@pytest.mark.parametrize("D,activation,dtype", [
    (16, "silu", torch.float32), (16, "sigmoid", torch.bfloat16), (32, "swish", torch.bfloat16),
    (None, "sigmoid", torch.float32), (None, "sigmoid", torch.bfloat16), (None, "silu", torch.float32)])
def test_one_row_matches_reference(cfg, D, activation, dtype, device):
    """One row (the folded kernel): odd N (row-block masks); K = 96 = 6 heads of 16 / 3 of 32 over
    several K steps (the heads of a step normalised in it; K steps of 16 with D = 32: one head a step)."""
    N, K = 45, 96
    x, gate, nw, w = _inputs(N, K, D, dtype, device, seed=N + (D or 0) + len(activation))
    got = tri.gated_linear(x, gate, w, norm_weight=nw, eps=1e-6, activation=activation, config=CONFIGS[cfg])
    assert_close(got, _want(x, gate, nw, w, 1e-6, activation), TOL[dtype], f"{cfg} D={D} {activation} {dtype}")
    assert_close(got, ref.gated_linear(x, gate, w, norm_weight=nw, eps=1e-6, activation=activation),
                 TOL[dtype] if dtype == torch.float32 else 2e-2, "vs the reference op")


def test_no_norm_k_not_a_multiple_of_the_step(device):
    """Without the norm K need not be a multiple of anything (masked last step); leading dims kept."""
    N, K = 7, 93
    x, gate, _, w = _inputs(N, K, None, torch.float32, device, seed=5, strided_gate=False)
    for cfg in (CONFIGS["n4-k32"], None):
        got = tri.gated_linear(x.view(1, 1, K), gate.view(1, 1, K), w, config=cfg)
        assert got.shape == (1, 1, N)
        assert_close(got.view(1, N), _want(x, gate, None, w, 0.0, "sigmoid"), 1e-5, f"K=93 {cfg}")


@pytest.mark.parametrize("D", [None, 16])
def test_two_launches_where_the_default_does_not_fold(D, device):
    """M > 1: exactly the gate op (sigmoid_mul / rms_norm_gated), then `linear`."""
    M, N, K = 3, 20, 64
    g = gen(9)
    x, gate = randn(M, K, g=g, device=device), randn(M, K, g=g, device=device)
    w = randn(N, K, g=g, device=device)
    nw = None if D is None else randn(D, g=g, device=device)
    assert tri.default_gated_config(M, N, K, D) is None
    got = tri.gated_linear(x, gate, w, norm_weight=nw, activation="sigmoid")
    if D is None:
        h = act_tri.sigmoid_mul(x, gate)
    else:
        h = norm_tri.rms_norm_gated(x.view(M, K // D, D), gate.view(M, K // D, D), nw, 1e-6,
                                    activation="sigmoid").view(M, K)
    assert torch.equal(got, tri.linear(h, w))
    assert_close(got, ref.gated_linear(x, gate, w, norm_weight=nw, activation="sigmoid"), 1e-5, "vs reference")


def test_default_rule():
    """The norm is folded at one row only, on row blocks of >= 4 (the plain GEMV's where it has them);
    the gate without norm only where the plain tiles are one-row (there on 4 x 1024, measured faster)."""
    C41 = C(block_n=4, block_k=1024, warps=4, stages=3)
    for K, N, want in ((4096, 2048, C41), (6144, 5120, tri.default_linear_config(1, 5120, 6144)),
                       (2048, 1024, tri.default_linear_config(1, 1024, 2048)), (8192, 45, C(4, 1024, 4, 3))):
        assert tri.default_gated_config(1, N, K, 128) == want, (K, N)
        assert want.block_n >= 4 and want.split_k == 1 and not want.dot
        one_row = tri.default_linear_config(1, N, K).block_n < 4
        assert tri.default_gated_config(1, N, K, None) == (want if one_row else None), (K, N)
        assert all(tri.default_gated_config(M, N, K, 128) is None for M in range(2, tri.GEMV_MAX_M + 2))
    assert tri.default_gated_config(1, 45, 96, 24) is None, "a head size that is not a power of two: two launches"


def test_gate_without_norm_by_default(device):
    """Folded where the plain GEMV has one-row tiles, else sigmoid_mul then `linear`; both the reference's."""
    for N, K in ((6, 64), (45, 8192)):
        x, gate, _, w = _inputs(N, K, None, torch.float32, device, seed=7)
        got = tri.gated_linear(x, gate, w)
        if tri.default_gated_config(1, N, K, None) is None:
            assert torch.equal(got, tri.linear(act_tri.sigmoid_mul(x, gate), w))
        else:
            assert tri.default_linear_config(1, N, K).block_n < 4
        assert_close(got, ref.gated_linear(x, gate, w), 1e-5, f"N={N} K={K}")


def test_head_size_not_a_power_of_two_takes_two_launches(device):
    N, K, D = 5, 48, 24
    x, gate, nw, w = _inputs(N, K, D, torch.float32, device, seed=6, strided_gate=False)
    got = tri.gated_linear(x, gate, w, norm_weight=nw, activation="silu")
    h = norm_tri.rms_norm_gated(x.view(1, 2, D), gate.view(1, 2, D), nw, 1e-6, activation="silu").view(1, K)
    assert torch.equal(got, tri.linear(h, w))
    with pytest.raises(ValueError, match="power-of-two head size"):
        tri.gated_linear(x, gate, w, norm_weight=nw, activation="silu", config=C())


def test_empty(device):
    x, gate, nw, w = _inputs(5, 32, 16, torch.float32, device, seed=1, strided_gate=False)
    assert tri.gated_linear(x[:0], gate[:0], w, norm_weight=nw).shape == (0, 5)


@pytest.mark.parametrize("change, match", [
    (lambda a: {**a, "gate": a["gate"][:, :-1]}, "gate must match x"),
    (lambda a: {**a, "gate": a["gate"].double()}, "gate must match x"),
    (lambda a: {**a, "norm_weight": a["norm_weight"][:-3]}, "norm_weight must be"),
    (lambda a: {**a, "activation": "relu"}, "unsupported gate activation"),
    (lambda a: {**a, "weight": a["weight"][:, :-1]}, r"x must be \[\.\.\., 31\]"),
    (lambda a: {**a, "norm_weight": a["norm_weight"][:8].repeat(1, 2)}, "norm_weight must be"),
    (lambda a: {**a, "config": C(block_n=4, block_k=16, split_k=2)}, "without split K"),
    (lambda a: {**a, "x": a["x"].expand(2, -1), "gate": a["gate"].expand(2, -1), "config": C()}, "one row"),
])
def test_bad_inputs_raise(change, match, device):
    x, gate, nw, w = _inputs(4, 32, 16, torch.float32, device, seed=2, strided_gate=False)
    args = change(dict(x=x, gate=gate, weight=w, norm_weight=nw, eps=1e-6, activation="silu"))
    with pytest.raises(ValueError, match=match):
        tri.gated_linear(**args)


def test_reference_rejects_bad_inputs():
    x, gate, nw, w = _inputs(4, 32, 16, torch.float32, "cpu", seed=3, strided_gate=False)
    with pytest.raises(ValueError, match="unsupported gate activation"):
        ref.gated_linear(x, gate, w, activation="gelu")
    with pytest.raises(ValueError, match="must have one shape"):
        ref.gated_linear(x, gate[:, :-1], w)
    with pytest.raises(ValueError, match="D dividing K"):
        ref.gated_linear(x, gate, w, norm_weight=nw[:5])


def test_signature_matches_the_reference():
    want = [(p.name, p.kind, p.default) for p in inspect.signature(ref.gated_linear).parameters.values()]
    got = [(p.name, p.kind, p.default) for p in inspect.signature(tri.gated_linear).parameters.values()
           if p.name != "config"]
    assert got == want


# ---- the GDN decode without its norm + the folded projection ---------------------------------------

def _gdn_layer(device, dtype, *, hk=1, ratio=2, dk=16, dv=16, slots=6, seed=0):
    g = gen(seed)
    hv = hk * ratio
    D = 2 * hk * dk + hv * dv
    kw = dict(conv_weight=randn(D, 4, g=g, dtype=dtype, device=device, scale=0.5),
              A_log=torch.linspace(-3.0, 1.0, hv).to(device), dt_bias=randn(hv, g=g, device=device, scale=0.5),
              norm_weight=(torch.rand(dv, generator=g) + 0.5).to(dtype=dtype, device=device), eps=1e-6,
              scale=dk ** -0.5)
    pools = (randn(slots, 3, D, g=g, dtype=dtype, device=device),
             randn(slots, hv, dk, dv, g=g, device=device, scale=0.3))
    w = randn(24, hv * dv, g=g, dtype=dtype, device=device, scale=(hv * dv) ** -0.5)

    def tokens(T):
        proj = randn(T, D + hv * dv + 2 * hv + 5, g=g, dtype=dtype, device=device)   # strided column views
        mixed, z, a, b, _ = proj.split([D, hv * dv, hv, hv, 5], dim=-1)
        return mixed, z, a, b
    return kw, pools, w, tokens


@pytest.mark.parametrize("impl", ["reference", "triton"])
@pytest.mark.parametrize("ratio,dv,bv,dtype,activation", [
    (2, 32, 16, torch.float32, "silu"),      # 2 V-slices x 2 heads per key head: the counter orders the window
    (1, 16, 16, torch.bfloat16, "sigmoid"),  # a group of one program
    (2, 16, 16, torch.bfloat16, "silu"),     # whole rows, 2 heads share the q/k window
    (3, 32, 16, torch.float32, "silu"),      # 3 heads per key head (the 27B), 6 programs on the counter
])
def test_gdn_decode_unnormalised_then_folded_equals_gdn_decode_then_linear(impl, ratio, dv, bv, dtype,
                                                                         activation, device):
    """Three one-token steps: gdn_decode(gated_norm=False) + gated_linear(norm) == gdn_decode + linear
    (the pools bit for bit; o before the norm == the two-launch path's; y within one rounding)."""
    kw, (c0, s0), w, tokens = _gdn_layer(device, dtype, ratio=ratio, dv=dv, seed=ratio + dv)
    hv = ratio
    idx = torch.tensor([4], dtype=torch.int32, device=device)
    if impl == "reference":
        decode, glin, lin, cfgs = gdn_ref.gdn_decode, ref.gated_linear, ref.linear, ({}, {})
    else:
        one = tr.RecurrentConfig(bv=bv, num_warps=1, one_launch=True)
        decode, glin, lin = tr.gdn_decode, tri.gated_linear, tri.linear
        cfgs = ({"config": one}, {"config": tr.RecurrentConfig(bv=bv, num_warps=1)})
    c_a, s_a = c0.clone(), s0.clone()       # the fold
    c_b, s_b = c0.clone(), s0.clone()       # gdn_decode + linear
    c_c, s_c = c0.clone(), s0.clone()       # two launches without the norm (Triton only)
    for step in range(3):
        mixed, z, a, b = tokens(1)
        z3 = z.view(1, hv, dv)
        o = decode(mixed, z3, a, b, conv_state=c_a, ssm_state=s_a, state_indices=idx, norm_activation=activation,
                   gated_norm=False, **kw, **cfgs[0])
        got = glin(o.view(1, -1), z, w, norm_weight=kw["norm_weight"], eps=1e-6, activation=activation)
        normed = decode(mixed, z3, a, b, conv_state=c_b, ssm_state=s_b, state_indices=idx,
                        norm_activation=activation, **kw, **cfgs[0])
        want = lin(normed.view(1, -1), w)
        assert_close(got, want, TOL[dtype], f"{impl} step {step}: y")
        h = norm_ref.rms_norm_gated(o, z3, kw["norm_weight"], 1e-6, activation=activation)
        assert_close(normed, h, TOL[dtype] if dtype == torch.float32 else 8e-3, f"{impl} step {step}: o")
        if impl == "triton":
            o2 = decode(mixed, z3, a, b, conv_state=c_c, ssm_state=s_c, state_indices=idx,
                        norm_activation=activation, gated_norm=False, **kw, **cfgs[1])
            assert_close(o, o2, 1e-6, f"step {step}: o, one vs two launches")
    assert torch.equal(c_a, c_b), "conv pool"
    assert torch.equal(s_a, s_b), "state pool"
    if impl == "triton":
        assert torch.equal(c_a, c_c) and torch.equal(s_a, s_c)
        assert not group_counters(torch.device(device), 16).any(), "the counters end at zero"


def test_gdn_decode_unnormalised_padded_rows(device):
    """gated_norm=False at a padded batch (two launches and the one-launch kernel): padded rows are zero,
    live rows equal the reference's o."""
    kw, (c0, s0), _, tokens = _gdn_layer(device, torch.float32, ratio=2, dv=32, seed=3)
    idx = torch.tensor([2, -1, 0], dtype=torch.int32, device=device)
    mixed, z, a, b = tokens(3)
    c_r, s_r = c0.clone(), s0.clone()
    want = gdn_ref.gdn_decode(mixed, z.view(3, 2, 32), a, b, conv_state=c_r, ssm_state=s_r, state_indices=idx,
                              gated_norm=False, **kw)
    assert (want[1] == 0).all()
    for cfg in (tr.RecurrentConfig(bv=16, num_warps=1, one_launch=True), tr.RecurrentConfig(bv=16, num_warps=1)):
        c, s = c0.clone(), s0.clone()
        got = tr.gdn_decode(mixed, z.view(3, 2, 32), a, b, conv_state=c, ssm_state=s, state_indices=idx,
                            gated_norm=False, config=cfg, **kw)
        assert_close(got, want, 1e-5, f"{cfg}")
        assert (got[1] == 0).all()
        assert torch.equal(c, c_r) and (s - s_r).abs().max() < 1e-5


# ---- the model with the fold ---------------------------------------------------------------------------

@pytest.mark.parametrize("family", ["qwen3_5_moe", "qwen3_next"])
def test_model_with_the_fold_equals_the_reference_ops(tiny_model, family, device):
    """A tiny model whose GDN decode and output projections run the Triton ops (gdn_decode, gated_linear,
    under the interpreter on the CPU) against the same model on the reference ops: a prefill of two
    prompts (no fold), a decode step of both (two rows: no fold), then single-token decode steps (the
    GDN norm and the attention gate folded into out_proj / o_proj). The fold is taken where expected."""
    from deltaserve.batch import CacheBuffers
    from deltaserve.models.loader import load_model
    from deltaserve.ops import select_kernels
    from tests.conftest import TinySpec, random_ids

    from .test_rms_norm_linear import _batch

    path = tiny_model(TinySpec(family=family, ratio=2, seed=47, num_layers=4))
    ref_k = select_kernels(device, force_reference=True)
    rows_folded = []

    def glin(x, gate, weight, **kw):
        rows_folded.append(x.shape[0])
        return tri.gated_linear(x, gate, weight, **kw)

    tri_k = dataclasses.replace(ref_k, gated_linear=glin, gdn_decode=tr.gdn_decode,
                                gate_fold_rows=tri.GATE_FOLD_MAX_ROWS,
                                backend={**ref_k.backend, "gated_linear": "triton", "gdn_decode": "triton"})
    out = []
    for kernels in (ref_k, tri_k):
        model = load_model(path, device=device, dtype=torch.float32, kernels=kernels, show_progress=False)
        cache = CacheBuffers.allocate(model.config, num_slots=2, num_blocks=8, block_size=16, device=device,
                                      dtype=torch.float32)
        a, b = random_ids(5, seed=3), random_ids(3, seed=4)
        steps = [[(a, 0, 0), (b, 0, 1)], [([a[0]], 5, 0), ([b[0]], 3, 1)], [([a[1]], 6, 0)], [([a[2]], 7, 0)]]
        with torch.inference_mode():
            out.append(torch.cat([model.compute_logits(model(_batch(s, device), cache)) for s in steps]))
    assert_close(out[1], out[0], 1e-5, f"{family}: Triton fold vs reference logits")
    n_attn = sum(1 for m in model.modules() if type(m).__name__ == "GatedAttention")
    n_gdn = sum(1 for m in model.modules() if type(m).__name__ == "GatedDeltaNet")
    # the attention gate goes through gated_linear at every step; the GDN norm at the one-row steps only
    assert rows_folded.count(1) == 2 * (n_attn + n_gdn), rows_folded
    assert len(rows_folded) == 4 * n_attn + 2 * n_gdn, rows_folded


# ---- real shapes on the GPU ------------------------------------------------------------------------

# (K, N, head dim or None): 35B-A3B GDN out_proj / attention o_proj (4096 -> 2048); 27B (6144 -> 5120)
REAL = [(4096, 2048, 128), (4096, 2048, None), (6144, 5120, 128), (6144, 5120, None)]


# explicit fold tiles checked beside the default (the variants benchmarks/gdn_decode_latency.py --fold times)
REAL_FOLD_CONFIGS = [C(block_n=1, block_k=4096, warps=4, stages=1), C(block_n=4, block_k=1024, warps=4, stages=3),
                     C(block_n=8, block_k=512, warps=4, stages=3)]


@pytest.mark.gpu
@pytest.mark.parametrize("K,N,D", REAL)
def test_real_shapes_equal_the_two_launches_gpu(K, N, D):
    """bf16 at the model's output projections, M = 1 (the default, and every fold tile variant) and
    M = 2, 8 (two launches), eager and in a CUDA graph: == the gate op (sigmoid_mul / rms_norm_gated)
    then the GEMV within one rounding of y; the graph replay == eager bit for bit."""
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(K + N)
    bf = torch.bfloat16
    w = (torch.randn(N, K, device=dev, generator=g) * K ** -0.5).to(bf)
    nw = None if D is None else (torch.rand(D, device=dev, generator=g) + 0.5).to(bf)
    act = "sigmoid" if D is None else "silu"
    for M, cfg in [(1, None)] + [(1, c) for c in REAL_FOLD_CONFIGS] + [(2, None), (8, None)]:
        x = torch.randn(M, K, device=dev, generator=g).to(bf)
        gate = torch.randn(M, 2 * K, device=dev, generator=g).to(bf)[:, K:]
        got = tri.gated_linear(x, gate, w, norm_weight=nw, activation=act, config=cfg)
        if D is None:
            h = act_tri.sigmoid_mul(x, gate)
        else:
            h = norm_tri.rms_norm_gated(x.view(M, K // D, D), gate.reshape(M, K // D, D), nw, 1e-6,
                                        activation=act).view(M, K)
        want = tri.linear(h, w)
        assert_close(got, want, 8e-3, f"M={M} {cfg}")
        assert_close(got, F.linear(h.float(), w.float()), 1e-2, f"M={M} {cfg} vs fp32")
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = tri.gated_linear(x, gate, w, norm_weight=nw, activation=act, config=cfg)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, got), f"M={M} {cfg}: graph replay != eager"


@pytest.mark.gpu
@pytest.mark.parametrize("hv", [32, 48])
def test_gdn_fold_chain_in_graph_gpu(hv):
    """The batch-1 GDN decode as the layer folds it, at the 35B (32 value heads) / 27B (48) shapes: three
    steps of gdn_decode(gated_norm=False) + gated_linear in one CUDA graph (programmatic launches back to
    back) == gdn_decode + linear step by step; the pools equal."""
    dev, bf, hk, d = "cuda", torch.bfloat16, 16, 128
    H = 2048 if hv == 32 else 5120
    g = gen(hv)
    dc = 2 * hk * d + hv * d
    kw = dict(conv_weight=randn(dc, 4, g=g, dtype=bf, device=dev, scale=0.5),
              A_log=torch.linspace(-3, 1, hv, device=dev), dt_bias=randn(hv, g=g, device=dev, scale=0.5),
              norm_weight=(torch.rand(d, generator=g) + 0.5).to(dev, bf), eps=1e-6, scale=d ** -0.5)
    conv0, ssm0 = randn(3, 3, dc, g=g, dtype=bf, device=dev), randn(3, hv, d, d, g=g, device=dev, scale=0.1)
    w = randn(H, hv * d, g=g, dtype=bf, device=dev, scale=(hv * d) ** -0.5)
    idx = torch.tensor([1], dtype=torch.int32, device=dev)
    steps = [(randn(1, dc, g=g, dtype=bf, device=dev), randn(1, hv * d, g=g, dtype=bf, device=dev),
              randn(1, hv, g=g, dtype=bf, device=dev), randn(1, hv, g=g, dtype=bf, device=dev)) for _ in range(3)]

    def folded(t, conv, ssm):
        mixed, z, a, b = t
        o = tr.gdn_decode(mixed, z.view(1, hv, d), a, b, conv_state=conv, ssm_state=ssm, state_indices=idx,
                          gated_norm=False, **kw)
        return tri.gated_linear(o.view(1, -1), z, w, norm_weight=kw["norm_weight"], eps=1e-6, activation="silu")

    conv_r, ssm_r = conv0.clone(), ssm0.clone()
    want = [tri.linear(tr.gdn_decode(t[0], t[1].view(1, hv, d), t[2], t[3], conv_state=conv_r, ssm_state=ssm_r,
                                     state_indices=idx, **kw).view(1, -1), w) for t in steps]
    folded(steps[0], conv0.clone(), ssm0.clone())  # compile outside the capture
    conv_g, ssm_g = conv0.clone(), ssm0.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [folded(t, conv_g, ssm_g) for t in steps]
    graph.replay()
    torch.cuda.synchronize()
    for i in range(3):
        assert_close(outs[i], want[i], 8e-3, f"step {i}")
    assert torch.equal(conv_g, conv_r), "conv windows"
    assert_close(ssm_g, ssm_r, 1e-6, "state")
    assert not group_counters(torch.device(dev, torch.cuda.current_device()), 16).any()
