"""fused_moe / fused_moe_routed (Triton) against the plain-torch references: the grouped-GEMM path (E=8,
top-2, T=1 and T=100, experts that get no tokens, the multi-chunk alignment and its invariants, a shared
expert folded in as one more expert), the small-batch GEMV path (against the reference and the grouped
path, tiles that do not divide the shapes, tokens sharing experts), the default launch choice, and
fused_moe_routed with the shared slots set apart from the routing."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from deltaserve.ops.moe import config as moe_config
from deltaserve.ops.moe import reference as ref
from deltaserve.ops.moe import triton as tri
from deltaserve.ops.moe import triton_align as align
from deltaserve.ops.moe import triton_routing as route
from deltaserve.ops.triton_common import pdl_launch

from .helpers import assert_close, gen, randn

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _experts(E, H, inter, *, g, dtype, device):
    w13 = randn(E, 2 * inter, H, g=g, dtype=dtype, device=device, scale=H ** -0.5)
    w2 = randn(E, H, inter, g=g, dtype=dtype, device=device, scale=inter ** -0.5)
    return w13, w2


def _logits(T, E, *, g, device, idle=0):
    """Router logits; with idle > 0 the first `idle` experts are never chosen."""
    logits = randn(T, E, g=g, scale=2.0)
    logits[:, :idle] -= 1e4
    return logits.to(device)


@pytest.mark.parametrize("T,dtype,idle", [
    (1, torch.float32, 0),
    (100, torch.float32, 0),
    (100, torch.bfloat16, 0),
    (9, torch.float32, 5),            # 5 of 8 experts get no tokens
])
def test_fused_moe_matches_reference(T, dtype, idle, device):
    E, top_k, H, inter = 8, 2, 64, 32
    g = gen(T + idle)
    x = randn(T, H, g=g, dtype=dtype, device=device)
    w13, w2 = _experts(E, H, inter, g=g, dtype=dtype, device=device)
    weights, ids = ref.topk_softmax(_logits(T, E, g=g, device=device, idle=idle), top_k, True)
    if idle:
        assert int(ids.min()) >= idle
    assert_close(tri.fused_moe(x, w13, w2, weights, ids), ref.fused_moe(x, w13, w2, weights, ids), TOL[dtype],
                 f"T={T} {dtype}")


GROUPED_SMALL = tri.MoeConfig(block_m=16, block_n1=32, block_k1=32, block_n2=32, block_k2=32)


@pytest.mark.parametrize("T,dtype", [(1, torch.float32), (5, torch.float32), (3, torch.bfloat16)])
def test_gemv_path_matches_reference_and_grouped_path(T, dtype, device):
    """Small batches take the GEMV path by default; the grouped path (forced) agrees with it."""
    E, top_k, H, inter = 8, 2, 64, 32
    assert isinstance(tri.default_moe_config(T, top_k, E, H, inter), tri.GemvMoeConfig)
    g = gen(40 + T)
    x = randn(T, H, g=g, dtype=dtype, device=device)
    w13, w2 = _experts(E, H, inter, g=g, dtype=dtype, device=device)
    weights, ids = ref.topk_softmax(_logits(T, E, g=g, device=device), top_k, True)
    want = ref.fused_moe(x, w13, w2, weights, ids)
    gemv = tri.fused_moe(x, w13, w2, weights, ids)
    assert_close(gemv, want, TOL[dtype], f"gemv T={T} {dtype}")
    assert_close(gemv, tri.fused_moe(x, w13, w2, weights, ids, config=GROUPED_SMALL), TOL[dtype], "gemv vs grouped")


def test_gemv_odd_tiles_shared_experts_and_shared_expert_slot(device):
    """H, I not multiples of the tiles; every token routed to the same two experts (rows shared across
    programs); int32 ids; an extra always-on expert slot as the shared expert is folded in."""
    E, top_k, T, H, inter = 6, 3, 4, 72, 40
    g = gen(50)
    x = randn(T, H, g=g, device=device)
    w13, w2 = _experts(E, H, inter, g=g, dtype=torch.float32, device=device)
    ids = torch.tensor([[1, 4, 5]] * T, device=device)
    ids[1, 2], ids[3, 0] = 0, 2
    weights = torch.softmax(randn(T, top_k, g=g, device=device), -1)
    want = ref.fused_moe(x, w13, w2, weights, ids)
    # experts one after the other (looping over I, or in one step: block_k2 >= I) / gathered in one tile
    # (top_k 3 -> 4)
    for all_experts, block_k2 in ((False, 16), (False, 64), (True, 16)):
        cfg = tri.GemvMoeConfig(block_n1=16, block_k1=32, block_n2=16, block_k2=block_k2, warps1=2, warps2=2,
                                all_experts=all_experts)
        got = tri.fused_moe(x, w13, w2, weights, ids.to(torch.int32), config=cfg)
        assert_close(got, want, TOL[torch.float32], f"gemv odd tiles, all_experts={all_experts}, k2={block_k2}")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="pdl=True needs a CUDA device"):
            tri.fused_moe(x, w13, w2, weights, ids, config=tri.GemvMoeConfig(all_experts=True, pdl=True))


def test_default_config_by_batch_device_and_shared_slots():
    """T = 1 gets its own tiles (programmatic launch only where the device has it), T = 2..8 the common
    GEMV tiles, larger batches the grouped GEMMs; with shared slots and PDL, T <= 2 sets them apart."""
    E, top_k, H, inter = 257, 9, 2048, 512
    c = moe_config
    assert tri.default_moe_config(1, top_k, E, H, inter, pdl=True) == c.GEMV_T1
    assert tri.default_moe_config(1, top_k, E, H, inter) == c.GEMV_T1_NO_PDL
    assert not c.GEMV_T1_NO_PDL.pdl and not c.GEMV_T1_NO_PDL.pdl_w13 and c.GEMV_T1.all_experts
    for T in (2, 8):
        assert tri.default_moe_config(T, top_k, E, H, inter, pdl=True) == tri.GemvMoeConfig(pdl_w13=True)
        assert tri.default_moe_config(T, top_k, E, H, inter) == tri.GemvMoeConfig()
    assert isinstance(tri.default_moe_config(11, top_k, E, H, inter, pdl=True), tri.MoeConfig)
    # the shared expert folded in (fused_moe_routed): its slots set apart from the routing at T <= 2 on Hopper
    assert tri.default_moe_config(1, top_k, E, H, inter, pdl=True, shared_slices=1) == c.GEMV_T1_SHARED
    assert c.GEMV_T1_SHARED.shared_in_route and c.GEMV_T1_SHARED.shared_w2
    assert tri.default_moe_config(2, top_k, E, H, inter, pdl=True, shared_slices=1) == \
        tri.GemvMoeConfig(pdl_w13=True, shared_in_route=True)
    assert tri.default_moe_config(4, top_k, E, H, inter, pdl=True, shared_slices=1) == tri.GemvMoeConfig(pdl_w13=True)
    assert tri.default_moe_config(1, top_k, E, H, inter, shared_slices=1) == c.GEMV_T1_NO_PDL
    assert tri.default_moe_config(2, top_k, E, H, inter, shared_slices=1) == tri.GemvMoeConfig()


def test_multi_chunk_alignment_and_odd_tiles(device, monkeypatch):
    """Assignments spread over several counting/scatter chunks, I not a multiple of the tile, int32 ids."""
    monkeypatch.setattr(align, "ALIGN_CHUNK", 64)
    E, top_k, T, H, inter = 8, 2, 70, 64, 48
    g = gen(3)
    x = randn(T, H, g=g, device=device)
    w13, w2 = _experts(E, H, inter, g=g, device=device, dtype=torch.float32)
    weights, ids = ref.topk_softmax(_logits(T, E, g=g, device=device), top_k, True)
    cfg = tri.MoeConfig(block_m=32, block_n1=32, block_k1=16, block_n2=32, block_k2=16)
    got = tri.fused_moe(x, w13, w2, weights, ids.to(torch.int32), config=cfg)
    assert_close(got, ref.fused_moe(x, w13, w2, weights, ids), TOL[torch.float32], "multi-chunk")


@pytest.mark.parametrize("chunk", [1024, 16])
def test_alignment_invariants(chunk, device, monkeypatch):
    monkeypatch.setattr(align, "ALIGN_CHUNK", chunk)
    E, BM = 8, 16
    g = gen(4)
    ids = torch.randint(0, E, (23, 3), generator=g)
    ids[ids == 2] = 5                                         # expert 2 idle
    sorted_ids, block_expert = align.align_by_expert(ids.to(device), E, BM)
    sorted_ids, block_expert = sorted_ids.cpu(), block_expert.cpu()
    A = ids.numel()
    flat = ids.flatten()
    assert block_expert.shape[0] == align.num_blocks_bound(A, E, BM)
    used = int((block_expert >= 0).sum())
    assert (block_expert[used:] == -1).all(), "unused blocks must be marked -1 at the end"
    assert (block_expert[:used].diff() >= 0).all(), "blocks are in expert order"
    assert 2 not in block_expert.tolist(), "an idle expert owns no block"
    rows = sorted_ids[: used * BM].view(used, BM)
    real = rows[rows < A]
    assert sorted(real.tolist()) == list(range(A)), "every assignment exactly once"
    for b in range(used):
        r = rows[b][rows[b] < A]
        assert (flat[r] == block_expert[b]).all(), f"block {b} holds another expert's rows"
        assert (r.diff() > 0).all(), "token order kept inside an expert"
        assert (rows[b][len(r):] == A).all(), "padding rows come last and are marked A"
    counts = torch.bincount(flat, minlength=E)
    assert used == int(((counts + BM - 1) // BM).sum())


def test_shared_expert_as_extra_expert(device):
    """The shared expert (same width) stacked as expert E, with weight sigmoid(shared gate), gives the
    routed output plus the gated shared output: the way to run a MoE block in one fused_moe call."""
    E, top_k, T, H, inter = 8, 2, 12, 64, 32
    g = gen(8)
    x = randn(T, H, g=g, device=device)
    w13, w2 = _experts(E + 1, H, inter, g=g, dtype=torch.float32, device=device)
    weights, ids = ref.topk_softmax(_logits(T, E, g=g, device=device), top_k, True)
    shared_gate = torch.sigmoid(randn(T, 1, g=g, device=device))
    routed = ref.fused_moe(x, w13[:E], w2[:E], weights, ids)
    gate, up = (x @ w13[E].t()).chunk(2, dim=-1)
    want = routed + shared_gate * (F.silu(gate) * up) @ w2[E].t()
    ids_all = torch.cat([ids, torch.full((T, 1), E, dtype=ids.dtype, device=device)], dim=1)
    weights_all = torch.cat([weights, shared_gate], dim=1)
    assert_close(tri.fused_moe(x, w13, w2, weights_all, ids_all), want, 1e-5, "shared as expert E")


@pytest.mark.parametrize("bad, match", [
    (dict(w2_shape=(8, 64, 16)), "w2 must be"),
    (dict(ids_shape=(5, 2)), "topk_ids"),
    (dict(w_dtype=torch.bfloat16), "share a float dtype"),
])
def test_bad_inputs_raise(bad, match, device):
    x = torch.zeros(4, 64, device=device)
    w13 = torch.zeros(8, 64, 64, device=device, dtype=bad.get("w_dtype", torch.float32))
    w2 = torch.zeros(*bad.get("w2_shape", (8, 64, 32)), device=device)
    ids = torch.zeros(*bad.get("ids_shape", (4, 2)), dtype=torch.int64, device=device)
    with pytest.raises(ValueError, match=match):
        tri.fused_moe(x, w13, w2, torch.zeros(ids.shape, device=device), ids)


# ---- real shapes on the GPU ------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 4, 8, 64, 600])
def test_real_shapes_gpu(T, device):
    E, top_k, H, inter = 256, 8, 2048, 512                 # Qwen3.5-35B-A3B
    g = gen(T)
    x = randn(T, H, g=g, dtype=torch.bfloat16, device=device)
    w13, w2 = _experts(E, H, inter, g=g, dtype=torch.bfloat16, device=device)
    logits = _logits(T, E, g=g, device=device).to(torch.bfloat16)
    w_ref, i_ref = ref.topk_softmax(logits, top_k, True)
    w_tri, i_tri = route.topk_softmax(logits, top_k, True)
    probs = torch.softmax(logits.float(), dim=-1)
    assert torch.equal(probs.gather(1, i_tri), probs.gather(1, i_ref)), "a different expert set or order"
    assert_close(w_tri, w_ref, 1e-6, "weights")
    assert_close(tri.fused_moe(x, w13, w2, w_ref, i_ref), ref.fused_moe(x, w13, w2, w_ref, i_ref),
                 TOL[torch.bfloat16], f"T={T}")


def test_signatures_match_the_references():
    import inspect

    for name in ("fused_moe", "fused_moe_routed"):
        want = [(p.name, p.kind) for p in inspect.signature(getattr(ref, name)).parameters.values()]
        params = inspect.signature(getattr(tri, name)).parameters.values()
        assert [(p.name, p.kind) for p in params if p.name != "config"] == want, name


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 8])
def test_gemv_path_real_shape_graph_replay_gpu(T, device):
    """The GEMV path at the 35B-A3B expert shape: equals the grouped path, and a CUDA-graph replay on new
    inputs (routing, weights, activations) equals an eager call on them (no host sync, no stale state)."""
    E, top_k, H, inter = 256, 8, 2048, 512
    g = gen(60 + T)
    w13, w2 = _experts(E, H, inter, g=g, dtype=torch.bfloat16, device=device)

    def inputs(seed):
        gg = gen(seed)
        x = randn(T, H, g=gg, dtype=torch.bfloat16, device=device)
        w, i = route.topk_softmax(_logits(T, E, g=gg, device=device).to(torch.bfloat16), top_k, True)
        return x, w, i

    x, w, i = inputs(1)
    assert isinstance(tri.default_moe_config(T, top_k, E, H, inter), tri.GemvMoeConfig)
    grouped = tri.fused_moe(x, w13, w2, w, i, config=tri.MoeConfig())
    assert_close(tri.fused_moe(x, w13, w2, w, i), grouped, TOL[torch.bfloat16], "gemv vs grouped")
    for variant in (dict(all_experts=True), dict(all_experts=True, pdl=True, block_n2=2, block_k2=256, warps2=4)):
        got = tri.fused_moe(x, w13, w2, w, i, config=tri.GemvMoeConfig(**variant))
        assert_close(got, grouped, TOL[torch.bfloat16], f"gemv {variant} vs grouped")
    tri.fused_moe(x, w13, w2, w, i)                       # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tri.fused_moe(x, w13, w2, w, i)
    x2, wt2, id2 = inputs(2)
    x.copy_(x2), w.copy_(wt2), i.copy_(id2)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, tri.fused_moe(x2, w13, w2, wt2, id2)), "graph replay differs from eager"


# ---- fused_moe_routed ------------------------------------------------------------------------------

def test_fused_moe_routed_equals_routing_then_fused_moe(device):
    """Where the shared slots stay with the routing (no PDL, or explicit tiles): topk_softmax then
    fused_moe, bit for bit; every path within tolerance of the reference."""
    E, top_k, H, inter = 8, 2, 64, 32
    g = gen(320)
    w13, w2 = _experts(E + 1, H, inter, g=g, dtype=torch.float32, device=device)
    for T, config in ((1, None), (3, None), (1, moe_config.GEMV_T1_NO_PDL), (2, GROUPED_SMALL)):
        x = randn(T, H, g=g, device=device)
        logits = randn(T, E + 1, g=g, scale=2.0).to(device)
        got = tri.fused_moe_routed(x, w13, w2, logits, top_k, True, shared_slices=1, config=config)
        assert_close(got, ref.fused_moe_routed(x, w13, w2, logits, top_k, True, shared_slices=1), 1e-5, f"T={T}")
        if config is not None or not pdl_launch(x.device):
            w, i = route.topk_softmax(logits, top_k, True, shared_slices=1)
            assert torch.equal(got, tri.fused_moe(x, w13, w2, w, i, config=config)), f"T={T} {config}"


def test_fused_moe_routed_bad_inputs(device):
    x, w13 = torch.zeros(2, 64, device=device), torch.zeros(9, 64, 64, device=device)
    w2 = torch.zeros(9, 64, 32, device=device)
    with pytest.raises(ValueError, match="routing needs 10"):
        tri.fused_moe_routed(x, w13, w2, torch.zeros(2, 10, device=device), 2, True, shared_slices=1)
    with pytest.raises(ValueError, match="same tokens"):
        tri.fused_moe_routed(x, w13, w2, torch.zeros(3, 9, device=device), 2, True, shared_slices=1)
    with pytest.raises(ValueError, match="top_k"):
        tri.fused_moe_routed(x, w13, w2, torch.zeros(2, 9, device=device), 9, True, shared_slices=1)


# ---- the shared expert's slots set apart from the routing (GemvMoeConfig.shared_in_route / shared_w2) ----

_SMALL_GEMV = tri.GemvMoeConfig(block_n1=8, block_k1=16, block_n2=4, block_k2=16, all_experts=True)


@pytest.mark.parametrize("shared_w2", [False, True])
@pytest.mark.parametrize("T,slices,dtype,all_experts", [
    (1, 1, torch.float32, True),
    (3, 2, torch.float32, True),        # two shared slices, tokens > 1
    (2, 1, torch.bfloat16, True),
    (2, 1, torch.float32, False),       # the one-expert-at-a-time w2 kernel (not with shared_w2)
])
def test_shared_slots_apart_match_reference_and_plain_path(shared_w2, T, slices, dtype, all_experts, device):
    """The shared slots' w13 in the routing kernel (and their w2 in front of the w13 kernel) equal the
    reference within tolerance and the GEMV path with the same tiles that keeps them with the routed
    slots (the shared slots' products are summed in another order). H, I not multiples of the tiles."""
    if shared_w2 and not all_experts:
        pytest.skip("shared_w2 needs all_experts")
    E, top_k, H, inter = 8, 2, 72, 40
    g = gen(600 + T + slices)
    x = randn(T, H, g=g, dtype=dtype, device=device)
    w13, w2 = _experts(E + slices, H, inter, g=g, dtype=dtype, device=device)
    logits = randn(T, E + 1, g=g, scale=2.0).to(device=device, dtype=dtype)
    plain = dataclasses.replace(_SMALL_GEMV, all_experts=all_experts)
    cfg = dataclasses.replace(plain, shared_in_route=True, shared_w2=shared_w2)
    got = tri.fused_moe_routed(x, w13, w2, logits, top_k, True, shared_slices=slices, config=cfg)
    want = ref.fused_moe_routed(x, w13, w2, logits, top_k, True, shared_slices=slices)
    assert_close(got, want, TOL[dtype], f"shared_w2={shared_w2} vs reference")
    base = tri.fused_moe_routed(x, w13, w2, logits, top_k, True, shared_slices=slices, config=plain)
    assert_close(got, base, 1e-6 if dtype == torch.float32 else 1e-2, f"shared_w2={shared_w2} vs plain path")


def test_shared_slots_apart_bad_configs(device):
    E, top_k, H, inter = 8, 2, 32, 16
    g = gen(620)
    x = randn(2, H, g=g, device=device)
    w13, w2 = _experts(E + 1, H, inter, g=g, dtype=torch.float32, device=device)
    logits = randn(2, E + 1, g=g).to(device)
    weights, ids = ref.topk_softmax(logits, top_k, True, shared_slices=1)
    cfg = dataclasses.replace(_SMALL_GEMV, shared_in_route=True)
    with pytest.raises(ValueError, match="needs fused_moe_routed"):
        tri.fused_moe(x, w13, w2, weights, ids, config=cfg)
    with pytest.raises(ValueError, match="shared_slices >= 1"):
        tri.fused_moe_routed(x, w13[:E], w2[:E], logits[:, :E], top_k, True, config=cfg)
    for bad in (dict(shared_w2=True), dict(shared_in_route=True, shared_w2=True, all_experts=False)):
        with pytest.raises(ValueError, match="shared_w2 needs"):
            tri.fused_moe_routed(x, w13, w2, logits, top_k, True, shared_slices=1,
                                 config=dataclasses.replace(_SMALL_GEMV, **bad))
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="pdl_w13=True needs a CUDA device"):
            tri.fused_moe(x, w13, w2, weights, ids, config=tri.GemvMoeConfig(pdl_w13=True))


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 2, 4, 8])
def test_block_as_the_layer_runs_it_real_shape_gpu(T, device):
    """The 35B-A3B block as the layer runs it (router GEMV with the pre-norm folded, released early; 256
    experts + the shared one as expert 256, top-8 + its slot): fused_moe_routed's default (shared slots
    apart at T <= 2) equals the fp32 reference within tolerance and the GEMV path that keeps the shared
    slots with the routing; CUDA-graph replays on new inputs equal eager calls (the programs that start
    before a griddepcontrol.wait read nothing stale)."""
    from deltaserve.ops.linear import triton as lin

    E, top_k, H, inter = 256, 8, 2048, 512
    g = gen(700 + T)
    w13, w2 = _experts(E + 1, H, inter, g=g, dtype=torch.bfloat16, device=device)
    router = (randn(E + 1, H, g=g) * H ** -0.5).to(device=device, dtype=torch.bfloat16)
    norm_w = (randn(H, g=g) * 0.1).to(device=device, dtype=torch.bfloat16)
    x, r = (randn(T, H, g=g).to(device=device, dtype=torch.bfloat16) for _ in range(2))

    def block(x, cfg):
        logits, normed, _ = lin.rms_norm_linear(x, r, norm_w, 1e-6, router)
        return tri.fused_moe_routed(normed, w13, w2, logits, top_k, True, shared_slices=1, config=cfg), logits, normed

    plain = moe_config.GEMV_T1 if T == 1 else tri.GemvMoeConfig(pdl_w13=True)
    kept, logits, normed = block(x, plain)
    w_sep, i_sep = route.topk_softmax(logits, top_k, True, shared_slices=1)
    want = ref.fused_moe(normed.float(), w13.float(), w2.float(), w_sep, i_sep)
    configs = {"default": None, "shared kept with the routing": plain}
    for label, cfg in configs.items():
        got = block(x, cfg)[0]
        assert_close(got, want, TOL[torch.bfloat16], f"T={T} {label} vs fp32 reference")
        assert_close(got, kept, 1e-2, f"T={T} {label} vs the shared slots kept with the routing")
    graphs, outs = [], []
    for cfg in configs.values():
        graphs.append(torch.cuda.CUDAGraph())
        with torch.cuda.graph(graphs[-1]):
            outs.append(block(x, cfg)[0])
    x.copy_(randn(T, H, g=g).to(device=device, dtype=torch.bfloat16))
    for (label, cfg), graph, out in zip(configs.items(), graphs, outs):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, block(x, cfg)[0]), f"T={T} {label}: graph replay differs from eager"
