"""The conv of a GDN layer's decode step in its input projection's epilogue (linear.rms_norm_linear_conv) and
the bare recurrence behind it (gdn_decode(conv_applied=True)): the op against its reference and against the
old path's own pieces (the same GEMV's projection, the conv gdn_decode computes), windows after the step,
padded slots untouched, the pair == rms_norm_linear + gdn_decode bit for bit (outputs, state and window
pools), the model's decode == the old path's, bad inputs; on the GPU at the 35B-A3B shape the PDL chain
eager and in a CUDA graph."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch

from deltaserve.ops.conv1d import reference as conv_ref
from deltaserve.ops.gdn import reference as gdn_ref
from deltaserve.ops.gdn import triton_recurrent as tr
from deltaserve.ops.gdn.triton_steps import group_counters
from deltaserve.ops.linear import reference as ref
from deltaserve.ops.linear import triton as tri

from .helpers import assert_close, gen, randn

C = tri.LinearConfig
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
# few programs for the interpreter; several K steps per program; row blocks straddling the conv channels
CONFIGS = {"fma": C(block_n=16, block_k=32, warps=2, stages=1), "dot": C(block_n=16, block_k=32, warps=4, dot=True),
           "default": None, "fma-window-prefetch": C(block_n=16, block_k=32, warps=2, stages=1)}


def _tiles(name):
    return {"config": CONFIGS[name], "window_prefetch": name.endswith("window-prefetch")}


class Proj:
    """A GDN layer's input projection at a small shape: hk key heads, hv value heads, head dims 16,
    rows [q|k|v conv channels (D) | z | b | a], conv width 4, a pool of `slots` windows and states."""

    def __init__(self, device, dtype, *, hk=1, hv=2, d=16, K=40, slots=6, seed=0):
        g = gen(seed)
        self.hk, self.hv, self.d, self.K = hk, hv, d, K
        self.D = 2 * hk * d + hv * d
        self.N = self.D + hv * d + 2 * hv
        self.dtype, self.device, self.g = dtype, device, g
        self.weight = randn(self.N, K, g=g, dtype=dtype, device=device, scale=K ** -0.5)
        self.norm_weight = randn(K, g=g, dtype=dtype, device=device, scale=0.3)
        self.conv_weight = randn(self.D, 4, g=g, dtype=dtype, device=device, scale=0.5)
        self.conv_state = randn(slots, 3, self.D, g=g, dtype=dtype, device=device)
        self.ssm_state = randn(slots, hv, d, d, g=g, device=device, scale=0.3)
        self.A_log = torch.linspace(-3.0, 1.0, hv).to(device)
        self.dt_bias = randn(hv, g=g, device=device, scale=0.5)
        self.gdn_norm = (torch.rand(d, generator=g) + 0.5).to(dtype=dtype, device=device)

    def inputs(self, M):
        return (randn(M, self.K, g=self.g, dtype=self.dtype, device=self.device, scale=2.0),
                randn(M, self.K, g=self.g, dtype=self.dtype, device=self.device))

    def split(self, y):
        T, hv, d = y.shape[0], self.hv, self.d
        mixed, z, b, a = y.split([self.D, hv * d, hv, hv], dim=-1)
        return mixed, z.view(T, hv, d), a, b

    def gdn_kw(self):
        return dict(conv_weight=self.conv_weight, A_log=self.A_log, dt_bias=self.dt_bias, norm_weight=self.gdn_norm,
                    eps=1e-6, scale=self.d ** -0.5)


def _slots(idx, device):
    return torch.tensor(idx, dtype=torch.int32, device=device)


@pytest.mark.parametrize("cfg", list(CONFIGS), ids=list(CONFIGS))
@pytest.mark.parametrize("M,dtype,residual", [(1, torch.bfloat16, True), (1, torch.float32, False),
                                              (3, torch.bfloat16, True), (3, torch.float32, True)])
def test_op_is_the_projection_then_the_conv(cfg, M, dtype, residual, device):
    """y's z/b/a columns, the normed rows and the sum are rms_norm_linear's (same kernel, same tiles); the
    conv columns are the conv update of that projection (reference conv) and the windows after it are the
    reference conv's exactly; a padded row (slot -1) gives zeros there and no window changes; the whole is
    the reference op within the GEMV tolerance."""
    p = Proj(device, dtype, seed=M + 7 * residual)
    x, r = p.inputs(M)
    r = r if residual else None
    idx = _slots([4, -1, 1][:M], device)
    pools = [p.conv_state.clone() for _ in range(3)]
    y, h, s = tri.rms_norm_linear_conv(x, r, p.norm_weight, 1e-6, p.weight, conv_weight=p.conv_weight,
                                       conv_state=pools[0], state_indices=idx, **_tiles(cfg))
    if cfg == "default" and M > 1:
        y0, h0, s0 = tri.rms_norm_linear(x, r, p.norm_weight, 1e-6, p.weight)   # norm kernel + plain tiles
    else:
        y0, h0, s0 = tri.rms_norm_linear(x, r, p.norm_weight, 1e-6, p.weight, config=CONFIGS[cfg])
    assert torch.equal(y[:, p.D:], y0[:, p.D:]) and torch.equal(h, h0) and torch.equal(s, s0)
    want = conv_ref.causal_conv1d_update(y0[:, :p.D], p.conv_weight, conv_state=pools[1], state_indices=idx)
    assert_close(y[:, :p.D], want, 1e-6 if dtype == torch.float32 else 8e-3, "conv columns")
    assert torch.equal(pools[0], pools[1]), "windows after the step"
    if M > 1:
        assert (y[1, :p.D] == 0).all(), "a padded row's conv columns are zero"
    untouched = [i for i in range(pools[0].shape[0]) if i not in idx.tolist()]
    assert torch.equal(pools[0][untouched], p.conv_state[untouched]), "windows of other slots changed"
    y_r, h_r, s_r = ref.rms_norm_linear_conv(x, r, p.norm_weight, 1e-6, p.weight, conv_weight=p.conv_weight,
                                             conv_state=pools[2], state_indices=idx)
    assert_close(y, y_r, TOL[dtype], "vs the reference op")
    assert torch.equal(s, s_r)
    assert_close(pools[0], pools[2], TOL[dtype], "windows vs the reference op")


@pytest.mark.parametrize("gated_norm,tiles,dcfg", [
    (g, "fma", d) for g in (False, True) for d in ("default", "one-launch bv8", "two launches")] + [
    (False, "fma-window-prefetch", "default")])
def test_pair_equals_the_old_path_bit_for_bit(gated_norm, tiles, dcfg, device):
    """Two decode steps: rms_norm_linear_conv + gdn_decode(conv_applied=True) == rms_norm_linear + gdn_decode
    (the conv inside) bit for bit: outputs, state pool, conv pool; padded row zero; counters left at zero."""
    dtype = torch.bfloat16
    p = Proj(device, dtype, hk=1, hv=2, seed=11)
    cfg = {"default": None, "one-launch bv8": tr.RecurrentConfig(bv=8, num_warps=1, one_launch=True),
           "two launches": tr.RecurrentConfig(bv=8, num_warps=1)}[dcfg]
    extra = {} if cfg is None else {"config": cfg}
    idx = _slots([5, -1, 2], device)
    c_old, s_old = p.conv_state.clone(), p.ssm_state.clone()
    c_new, s_new = p.conv_state.clone(), p.ssm_state.clone()
    for step in range(2):
        x, r = p.inputs(3)
        y0, _, _ = tri.rms_norm_linear(x, r, p.norm_weight, 1e-6, p.weight, config=CONFIGS[tiles])
        y1, _, _ = tri.rms_norm_linear_conv(x, r, p.norm_weight, 1e-6, p.weight, conv_weight=p.conv_weight,
                                            conv_state=c_new, state_indices=idx, **_tiles(tiles))
        o0 = tr.gdn_decode(*p.split(y0), conv_state=c_old, ssm_state=s_old, state_indices=idx, gated_norm=gated_norm,
                           **p.gdn_kw(), **extra)
        o1 = tr.gdn_decode(*p.split(y1), conv_state=c_new, ssm_state=s_new, state_indices=idx, gated_norm=gated_norm,
                           conv_applied=True, **p.gdn_kw(), **extra)
        assert torch.equal(o1, o0), f"output step {step}"
        assert (o1[1] == 0).all()
    assert torch.equal(s_new, s_old) and torch.equal(c_new, c_old), "pools"
    for untouched in (0, 1, 3, 4):
        assert torch.equal(s_new[untouched], p.ssm_state[untouched])
        assert torch.equal(c_new[untouched], p.conv_state[untouched])
    assert not group_counters(torch.device(device), 3).any()


def test_conv_applied_leaves_the_window_alone_and_matches_the_reference(device):
    """gdn_decode(conv_applied=True) reads no window (a poisoned pool changes nothing and stays as it was)
    and equals the reference's conv_applied path, which equals the old reference on the conv's output."""
    p = Proj(device, torch.float32, hk=2, hv=4, seed=3)
    idx = _slots([1, 3, -1], device)
    mixed, z, a, b = p.split(randn(3, p.N, g=p.g, device=device))
    conv = conv_ref.causal_conv1d_update(mixed, p.conv_weight, conv_state=p.conv_state.clone(), state_indices=idx)
    poisoned = torch.full_like(p.conv_state, float("nan"))
    s_tri, s_ref, s_old = p.ssm_state.clone(), p.ssm_state.clone(), p.ssm_state.clone()
    got = tr.gdn_decode(conv, z, a, b, conv_state=poisoned, ssm_state=s_tri, state_indices=idx, conv_applied=True,
                        **p.gdn_kw())
    want = gdn_ref.gdn_decode(conv, z, a, b, conv_state=poisoned, ssm_state=s_ref, state_indices=idx,
                              conv_applied=True, **p.gdn_kw())
    old = gdn_ref.gdn_decode(mixed, z, a, b, conv_state=p.conv_state.clone(), ssm_state=s_old, state_indices=idx,
                             **p.gdn_kw())
    assert poisoned.isnan().all(), "the window pool was written"
    assert_close(got, want, 1e-5, "triton vs reference")
    assert torch.equal(want, old) and torch.equal(s_ref, s_old), "reference conv_applied vs old"
    assert_close(s_tri, s_ref, 1e-5, "state")


@pytest.mark.parametrize("change, match", [
    (lambda a: {**a, "state_indices": a["state_indices"][:1]}, r"state_indices must be contiguous int32/int64 \[2\]"),
    (lambda a: {**a, "conv_state": a["conv_state"][:, :2]}, "conv_state must be a contiguous pool"),
    (lambda a: {**a, "conv_weight": a["conv_weight"].double()}, "must be in x's dtype"),
    (lambda a: {**a, "conv_weight": torch.zeros(300, 4)}, "must be among the N"),
    (lambda a: {**a, "config": C(block_n=4, block_k=16, split_k=2)}, "split_k=2: the conv epilogue needs"),
    (lambda a: {**a, "window_prefetch": True, "config": CONFIGS["dot"]}, "window_prefetch applies to the CUDA-core"),
])
def test_bad_inputs_raise(change, match, device):
    p = Proj(device, torch.float32, seed=1)
    x, r = p.inputs(2)
    args = change(dict(x=x, residual=r, norm_weight=p.norm_weight, eps=1e-6, weight=p.weight,
                       conv_weight=p.conv_weight, conv_state=p.conv_state.clone(),
                       state_indices=_slots([0, 1], device)))
    with pytest.raises(ValueError, match=match):
        tri.rms_norm_linear_conv(**args)


def test_signature_matches_the_reference():
    want = [(q.name, q.kind) for q in inspect.signature(ref.rms_norm_linear_conv).parameters.values()]
    got = [(q.name, q.kind) for q in inspect.signature(tri.rms_norm_linear_conv).parameters.values()
           if q.name not in ("config", "window_prefetch")]
    assert got == want
    dec = [q.name for q in inspect.signature(gdn_ref.gdn_decode).parameters.values()]
    assert dec == [q.name for q in inspect.signature(tr.gdn_decode).parameters.values() if q.name != "config"]


def test_default_tiles_never_split():
    for M in (1, 2, 4, 8, 16):
        for N, K in ((12352, 2048), (200, 64), (16480, 5120)):
            cfg = tri.default_conv_config(M, N, K)
            assert cfg is not None and cfg.split_k == 1
            assert dataclasses.replace(cfg, split_k=tri.default_linear_config(M, N, K).split_k) == \
                tri.default_linear_config(M, N, K)


# ---- the model: decode with the conv in the projection == the old path ---------------------------------------

def _batch(seqs, device):
    from .test_rms_norm_linear import _batch as batch

    return batch(seqs, device)


def test_model_decode_equals_the_old_path(tiny_model, device):
    """A tiny Qwen3.5-MoE model (3 GDN layers, bf16) whose decode steps run rms_norm_linear_conv +
    gdn_decode(conv_applied) against the same model with the conv in gdn_decode: equal logits and pools
    bit for bit. Prefill of 4 sequences, a decode step of the 4, then a step of one sequence (both folded by
    the default rule, CONV_FOLD_ROWS). On the CPU the Triton ops run in the interpreter with wide tiles; on
    the GPU with their defaults."""
    from deltaserve.batch import CacheBuffers
    from deltaserve.models.loader import load_model
    from deltaserve.ops import select_kernels
    from tests.conftest import TinySpec, random_ids

    dtype = torch.bfloat16
    path = tiny_model(TinySpec(family="qwen3_5_moe", ratio=2, seed=44, num_layers=4))
    base = select_kernels(device, force_reference=True)
    wide = C(block_n=128, block_k=64) if device.type == "cpu" else None

    def proj(x, *args, **kw):
        return tri.rms_norm_linear(x, *args, config=wide if x.shape[0] <= 4 else None, **kw)

    calls = []

    def proj_conv(x, *args, **kw):
        calls.append(x.shape[0])
        return tri.rms_norm_linear_conv(x, *args, config=wide if x.shape[0] <= 4 else None, **kw)

    triton_ops = {"rms_norm_linear": proj, "gdn_decode": tr.gdn_decode}
    old = dataclasses.replace(base, **triton_ops, backend={**base.backend, **dict.fromkeys(triton_ops, "triton")})
    new = dataclasses.replace(old, rms_norm_linear_conv=proj_conv, conv_fold_rows=tri.CONV_FOLD_ROWS,
                              backend={**old.backend, "rms_norm_linear_conv": "triton"})
    lo, hi = tri.CONV_FOLD_ROWS
    assert lo == 1 and hi >= 4, "the steps below are folded"
    prompts = [random_ids(n, seed=3 + n) for n in (5, 3, 4, 2)]
    steps = [[(p, 0, s) for s, p in enumerate(prompts)]]
    steps += [[([p[0]], len(p), s) for s, p in enumerate(prompts)]]
    steps += [[([prompts[1][1]], 4, 1)]]
    runs = []
    for kernels in (old, new):
        model = load_model(path, device=device, dtype=dtype, kernels=kernels, show_progress=False)
        cache = CacheBuffers.allocate(model.config, num_slots=4, num_blocks=16, block_size=16, device=device,
                                      dtype=dtype)
        with torch.inference_mode():
            logits = [model.compute_logits(model(_batch(s, device), cache)) for s in steps]
        runs.append((torch.cat(logits), cache.conv.clone(), cache.ssm.clone()))
    assert calls == [4] * 3 + [1] * 3, "the GDN layers' decode steps fold the conv"
    assert torch.equal(runs[1][0], runs[0][0]), "logits"
    assert torch.equal(runs[1][1], runs[0][1]) and torch.equal(runs[1][2], runs[0][2]), "pools"


def test_fold_rule(tiny_model):
    """Chosen by the op from the batch: never with the reference kernels (the CPU path: conv_fold_rows (0, 0));
    with the Triton op's rule, decode-only batches of CONV_FOLD_ROWS sequences fold (the op gets the decode
    slots and the layer's conv window pool), prefills, mixed batches and other sizes keep the conv in the
    recurrence."""
    from deltaserve.models.loader import load_model
    from deltaserve.ops import select_kernels
    from tests.conftest import TinySpec

    lo, hi = tri.CONV_FOLD_ROWS
    assert 1 <= lo <= hi
    path = tiny_model(TinySpec(family="qwen3_5_moe", ratio=2, seed=44, num_layers=4))
    k = select_kernels("cpu")
    assert k.conv_fold_rows == (0, 0)
    seen = []

    def recorder(x, residual, norm_weight, eps, weight, **kw):
        seen.append(kw)
        return ref.rms_norm_linear_conv(x, residual, norm_weight, eps, weight, **kw)

    folding = dataclasses.replace(k, rms_norm_linear_conv=recorder, conv_fold_rows=tri.CONV_FOLD_ROWS)
    for kernels, rows in ((k, (0, 0)), (folding, (lo, hi))):
        model = load_model(path, device="cpu", dtype=torch.float32, kernels=kernels, show_progress=False)
        layer = model.layers[0]
        gdn, norm = layer.linear_attn, layer.input_layernorm
        pool = torch.zeros(hi + 1, 3, gdn.conv_dim)

        def project(batch, gdn=gdn, norm=norm, pool=pool):
            seen.clear()
            x = torch.randn(batch.num_tokens, gdn.in_proj.in_features)
            return gdn.project_input(x, None, norm, batch, pool).conv_applied

        for n in range(1, hi + 2):
            assert project(_batch([([1], 3, s) for s in range(n)], "cpu")) == (rows[0] <= n <= rows[1] > 0), n
            if seen:
                assert seen[0]["conv_state"] is pool and seen[0]["conv_weight"] is gdn.conv_weight
                assert seen[0]["state_indices"].tolist() == list(range(n))
        mixed = [([1, 2], 0, 0)] + [([2], 5, s) for s in range(1, lo + 1)]
        assert not project(_batch(mixed, "cpu")), "a mixed batch"
        assert not project(_batch([([1, 2], 0, 0)], "cpu")), "a prefill"
        assert not seen


# ---- real shapes on the GPU (Qwen3.5-35B-A3B GDN layer: H 2048, 16 key / 32 value heads of 128) -------------

def _real(seed: int, slots: int):
    dev, bf = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(seed)
    H, hk, hv, d = 2048, 16, 32, 128
    D = 2 * hk * d + hv * d
    N = D + hv * d + 2 * hv

    def rn(*shape, scale=1.0, dtype=bf):
        return (torch.randn(*shape, device=dev, generator=g) * scale).to(dtype)

    p = dict(weight=rn(N, H, scale=H ** -0.5), norm_weight=rn(H, scale=0.3), conv_weight=rn(D, 4, scale=0.5),
             A_log=torch.linspace(-3, 1, hv, device=dev), dt_bias=rn(hv, scale=0.5, dtype=torch.float32),
             gdn_norm=(torch.rand(d, device=dev, generator=g) + 0.5).to(bf),
             out_w=rn(H, hv * d, scale=(hv * d) ** -0.5),
             conv_state=rn(slots, 3, D), ssm_state=rn(slots, hv, d, d, scale=0.1, dtype=torch.float32))
    return p, D, hv, d, rn


def _layer_step(p, D, hv, d, x, r, idx, conv_state, ssm_state, fold: bool, window_prefetch: bool = False):
    """norm + in_proj, gdn_decode, gated out_proj as the layer runs a decode step of len(idx) tokens."""
    kw = dict(conv_weight=p["conv_weight"], A_log=p["A_log"], dt_bias=p["dt_bias"], norm_weight=p["gdn_norm"],
              eps=1e-6, scale=d ** -0.5, conv_state=conv_state, ssm_state=ssm_state, state_indices=idx)
    if fold:
        y, _, s = tri.rms_norm_linear_conv(x, r, p["norm_weight"], 1e-6, p["weight"], conv_weight=p["conv_weight"],
                                           conv_state=conv_state, state_indices=idx, window_prefetch=window_prefetch)
    else:
        y, _, s = tri.rms_norm_linear(x, r, p["norm_weight"], 1e-6, p["weight"])
    T = x.shape[0]
    mixed, z2, b, a = y.split([D, hv * d, hv, hv], dim=-1)
    o = tr.gdn_decode(mixed, z2.view(T, hv, d), a, b, gated_norm=T > 1, conv_applied=fold, **kw)
    if T == 1:
        return tri.gated_linear(o.view(1, -1), z2, p["out_w"], norm_weight=p["gdn_norm"], activation="silu"), s
    return tri.linear(o.view(T, -1), p["out_w"]), s


@pytest.mark.gpu
def test_real_shape_layer_step_equals_the_old_path_gpu():
    """B = 1 (CUDA-core GEMV, norm folded, PDL chain), 3 (a padded row) and 8 (tensor-core GEMV after the
    norm kernel): three layer steps back to back with the conv in the projection == the old path, bit for bit
    (outputs, pools); at B = 1 also with window_prefetch (its prefetch before griddepcontrol.wait runs on
    the GPU only); the reference within bf16 tolerance at
    B = 1."""
    for B in (1, 3, 8):
        p, D, hv, d, rn = _real(B, 2 * B + 1)
        idx = torch.randperm(2 * B + 1, generator=gen(B))[:B].to("cuda", torch.int32)
        if B == 3:
            idx[1] = -1
        steps = [(rn(B, 2048, scale=2.0), rn(B, 2048)) for _ in range(3)]
        res = {}
        for arm in ("old", "fold", "fold, window prefetch") if B == 1 else ("old", "fold"):
            cs, ss = p["conv_state"].clone(), p["ssm_state"].clone()
            outs = [_layer_step(p, D, hv, d, x, r, idx, cs, ss, arm != "old", arm.endswith("prefetch"))[0]
                    for x, r in steps]
            res[arm] = (torch.stack(outs), cs, ss)
        for arm in res:
            assert torch.equal(res[arm][0], res["old"][0]), f"B={B} {arm} outputs"
            assert torch.equal(res[arm][1], res["old"][1]), f"B={B} {arm} conv pool"
            assert torch.equal(res[arm][2], res["old"][2]), f"B={B} {arm} state pool"
        if B == 1:
            cs, ss = p["conv_state"].clone(), p["ssm_state"].clone()
            x, r = steps[0]
            y, _, _ = ref.rms_norm_linear_conv(x, r, p["norm_weight"], 1e-6, p["weight"],
                                               conv_weight=p["conv_weight"], conv_state=cs, state_indices=idx)
            y_t, _, _ = tri.rms_norm_linear_conv(x, r, p["norm_weight"], 1e-6, p["weight"],
                                                 conv_weight=p["conv_weight"], conv_state=p["conv_state"].clone(),
                                                 state_indices=idx)
            assert_close(y_t, y, 2e-2, "B=1 op vs reference")


@pytest.mark.gpu
def test_real_shape_graph_replay_equals_eager_gpu():
    """B = 1: the layer step with the conv in the projection (PDL chain: GEMV -> gdn_decode -> gated
    out_proj) captured in a CUDA graph; three replays on the same slot == three eager steps."""
    p, D, hv, d, rn = _real(21, 3)
    idx = torch.tensor([2], dtype=torch.int32, device="cuda")
    x, r = rn(1, 2048, scale=2.0), rn(1, 2048)
    ce, se = p["conv_state"].clone(), p["ssm_state"].clone()
    eager = [_layer_step(p, D, hv, d, x, r, idx, ce, se, True)[0] for _ in range(3)]
    cg, sg = p["conv_state"].clone(), p["ssm_state"].clone()
    _layer_step(p, D, hv, d, x, r, idx, cg.clone(), sg.clone(), True)   # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, _ = _layer_step(p, D, hv, d, x, r, idx, cg, sg, True)
    for step in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager[step]), f"replay {step}"
    assert torch.equal(cg, ce) and torch.equal(sg, se)
