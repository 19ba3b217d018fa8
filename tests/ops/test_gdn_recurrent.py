"""Token-by-token kernels (Triton) against the references: gates, plain decode, the fused layer decode,
speculative verify and commit -- checked against the token-by-token recurrence, with padded rows and
slots out of order."""

from __future__ import annotations

import pytest
import torch

from deltaserve.ops.conv1d import reference as conv_ref
from deltaserve.ops.gdn import dispatch
from deltaserve.ops.gdn import reference as ref
from deltaserve.ops.gdn import triton_recurrent as tr
from deltaserve.ops.gdn import triton_verify as tv
from deltaserve.ops.gdn.triton_steps import group_counters
from deltaserve.ops.norm import reference as norm_ref

from .helpers import assert_close, cu_seqlens, gen, randn

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def test_gating_matches_reference(device):
    g = gen(0)
    a, b = randn(37, 6, g=g, device=device, scale=8.0), randn(37, 6, g=g, device=device, scale=4.0)
    a[0, 0], a[0, 1] = 30.0, -30.0                          # softplus threshold and its tiny tail
    A_log, dt_bias = randn(6, g=g, device=device), randn(6, g=g, device=device)
    g_ref, b_ref = ref.gdn_gating(A_log, a, dt_bias, b)
    g_tri, b_tri = tr.gdn_gating(A_log, a, dt_bias, b)
    assert_close(g_tri, g_ref, 1e-6, "g")
    assert_close(b_tri, b_ref, 1e-6, "beta")
    assert (g_tri[0, 1] < 0).item(), "softplus of a very negative input must stay > 0 (log1p tail)"


@pytest.mark.parametrize("ratio", [1, 2, 4])
def test_fused_recurrent_matches_reference(ratio, device):
    g = gen(ratio)
    N, hk, dk, dv, S = 6, 1, 16, 32, 9
    hv = hk * ratio
    q, k = randn(N, hk, dk, g=g, device=device), randn(N, hk, dk, g=g, device=device)
    v = randn(N, hv, dv, g=g, device=device)
    gg, beta = -torch.rand(N, hv, generator=g).to(device), torch.rand(N, hv, generator=g).to(device)
    pool = randn(S, hv, dk, dv, g=g, device=device, scale=0.3)
    idx = torch.tensor([4, -1, 0, 8, 2, -1], dtype=torch.int32, device=device)
    p_ref, p_tri = pool.clone(), pool.clone()
    kw = dict(scale=dk ** -0.5, state_indices=idx)
    o_ref = ref.fused_recurrent_gated_delta_rule(q, k, v, gg, beta, ssm_state=p_ref, **kw)
    o_tri = tr.fused_recurrent_gated_delta_rule(q, k, v, gg, beta, ssm_state=p_tri, **kw)
    assert_close(o_tri, o_ref, 1e-5, "output")
    assert torch.equal(p_tri, p_ref) or (p_tri - p_ref).abs().max() < 1e-6
    assert (o_tri[1] == 0).all() and (o_tri[5] == 0).all(), "padded rows give zeros"


class Layer:
    """Random GDN-layer parameters and pools at a small shape."""

    def __init__(self, device, dtype, *, hk=1, ratio=2, dk=16, dv=16, slots=8, seed=0, activation="silu"):
        g = gen(seed)
        self.hk, self.hv, self.dk, self.dv = hk, hk * ratio, dk, dv
        self.D = 2 * hk * dk + self.hv * dv
        self.dtype, self.device, self.g = dtype, device, g
        self.conv_weight = randn(self.D, 4, g=g, dtype=dtype, device=device, scale=0.5)
        self.A_log = torch.linspace(-3.0, 1.0, self.hv).to(device)
        self.dt_bias = randn(self.hv, g=g, device=device, scale=0.5)
        self.norm_weight = (torch.rand(dv, generator=g) + 0.5).to(dtype=dtype, device=device)
        self.conv_state = randn(slots, 3, self.D, g=g, dtype=dtype, device=device)
        self.ssm_state = randn(slots, self.hv, dk, dv, g=g, device=device, scale=0.3)
        self.activation = activation

    def tokens(self, T, extra_cols=3):
        """mixed_qkv / z / a / b as column views of one projection output (strided rows, like the layer)."""
        width = self.D + self.hv * self.dv + 2 * self.hv + extra_cols
        proj = randn(T, width, g=self.g, dtype=self.dtype, device=self.device)
        mixed, z, b, a, _ = proj.split([self.D, self.hv * self.dv, self.hv, self.hv, extra_cols], dim=-1)
        return mixed, z.view(T, self.hv, self.dv), a, b

    def kw(self):
        return dict(conv_weight=self.conv_weight, A_log=self.A_log, dt_bias=self.dt_bias,
                    norm_weight=self.norm_weight, eps=1e-6, scale=self.dk ** -0.5, norm_activation=self.activation)

    def pools(self):
        return self.conv_state.clone(), self.ssm_state.clone()

    def stash(self, T):
        return ref.VerifyStash.empty(T, conv_dim=self.D, num_k_heads=self.hk, head_k_dim=self.dk,
                                     num_v_heads=self.hv, head_v_dim=self.dv, dtype=self.dtype, device=self.device)


def unfused_decode(layer: Layer, mixed, z, a, b, conv_state, ssm_state, idx):
    """The layer's decode path op by op (what gdn_decode fuses), from the references."""
    x = conv_ref.causal_conv1d_update(mixed, layer.conv_weight, conv_state=conv_state, state_indices=idx)
    q, k, v = x.split([layer.hk * layer.dk, layer.hk * layer.dk, layer.hv * layer.dv], dim=-1)
    N = x.shape[0]
    g, beta = ref.gdn_gating(layer.A_log, a, layer.dt_bias, b)
    o = ref.recurrent_gated_delta_rule(
        q.reshape(N, layer.hk, layer.dk), k.reshape(N, layer.hk, layer.dk), v.reshape(N, layer.hv, layer.dv),
        g, beta, scale=layer.dk ** -0.5, cu_seqlens=torch.arange(N + 1, dtype=torch.int32, device=x.device),
        ssm_state=ssm_state, state_indices=idx, has_initial_state=torch.ones(N, dtype=torch.bool, device=x.device))
    return norm_ref.rms_norm_gated(o, z, layer.norm_weight, 1e-6, activation=layer.activation)


@pytest.mark.parametrize("ratio,dtype,activation", [(2, torch.float32, "silu"), (4, torch.bfloat16, "silu"),
                                                    (1, torch.float32, "sigmoid")])
def test_decode_matches_token_recurrence(ratio, dtype, activation, device):
    """Three decode steps through gdn_decode (Triton) == the unfused reference ops step by step."""
    layer = Layer(device, dtype, ratio=ratio, seed=ratio, activation=activation)
    idx = torch.tensor([5, -1, 0, 3], dtype=torch.int32, device=device)
    c_ref, s_ref = layer.pools()
    c_tri, s_tri = layer.pools()
    for step in range(3):
        mixed, z, a, b = layer.tokens(4)
        want = unfused_decode(layer, mixed, z, a, b, c_ref, s_ref, idx)
        got = tr.gdn_decode(mixed, z, a, b, conv_state=c_tri, ssm_state=s_tri, state_indices=idx, **layer.kw())
        assert_close(got, want, TOL[dtype], f"output step {step}")
        assert (got[1] == 0).all(), "padded row gives zeros"
    assert_close(s_tri, s_ref, TOL[dtype], "state pool")
    assert_close(c_tri, c_ref, 0.0, "conv pool")
    assert torch.equal(s_tri[1], layer.ssm_state[1]), "untouched slot changed"


ONE_LAUNCH_CASES = [  # (ratio, dv, bv, dtype, activation): the programs of a (sequence, key head) group
    (2, 32, 16, torch.float32, "silu"),      # 2 V-slices x 2 heads: the last program normalises both rows
    (2, 32, 16, torch.bfloat16, "silu"),     # the same in bf16
    (3, 16, 16, torch.bfloat16, "silu"),     # whole rows (local norm), 3 heads share the q/k window
    (1, 32, 16, torch.float32, "sigmoid"),   # one head, 2 slices
    (1, 16, 16, torch.float32, "silu"),      # a group of one program: no counter at all
]


@pytest.mark.parametrize("ratio,dv,bv,dtype,activation", ONE_LAUNCH_CASES)
def test_one_launch_decode_matches_two_launches_and_reference(ratio, dv, bv, dtype, activation, device):
    """Two steps of the one-launch decode == the two-launch decode (same math, fp32 rounding) == the
    unfused reference; padded rows give zeros and touch nothing; the group counters end at zero."""
    layer = Layer(device, dtype, ratio=ratio, dv=dv, seed=30 + ratio + bv, activation=activation)
    idx = torch.tensor([6, -1, 0, 3, 5], dtype=torch.int32, device=device)
    one = tr.RecurrentConfig(bv=bv, num_warps=1, one_launch=True)
    two = tr.RecurrentConfig(bv=bv, num_warps=1)
    c_ref, s_ref = layer.pools()
    c_one, s_one = layer.pools()
    c_two, s_two = layer.pools()
    for step in range(2):  # the second finds the counters the first left
        mixed, z, a, b = layer.tokens(5)
        want = unfused_decode(layer, mixed, z, a, b, c_ref, s_ref, idx)
        got = tr.gdn_decode(mixed, z, a, b, conv_state=c_one, ssm_state=s_one, state_indices=idx, config=one,
                            **layer.kw())
        got2 = tr.gdn_decode(mixed, z, a, b, conv_state=c_two, ssm_state=s_two, state_indices=idx, config=two,
                             **layer.kw())
        assert_close(got, got2, 1e-6, f"one vs two launches, step {step}")
        assert_close(got, want, TOL[dtype], f"output step {step}")
        assert (got[1] == 0).all(), "padded row gives zeros"
    assert_close(s_one, s_two, 1e-6, "state pool, one vs two launches")
    assert_close(s_one, s_ref, TOL[dtype], "state pool")
    assert torch.equal(c_one, c_ref), "conv pool"
    for untouched in (1, 2, 4, 7):
        assert torch.equal(s_one[untouched], layer.ssm_state[untouched]), f"slot {untouched} changed"
        assert torch.equal(c_one[untouched], layer.conv_state[untouched]), f"window {untouched} changed"
    counters = group_counters(torch.device(device), 5 * layer.hk)
    assert not counters.any(), "every launch leaves the group counters at zero"


def test_decode_path_rule():
    """The path is a function of the shapes alone (graph capture sees one path per batch size)."""
    n_max = dispatch.ONE_LAUNCH_MAX_ROWS
    for hv in (32, 48):
        for n in (1, 2, n_max):
            cfg = tr.default_decode_config(n, 16, hv, 128)
            assert cfg.one_launch and 128 % cfg.bv == 0, (n, cfg)
            assert cfg == tr.default_decode_config(n, 16, hv, 128)
        assert not tr.default_decode_config(n_max + 1, 16, hv, 128).one_launch
        assert not tr.default_decode_config(512, 16, hv, 128).one_launch


def test_decode_pdl_rule_and_checks(device):
    """Programmatic launch only where the device has it (never on the CPU path), only for one launch."""
    assert tr.default_decode_config(1, 16, 32, 128, pdl=True).pdl
    assert not tr.default_decode_config(1, 16, 32, 128).pdl
    assert not tr.default_decode_config(16, 16, 32, 128, pdl=True).pdl, "only the smallest batches"
    assert not tr.default_decode_config(64, 16, 32, 128, pdl=True).pdl, "two launches never use PDL"
    layer = Layer(device, torch.float32, seed=4)
    mixed, z, a, b = layer.tokens(2)
    idx = torch.tensor([0, 1], dtype=torch.int32, device=device)
    c, s = layer.pools()
    with pytest.raises(ValueError, match="pdl applies to the one-launch path only"):
        tr.gdn_decode(mixed, z, a, b, conv_state=c, ssm_state=s, state_indices=idx,
                      config=tr.RecurrentConfig(bv=16, num_warps=1, pdl=True), **layer.kw())
    if not tr.has_pdl(torch.device(device)):
        with pytest.raises(ValueError, match="compute capability 9.0"):
            tr.gdn_decode(mixed, z, a, b, conv_state=c, ssm_state=s, state_indices=idx,
                          config=tr.RecurrentConfig(bv=16, num_warps=1, one_launch=True, pdl=True), **layer.kw())


@pytest.mark.parametrize("op,config,message", [
    ("verify", tr.RecurrentConfig(bv=16, num_warps=1, qk_prepass=True), "qk_prepass applies to the one-launch verify"),
    ("decode", tr.RecurrentConfig(bv=16, num_warps=1, one_launch=True, qk_prepass=True),
     "qk_prepass applies to gdn_verify only"),
    ("decode", tr.RecurrentConfig(bv=16, num_warps=1, one_launch=True, gram=True), "gram applies to gdn_verify only"),
], ids=["qk_prepass-three-launches", "qk_prepass-decode", "gram-decode"])
def test_config_fields_of_another_path_rejected(op, config, message, device):
    layer = Layer(device, torch.float32, seed=2)
    cu, idx, mixed, z, a, b = _verify_case(layer, [2], [1])
    pools = dict(conv_state=layer.conv_state.clone(), ssm_state=layer.ssm_state.clone(), state_indices=idx)
    with pytest.raises(ValueError, match=message):
        if op == "verify":
            tv.gdn_verify(mixed, z, a, b, cu_seqlens=cu, stash=layer.stash(2), config=config, **pools, **layer.kw())
        else:
            tr.gdn_decode(mixed[:1], z[:1], a[:1], b[:1], config=config, **pools, **layer.kw())


def test_verify_path_rule():
    """One launch for small batches (rows and mean tokens per sequence bounded), from the shapes alone."""
    for n, t in ((1, 2), (1, 4), (2, 8), (2, 16)):
        cfg = dispatch.default_verify_config(n, t, 16, 32, 128)
        assert cfg.one_launch and 128 % cfg.bv == 0, (n, t, cfg)
    assert dispatch.default_verify_config(1, 4, 16, 32, 128, pdl=True).pdl
    # one-warp 8-column programs from 2 tokens per sequence, 16 columns below
    assert [(c.bv, c.num_warps) for c in (dispatch.default_verify_config(1, t, 16, 32, 128) for t in (1, 2, 3, 4))] == \
        [(16, 2), (8, 1), (8, 1), (8, 1)]
    assert not dispatch.default_verify_config(1, 4, 16, 32, 128).pdl
    # the q / k pre-kernel from 3 tokens per sequence, and only where it is programmatic
    assert [dispatch.default_verify_config(n, t, 16, 32, 128, pdl=True).qk_prepass
            for n, t in ((1, 1), (1, 2), (1, 3), (1, 4), (1, 8), (2, 4), (2, 6), (2, 16))] == \
        [False, False, True, True, True, False, True, True]
    assert not dispatch.default_verify_config(1, 4, 16, 32, 128).qk_prepass
    # the gram form where the unrolled chunk is 2 tokens, 16 columns / 2 warps above 32 rows
    assert [(c.gram, c.bv, c.num_warps) for c in (dispatch.default_verify_config(n, t, 16, 32, 128, pdl=True)
                                                  for n, t in ((1, 1), (1, 2), (1, 3), (2, 3), (2, 4), (2, 5)))] == \
        [(False, 16, 2), (True, 8, 1), (False, 8, 1), (True, 16, 2), (True, 16, 2), (False, 8, 1)]
    assert not dispatch.default_verify_config(1, 9, 16, 32, 128).one_launch, "more than VERIFY_MAX_CHUNK tokens"
    assert not dispatch.default_verify_config(3, 12, 16, 32, 128).one_launch, "more rows than the bound"
    assert not dispatch.default_verify_config(64, 256, 16, 32, 128).one_launch
    assert [dispatch.verify_chunk(t, n) for t, n in ((1, 1), (2, 1), (3, 1), (4, 1), (8, 2), (9, 2), (40, 1))] == \
        [1, 2, 4, 4, 4, 8, 8]


# (ratio, dv, bv, dtype, activation, lengths, slots): one-launch verify configurations
ONE_LAUNCH_VERIFY_CASES = [
    (2, 32, 16, torch.float32, "silu", [2, 8, 4, 5], [6, 1, -1, 3]),     # split rows (counter), ragged, padded
    (2, 16, 16, torch.bfloat16, "silu", [3, 1, 6], [0, -1, 4]),          # whole rows: the norm is local
    (1, 32, 8, torch.float32, "sigmoid", [1, 11], [5, 2]),              # 4 slices; 11 tokens: several chunks
    (4, 16, 8, torch.bfloat16, "silu", [4, 4], [7, 0]),                 # 4 heads share a key head
]


@pytest.mark.parametrize("prepass,gram", [(False, False), (True, False), (False, True), (True, True)],
                         ids=["fused", "qk-prepass", "gram", "gram-qk-prepass"])
@pytest.mark.parametrize("ratio,dv,bv,dtype,activation,lengths,slots", ONE_LAUNCH_VERIFY_CASES)
def test_one_launch_verify_matches_three_launches(ratio, dv, bv, dtype, activation, lengths, slots, prepass, gram,
                                                  device):
    """The one-launch verify (with its q / k in the kernel, or from the qk_prepass pre-kernel; token by token, or
    each chunk of tokens from its start state: gram) == the three-launch verify: outputs within fp32 rounding, the
    stash's live rows (k, g within fp32 rounding, delta, x bit for bit), pools untouched; twice (counters reset).
    The 11-token sequence runs several unrolled chunks (the gram form's state update between them)."""
    layer = Layer(device, dtype, ratio=ratio, dv=dv, seed=40 + ratio + bv, activation=activation)
    cu, idx, mixed, z, a, b = _verify_case(layer, lengths, slots)
    T = sum(lengths)
    one = tr.RecurrentConfig(bv=bv, num_warps=1, one_launch=True, qk_prepass=prepass, gram=gram)
    three = tr.RecurrentConfig(bv=bv, num_warps=1)
    live = torch.cat([torch.full((n,), s >= 0) for n, s in zip(lengths, slots)]).to(device)
    for step in range(2):
        got = []
        for cfg in (one, three):
            c, s = layer.pools()
            st = layer.stash(T)
            for t in (st.x, st.k, st.g, st.delta):
                t.fill_(7.0)
            o = tv.gdn_verify(mixed, z, a, b, cu_seqlens=cu, conv_state=c, ssm_state=s, state_indices=idx, stash=st,
                              config=cfg, **layer.kw())
            assert torch.equal(c, layer.conv_state) and torch.equal(s, layer.ssm_state), "verify must not touch pools"
            got.append((o, st))
        (o1, s1), (o3, s3) = got
        tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: an fp32 rounding may flip a bf16 output's last bit
        assert_close(o1, o3, tol, f"output, step {step}")
        assert (o1[~live] == 0).all(), "padded rows give zeros"
        assert torch.equal(s1.x, s3.x), "stash.x"
        assert_close(s1.k[live], s3.k[live], 1e-6, "stash.k")
        assert_close(s1.g, s3.g, 1e-6, "stash.g")
        assert_close(s1.delta[live], s3.delta[live], 1e-5, "stash.delta")
        assert (s1.k[~live] == 0).all(), "padded rows' keys are zero, as the pre-pass writes them"
        counters = group_counters(torch.device(device), len(lengths) * layer.hv)
        assert not counters.any(), "every launch leaves the group counters at zero"


def test_decode_reference_equals_unfused(device):
    """The fused-decode reference is the layer's unfused path (so the CPU path is unchanged by fusion)."""
    layer = Layer(device, torch.float32, seed=9)
    idx = torch.tensor([2, 6, -1], dtype=torch.int32, device=device)
    mixed, z, a, b = layer.tokens(3)
    c1, s1 = layer.pools()
    c2, s2 = layer.pools()
    want = unfused_decode(layer, mixed, z, a, b, c1, s1, idx)
    got = ref.gdn_decode(mixed, z, a, b, conv_state=c2, ssm_state=s2, state_indices=idx, **layer.kw())
    assert_close(got, want, 1e-6, "output")
    assert_close(s2, s1, 1e-6, "state")


def _verify_case(layer: Layer, lengths, idx_list):
    device = layer.device
    cu = cu_seqlens(lengths, device)
    idx = torch.tensor(idx_list, dtype=torch.int32, device=device)
    mixed, z, a, b = layer.tokens(sum(lengths))
    return cu, idx, mixed, z, a, b


VERIFY_NO_NORM = {"three launches": tr.RecurrentConfig(bv=8, num_warps=1),
                  "one launch": tr.RecurrentConfig(bv=8, num_warps=1, one_launch=True),
                  "gram": tr.RecurrentConfig(bv=8, num_warps=1, one_launch=True, gram=True),
                  "qk_prepass": tr.RecurrentConfig(bv=8, num_warps=1, one_launch=True, qk_prepass=True),
                  "whole rows": tr.RecurrentConfig(bv=32, num_warps=1, one_launch=True)}


@pytest.mark.parametrize("name", list(VERIFY_NO_NORM))
def test_verify_without_norm(name, device):
    """gated_norm=False (for an output projection that folds the norm, as the batch-1 decode): verify returns o
    before the gated RMSNorm, == the reference's, whose gated norm of it is the gated_norm=True output; the stash
    is the same as with the norm; no counter is left set."""
    layer = Layer(device, torch.float32, ratio=2, dv=32, seed=33)
    lengths, slots = [2, 5, 3], [4, -1, 0]
    cu, idx, mixed, z, a, b = _verify_case(layer, lengths, slots)
    T = sum(lengths)
    runs = {}
    for ops, norm in ((ref, True), (ref, False), (tv, False)):
        c, s = layer.pools()
        st = layer.stash(T)
        cfg = {} if ops is ref else {"config": VERIFY_NO_NORM[name]}
        o = ops.gdn_verify(mixed, z, a, b, cu_seqlens=cu, conv_state=c, ssm_state=s, state_indices=idx, stash=st,
                           gated_norm=norm, **cfg, **layer.kw())
        assert torch.equal(c, layer.conv_state) and torch.equal(s, layer.ssm_state), "verify must not touch pools"
        runs[ops.__name__.rsplit(".", 1)[1], norm] = (o, st)
    (o_norm, st_ref), (o_ref, _), (o_tri, st_tri) = runs.values()
    assert_close(norm_ref.rms_norm_gated(o_ref, z.view(T, layer.hv, layer.dv), layer.norm_weight, 1e-6,
                                         activation=layer.activation), o_norm, 1e-6, "reference: norm(o) == output")
    assert_close(o_tri, o_ref, 1e-5, f"{name}: o before the norm")
    live = torch.cat([torch.full((n,), sl >= 0) for n, sl in zip(lengths, slots)]).to(device)
    assert (o_tri[~live] == 0).all(), "padded rows give zeros"
    assert torch.equal(st_tri.x[live], st_ref.x[live]), "stash.x"
    assert_close(st_tri.delta[live], st_ref.delta[live], 1e-5, "stash.delta")
    assert not group_counters(torch.device(device), len(lengths) * layer.hv).any()


@pytest.mark.parametrize("impl", ["reference", "triton", "triton-one-launch", "triton-qk-prepass", "triton-gram"])
def test_verify_then_commit_equals_sequential_decode(impl, device):
    """verify(T_n tokens) outputs == T_n decode steps; commit(a_n) leaves pools == after a_n decode steps;
    verify itself leaves the pools untouched. Ragged T_n = K_n + 1, K_n in 1..7, a padded row."""
    dtype = torch.float32
    layer = Layer(device, dtype, ratio=2, seed=21)
    lengths = [2, 8, 4, 5]
    idx_list = [6, 1, -1, 3]
    accepted = [1, 8, 2, 0]
    cu, idx, mixed, z, a, b = _verify_case(layer, lengths, idx_list)
    ops = ref if impl == "reference" else tv
    cfg = {"triton": tr.RecurrentConfig(bv=16, num_warps=1),  # the three launches whatever the default
           "triton-one-launch": tr.RecurrentConfig(bv=8, num_warps=1, one_launch=True),
           "triton-qk-prepass": tr.RecurrentConfig(bv=8, num_warps=1, one_launch=True, qk_prepass=True),
           "triton-gram": tr.RecurrentConfig(bv=8, num_warps=1, one_launch=True, qk_prepass=True, gram=True)}.get(impl)
    c_v, s_v = layer.pools()
    stash = layer.stash(sum(lengths))
    out = ops.gdn_verify(mixed, z, a, b, cu_seqlens=cu, conv_state=c_v, ssm_state=s_v, state_indices=idx,
                         stash=stash, **layer.kw(), **({"config": cfg} if cfg else {}))
    assert torch.equal(c_v, layer.conv_state) and torch.equal(s_v, layer.ssm_state), "verify must not touch pools"
    ops.gdn_commit(torch.tensor(accepted, dtype=torch.int32, device=device), cu_seqlens=cu, state_indices=idx,
                   conv_state=c_v, ssm_state=s_v, stash=stash)
    # oracle: decode one token at a time (reference), snapshotting pools after each sequence's accepted prefix
    c_d, s_d = layer.pools()
    want_c, want_s = layer.conv_state.clone(), layer.ssm_state.clone()
    bounds = cu.tolist()
    for n, slot in enumerate(idx_list):
        for i in range(lengths[n]):
            t = bounds[n] + i
            sl = torch.tensor([slot], dtype=torch.int32, device=device)
            o = ref.gdn_decode(mixed[t:t + 1], z[t:t + 1], a[t:t + 1], b[t:t + 1], conv_state=c_d, ssm_state=s_d,
                               state_indices=sl, **layer.kw())
            assert_close(out[t:t + 1], o, 1e-5, f"verify output of token {t}")
            if slot >= 0 and i + 1 == accepted[n]:
                want_c[slot], want_s[slot] = c_d[slot], s_d[slot]
    assert_close(s_v, want_s, 1e-5, "committed states")
    assert_close(c_v, want_c, 0.0, "committed conv windows")


def test_reference_verify_of_a_batch_equals_each_sequence_alone():
    """The reference steps every sequence together (shorter ones padded with g = 0, beta = 0): a ragged batch
    with an empty and a padded sequence gives each sequence what verifying it alone gives, its stash included;
    a batch with no live sequence gives zeros and leaves the pools as they were."""
    layer = Layer("cpu", torch.float32, ratio=2, seed=41)
    lengths, slots = [3, 0, 1, 5, 2], [5, 0, 2, -1, 7]
    cu, idx, mixed, z, a, b = _verify_case(layer, lengths, slots)
    T = sum(lengths)
    c, s = layer.pools()
    st = layer.stash(T)
    out = ref.gdn_verify(mixed, z, a, b, cu_seqlens=cu, conv_state=c, ssm_state=s, state_indices=idx, stash=st,
                         **layer.kw())
    bounds = cu.tolist()
    for n, slot in enumerate(slots):
        lo, hi = bounds[n], bounds[n + 1]
        if slot < 0 or hi == lo:
            assert (out[lo:hi] == 0).all(), f"sequence {n}: padded or empty, zero output"
            continue
        alone = layer.stash(hi - lo)
        o = ref.gdn_verify(mixed[lo:hi], z[lo:hi], a[lo:hi], b[lo:hi], cu_seqlens=cu_seqlens([hi - lo], "cpu"),
                           conv_state=c, ssm_state=s, state_indices=idx[n : n + 1], stash=alone, **layer.kw())
        assert_close(out[lo:hi], o, 1e-6, f"sequence {n}: output")
        for name in ("x", "k", "g", "delta"):
            assert_close(getattr(st, name)[lo:hi], getattr(alone, name), 1e-6, f"sequence {n}: stash.{name}")
    none = torch.full((len(slots),), -1, dtype=torch.int32)
    out = ref.gdn_verify(mixed, z, a, b, cu_seqlens=cu, conv_state=c, ssm_state=s, state_indices=none,
                         stash=layer.stash(T), **layer.kw())
    assert (out == 0).all()
    assert torch.equal(c, layer.conv_state) and torch.equal(s, layer.ssm_state), "verify must not touch pools"


def test_verify_triton_matches_reference_bf16(device):
    layer = Layer(device, torch.bfloat16, ratio=4, seed=5)
    lengths, idx_list = [3, 1, 6], [0, 7, 4]
    cu, idx, mixed, z, a, b = _verify_case(layer, lengths, idx_list)
    outs, stashes, pools = [], [], []
    for ops in (ref, tv):
        c, s = layer.pools()
        st = layer.stash(sum(lengths))
        outs.append(ops.gdn_verify(mixed, z, a, b, cu_seqlens=cu, conv_state=c, ssm_state=s, state_indices=idx,
                                   stash=st, **layer.kw()))
        acc = torch.tensor([3, 0, 4], dtype=torch.int32, device=device)
        ops.gdn_commit(acc, cu_seqlens=cu, state_indices=idx, conv_state=c, ssm_state=s, stash=st)
        stashes.append(st)
        pools.append((c, s))
    assert_close(outs[1], outs[0], TOL[torch.bfloat16], "output")
    for name in ("x", "k", "g", "delta"):
        assert_close(getattr(stashes[1], name), getattr(stashes[0], name), 1e-2, f"stash.{name}")
    assert_close(pools[1][1], pools[0][1], 1e-2, "state")
    assert_close(pools[1][0], pools[0][0], 0.0, "conv")


def test_commit_clamps_and_reference_rejects_bad_counts(device):
    layer = Layer(device, torch.float32, seed=3)
    cu, idx, mixed, z, a, b = _verify_case(layer, [3], [2])
    st = layer.stash(3)
    tv.gdn_verify(mixed, z, a, b, cu_seqlens=cu, conv_state=layer.conv_state, ssm_state=layer.ssm_state,
                  state_indices=idx, stash=st, **layer.kw())
    with pytest.raises(ValueError, match="outside 0..3"):
        ref.gdn_commit(torch.tensor([4], device=device), cu_seqlens=cu, state_indices=idx,
                       conv_state=layer.conv_state.clone(), ssm_state=layer.ssm_state.clone(), stash=st)
    c1, s1 = layer.pools()
    c2, s2 = layer.pools()
    tv.gdn_commit(torch.tensor([9], dtype=torch.int32, device=device), cu_seqlens=cu, state_indices=idx,
                  conv_state=c1, ssm_state=s1, stash=st)
    tv.gdn_commit(torch.tensor([3], dtype=torch.int32, device=device), cu_seqlens=cu, state_indices=idx,
                  conv_state=c2, ssm_state=s2, stash=st)
    assert torch.equal(s1, s2) and torch.equal(c1, c2), "the kernel clamps counts to T_n"


def test_layer_ops_raise_on_bad_shapes(device):
    layer = Layer(device, torch.float32, seed=1)
    mixed, z, a, b = layer.tokens(2)
    idx = torch.tensor([0, 1], dtype=torch.int32, device=device)
    c, s = layer.pools()
    with pytest.raises(ValueError, match="mixed_qkv width"):
        tr.gdn_decode(mixed[:, :-2], z, a, b, conv_state=c, ssm_state=s, state_indices=idx, **layer.kw())
    with pytest.raises(ValueError, match="unsupported gate activation"):
        tr.gdn_decode(mixed, z, a, b, conv_state=c, ssm_state=s, state_indices=idx,
                      **dict(layer.kw(), norm_activation="relu"))
    with pytest.raises(ValueError, match="VerifyStash"):
        st = layer.stash(1)
        tv.gdn_verify(mixed, z, a, b, cu_seqlens=cu_seqlens([2], device), conv_state=c, ssm_state=s,
                      state_indices=idx[:1], stash=st, **layer.kw())


# ---- real shapes on the GPU (Qwen3.5-35B-A3B / Qwen3-Next: 16 key heads, 32 value heads; 27B: 48) ----------

# The one-launch launch shapes the defaults take (dispatch.default_decode_config), with and without PDL.
REAL_ONE_LAUNCH = [
    tr.RecurrentConfig(bv=16, num_warps=1, one_launch=True),
    tr.RecurrentConfig(bv=16, num_warps=1, one_launch=True, pdl=True),
    tr.RecurrentConfig(bv=32, num_warps=2, one_launch=True),
    tr.RecurrentConfig(bv=32, num_warps=2, one_launch=True, pdl=True),
]


def _real_layer(hv: int, slots: int, seed: int):
    dev, bf, hk, d = "cuda", torch.bfloat16, 16, 128
    g = gen(seed)
    dc = 2 * hk * d + hv * d
    kw = dict(conv_weight=randn(dc, 4, g=g, dtype=bf, device=dev, scale=0.5),
              A_log=torch.linspace(-3, 1, hv, device=dev), dt_bias=randn(hv, g=g, device=dev, scale=0.5),
              norm_weight=(torch.rand(d, generator=g) + 0.5).to(dev, bf), eps=1e-6, scale=d ** -0.5)
    pools = (randn(slots, 3, dc, g=g, dtype=bf, device=dev), randn(slots, hv, d, d, g=g, device=dev, scale=0.1))

    def tokens(n):
        return (randn(n, dc, g=g, dtype=bf, device=dev), randn(n, hv, d, g=g, dtype=bf, device=dev),
                randn(n, hv, g=g, dtype=bf, device=dev), randn(n, hv, g=g, dtype=bf, device=dev))
    return kw, pools, tokens


@pytest.mark.gpu
@pytest.mark.parametrize("hv", [32, 48])
def test_one_launch_decode_real_shape(hv):
    """Every one-launch configuration the benchmark times, and the default rule (PDL on the H200), at
    B = 1, 3, 16 (padded row, slots out of order): == the reference over two steps run back to back (the
    second, launched programmatically, reads the state the first wrote), == the two-launch path up to
    fp32 rounding."""
    configs = REAL_ONE_LAUNCH if hv == 32 else [REAL_ONE_LAUNCH[0], REAL_ONE_LAUNCH[-1]]
    for B in (1, 3, 16):
        kw, (conv0, ssm0), tokens = _real_layer(hv, 2 * B + 1, seed=B)
        idx = torch.randperm(2 * B + 1, generator=gen(B))[:B].to("cuda", torch.int32)
        if B > 1:
            idx[B // 2] = -1
        steps = [tokens(B) for _ in range(2)]
        runs = {}
        for name, cfg in [("reference", None), ("two launches", tr.RecurrentConfig(bv=32, num_warps=2)),
                          ("default", None)] + [(str(c), c) for c in configs]:
            conv, ssm = conv0.clone(), ssm0.clone()
            op = ref.gdn_decode if name == "reference" else tr.gdn_decode
            extra = {} if cfg is None else {"config": cfg}
            outs = [op(*t, conv_state=conv, ssm_state=ssm, state_indices=idx, **kw, **extra) for t in steps]
            runs[name] = (torch.stack(outs), conv, ssm)
        want, two = runs.pop("reference"), runs.pop("two launches")
        assert_close(two[0], want[0], 2e-2, f"B={B} two launches output")
        for name, (out, conv, ssm) in runs.items():
            assert_close(out, want[0], 2e-2, f"B={B} {name} output")
            assert_close(ssm, want[2], 1e-4, f"B={B} {name} state")
            assert torch.equal(conv, want[1]), f"B={B} {name} conv windows"
            # other tile shapes sum over K in another order: fp32 rounding, at most a bf16 ulp in the output
            assert_close(out, two[0], 8e-3, f"B={B} {name} vs two launches")
            assert_close(ssm, two[2], 1e-5, f"B={B} {name} state vs two launches")
        assert not group_counters(torch.device("cuda", torch.cuda.current_device()), B * 16).any()


@pytest.mark.gpu
def test_one_launch_decode_pdl_chain_in_graph():
    """Four programmatically launched decodes back to back in one CUDA graph, each reading the state and
    window the one before wrote (same slots), with other kernels writing their inputs in between or
    not: == the reference step by step (nothing is read before griddepcontrol.wait)."""
    B = 1
    kw, (conv0, ssm0), tokens = _real_layer(32, 3, seed=11)
    idx = torch.tensor([2], dtype=torch.int32, device="cuda")
    steps = [tokens(B) for _ in range(4)]
    cfg = tr.default_decode_config(B, 16, 32, 128, pdl=True)
    assert cfg.pdl and cfg.one_launch
    conv_r, ssm_r = conv0.clone(), ssm0.clone()
    want = [ref.gdn_decode(*t, conv_state=conv_r, ssm_state=ssm_r, state_indices=idx, **kw) for t in steps]
    conv_g, ssm_g = conv0.clone(), ssm0.clone()
    inputs = [tuple(x.clone() for x in t) for t in steps]
    tr.gdn_decode(*inputs[0], conv_state=conv_g.clone(), ssm_state=ssm_g.clone(), state_indices=idx, config=cfg,
                  **kw)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = []
        for i, t in enumerate(inputs):
            if i % 2:  # a kernel writing this call's inputs right before it
                t[0].copy_(steps[i][0])
            outs.append(tr.gdn_decode(*t, conv_state=conv_g, ssm_state=ssm_g, state_indices=idx, config=cfg, **kw))
    graph.replay()
    torch.cuda.synchronize()
    for i in range(4):
        assert_close(outs[i], want[i], 2e-2, f"step {i}")
    assert_close(ssm_g, ssm_r, 1e-4, "state")
    assert torch.equal(conv_g, conv_r), "conv windows"


@pytest.mark.gpu
def test_one_launch_decode_graph_replays():
    """The one-launch decode captured in a CUDA graph: three replays == three eager steps (the counters
    reset themselves inside the graph)."""
    B = 2
    kw, (conv0, ssm0), tokens = _real_layer(32, 4, seed=7)
    idx = torch.tensor([3, 1], dtype=torch.int32, device="cuda")
    mixed, z, a, b = tokens(B)
    cfg = tr.RecurrentConfig(bv=32, num_warps=2, one_launch=True)
    conv_e, ssm_e = conv0.clone(), ssm0.clone()
    eager = [tr.gdn_decode(mixed, z, a, b, conv_state=conv_e, ssm_state=ssm_e, state_indices=idx, config=cfg, **kw)
             for _ in range(3)]
    conv_g, ssm_g = conv0.clone(), ssm0.clone()
    tr.gdn_decode(mixed, z, a, b, conv_state=conv_g.clone(), ssm_state=ssm_g.clone(), state_indices=idx,
                  config=cfg, **kw)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tr.gdn_decode(mixed, z, a, b, conv_state=conv_g, ssm_state=ssm_g, state_indices=idx, config=cfg, **kw)
    for step in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager[step]), f"replay {step}"
    assert torch.equal(ssm_g, ssm_e) and torch.equal(conv_g, conv_e)


# One-launch verify configurations the benchmark times (benchmarks/gdn_kernels.py verify_path_variants).
REAL_ONE_LAUNCH_VERIFY = [
    tr.RecurrentConfig(bv=bv, num_warps=w, one_launch=True, pdl=True)
    for bv, w in [(16, 1), (8, 1), (16, 2), (32, 2), (16, 4), (32, 4)]
] + [tr.RecurrentConfig(bv=16, num_warps=2, one_launch=True),
     tr.RecurrentConfig(bv=128, num_warps=4, one_launch=True),  # whole rows: the local norm
     tr.RecurrentConfig(bv=8, num_warps=1, one_launch=True, pdl=True, qk_prepass=True),
     tr.RecurrentConfig(bv=8, num_warps=1, one_launch=True, qk_prepass=True),
     tr.RecurrentConfig(bv=8, num_warps=1, one_launch=True, pdl=True, qk_prepass=True, gram=True),
     tr.RecurrentConfig(bv=8, num_warps=1, one_launch=True, pdl=True, gram=True),
     tr.RecurrentConfig(bv=16, num_warps=2, one_launch=True, pdl=True, gram=True)]


@pytest.mark.gpu
@pytest.mark.parametrize("config", [None] + REAL_ONE_LAUNCH_VERIFY,
                         ids=lambda c: "default" if c is None else
                         f"bv{c.bv}-w{c.num_warps}{'-pdl' * c.pdl}{'-qk-prepass' * c.qk_prepass}{'-gram' * c.gram}")
def test_one_launch_verify_real_shape(config):
    """Every one-launch verify configuration the benchmark times and the default rule (None), at B = 1
    (T = 2, 4) and B = 2 (ragged 3 + 5, and a padded row): outputs == the three launches up to fp32
    rounding (a bf16 ulp), == the reference; the stash's live rows equal; verify + commit (all but one
    accepted) leaves the same pools as the three launches + commit."""
    for lengths, slots in (([2], [1]), ([4], [2]), ([3, 5], [4, 0]), ([4, 4], [-1, 3])):
        B, T = len(lengths), sum(lengths)
        kw, (conv0, ssm0), tokens = _real_layer(32, 5, seed=T + B)
        mixed, z, a, b = tokens(T)
        cu = cu_seqlens(lengths, "cuda")
        idx = torch.tensor(slots, dtype=torch.int32, device="cuda")
        acc = torch.tensor([max(n - 1, 0) for n in lengths], dtype=torch.int32, device="cuda")
        live = torch.cat([torch.full((n,), s >= 0) for n, s in zip(lengths, slots)]).to("cuda")
        assert dispatch.default_verify_config(B, T, 16, 32, 128, pdl=True).one_launch
        runs = {}
        for name, cfg in [("reference", None), ("three", dispatch.default_tokens_config(B * 32 * 4, 128)),
                          (str(config), config)]:
            conv, ssm = conv0.clone(), ssm0.clone()
            st = ref.VerifyStash.empty(T, conv_dim=mixed.shape[1], num_k_heads=16, head_k_dim=128, num_v_heads=32,
                                       head_v_dim=128, dtype=torch.bfloat16, device="cuda")
            ops = ref if name == "reference" else tv
            out = ops.gdn_verify(mixed, z, a, b, cu_seqlens=cu, conv_state=conv, ssm_state=ssm, state_indices=idx,
                                 stash=st, **kw, **({} if cfg is None else {"config": cfg}))
            assert torch.equal(conv, conv0) and torch.equal(ssm, ssm0), f"{name}: verify must not touch pools"
            ops.gdn_commit(acc, cu_seqlens=cu, state_indices=idx, conv_state=conv, ssm_state=ssm, stash=st)
            runs[name] = (out, st, conv, ssm)
        want, three = runs.pop("reference"), runs.pop("three")
        assert_close(three[0], want[0], 2e-2, f"{lengths} three launches output")
        for name, (out, st, conv, ssm) in runs.items():
            where = f"{lengths} {slots} {name}"
            assert_close(out, want[0], 2e-2, f"{where} output")
            assert_close(out, three[0], 8e-3, f"{where} output vs three launches")
            assert (out[~live] == 0).all(), f"{where} padded rows"
            assert torch.equal(st.x[:T], three[1].x[:T]), f"{where} stash.x"
            assert_close(st.k[live], three[1].k[live], 1e-6, f"{where} stash.k")
            assert_close(st.g, three[1].g, 1e-6, f"{where} stash.g")
            assert_close(st.delta[live], three[1].delta[live], 1e-5, f"{where} stash.delta")
            assert_close(ssm, three[3], 1e-5, f"{where} committed state")
            assert torch.equal(conv, three[2]), f"{where} committed windows"
        assert not group_counters(torch.device("cuda", torch.cuda.current_device()), B * 32).any()


@pytest.mark.gpu
def test_one_launch_verify_pdl_chain_in_graph():
    """verify, commit, verify, commit in one CUDA graph (the default one-launch verify, programmatic on the
    H200, reading the pools the commit before it wrote) == the same steps through the reference ops."""
    kw, (conv0, ssm0), tokens = _real_layer(32, 3, seed=12)
    idx = torch.tensor([2], dtype=torch.int32, device="cuda")
    cu = cu_seqlens([4], "cuda")
    steps = [tokens(4) for _ in range(2)]
    acc = torch.tensor([3], dtype=torch.int32, device="cuda")
    cfg = dispatch.default_verify_config(1, 4, 16, 32, 128, pdl=True)
    assert cfg.one_launch and cfg.pdl

    def stash():
        return ref.VerifyStash.empty(4, conv_dim=steps[0][0].shape[1], num_k_heads=16, head_k_dim=128,
                                     num_v_heads=32, head_v_dim=128, dtype=torch.bfloat16, device="cuda")
    conv_r, ssm_r = conv0.clone(), ssm0.clone()
    want = []
    for t in steps:
        st = stash()
        want.append(ref.gdn_verify(*t, cu_seqlens=cu, conv_state=conv_r, ssm_state=ssm_r, state_indices=idx,
                                   stash=st, **kw))
        ref.gdn_commit(acc, cu_seqlens=cu, state_indices=idx, conv_state=conv_r, ssm_state=ssm_r, stash=st)
    conv_g, ssm_g = conv0.clone(), ssm0.clone()
    stashes = [stash(), stash()]
    tv.gdn_verify(*steps[0], cu_seqlens=cu, conv_state=conv_g.clone(), ssm_state=ssm_g.clone(), state_indices=idx,
                  stash=stash(), config=cfg, **kw)  # compile outside the capture
    tv.gdn_commit(acc, cu_seqlens=cu, state_indices=idx, conv_state=conv_g.clone(), ssm_state=ssm_g.clone(),
                  stash=stashes[0])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = []
        for t, st in zip(steps, stashes):
            outs.append(tv.gdn_verify(*t, cu_seqlens=cu, conv_state=conv_g, ssm_state=ssm_g, state_indices=idx,
                                      stash=st, config=cfg, **kw))
            tv.gdn_commit(acc, cu_seqlens=cu, state_indices=idx, conv_state=conv_g, ssm_state=ssm_g, stash=st)
    graph.replay()
    torch.cuda.synchronize()
    for i in range(2):
        assert_close(outs[i], want[i], 2e-2, f"step {i}")
    assert_close(ssm_g, ssm_r, 1e-4, "state")
    assert torch.equal(conv_g, conv_r), "conv windows"
