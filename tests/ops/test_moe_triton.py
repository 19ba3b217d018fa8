"""MoE routing and grouped-GEMM experts (Triton) against the plain-torch references: E=8/top-2 with T=1
and T=100, experts that get no tokens, the multi-chunk alignment path, the alignment's invariants, and
a shared expert folded in as one more expert; the small-batch GEMV path against the reference and
against the grouped path, tiles that do not divide the shapes, tokens sharing experts; fused_moe_routed
with the routing inside the w13 kernel: the routing kernel's choice and weights bit for bit, its rule."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from deltaserve.ops.moe import reference as ref
from deltaserve.ops.moe import triton as tri
from deltaserve.ops.moe import triton_routing as route

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


def test_default_gemv_configs():
    """T = 1 gets its own tiles (programmatic launch only where the device has it), T = 2..8 the shared
    GEMV tiles, and the choice is valid for fused_moe's checks."""
    E, top_k, H, inter = 257, 9, 2048, 512
    assert tri.default_moe_config(1, top_k, E, H, inter, pdl=True) == tri.GEMV_T1
    assert tri.default_moe_config(1, top_k, E, H, inter) == tri.GEMV_T1_NO_PDL
    assert not tri.GEMV_T1_NO_PDL.pdl and not tri.GEMV_T1_NO_PDL.pdl_w13 and tri.GEMV_T1.all_experts
    for T in (2, 8):
        assert tri.default_moe_config(T, top_k, E, H, inter, pdl=True) == tri.GemvMoeConfig(pdl_w13=True)
        assert tri.default_moe_config(T, top_k, E, H, inter) == tri.GemvMoeConfig()
    assert isinstance(tri.default_moe_config(11, top_k, E, H, inter, pdl=True), tri.MoeConfig)
    # the shared expert folded in (fused_moe_routed): its slots set apart from the routing at T <= 2 on Hopper
    assert tri.default_moe_config(1, top_k, E, H, inter, pdl=True, shared_slices=1) == tri.GEMV_T1_SHARED
    assert tri.GEMV_T1_SHARED.shared_in_route and tri.GEMV_T1_SHARED.shared_w2
    assert tri.default_moe_config(2, top_k, E, H, inter, pdl=True, shared_slices=1) == \
        tri.GemvMoeConfig(pdl_w13=True, shared_in_route=True)
    assert tri.default_moe_config(4, top_k, E, H, inter, pdl=True, shared_slices=1) == tri.GemvMoeConfig(pdl_w13=True)
    assert tri.default_moe_config(1, top_k, E, H, inter, shared_slices=1) == tri.GEMV_T1_NO_PDL
    assert tri.default_moe_config(2, top_k, E, H, inter, shared_slices=1) == tri.GemvMoeConfig()


def test_multi_chunk_alignment_and_odd_tiles(device, monkeypatch):
    """Assignments spread over several counting/scatter chunks, I not a multiple of the tile, int32 ids."""
    monkeypatch.setattr(tri, "ALIGN_CHUNK", 64)
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
    monkeypatch.setattr(tri, "ALIGN_CHUNK", chunk)
    E, BM = 8, 16
    g = gen(4)
    ids = torch.randint(0, E, (23, 3), generator=g)
    ids[ids == 2] = 5                                         # expert 2 idle
    sorted_ids, block_expert = tri.align_by_expert(ids.to(device), E, BM)
    sorted_ids, block_expert = sorted_ids.cpu(), block_expert.cpu()
    A = ids.numel()
    flat = ids.flatten()
    assert block_expert.shape[0] == tri.num_blocks_bound(A, E, BM)
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

    for name in ("fused_moe",):       # topk_softmax's Triton op now lives in triton_routing.py (own tests)
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


# ---- the one-pass small-batch path -------------------------------------------------------------------

ONE_PASS_CASES = [  # (T, top_k, E, H, inter, config): programs per SM x 4 "SMs" off the GPU
    (1, 2, 8, 64, 32, dict(rows=16, granule=4, block_k=16, block_n=16, programs_per_sm=1)),
    (3, 3, 8, 72, 40, dict(rows=16, granule=4, block_k=32, block_n=16, programs_per_sm=1)),   # I % G != 0
    (3, 3, 8, 72, 40, dict(rows=8, granule=8, block_k=32, block_n=32, programs_per_sm=3)),    # H % BN != 0
    (2, 2, 8, 32, 16, dict(rows=32, granule=2, block_k=64, block_n=8, programs_per_sm=100)),  # a program per granule
]


@pytest.mark.parametrize("T,top_k,E,H,inter,cfg", ONE_PASS_CASES)
def test_one_pass_path_matches_reference(T, top_k, E, H, inter, cfg, device, monkeypatch):
    """Pieces that cross program ranges and the LP grid, ranges that span assignments, granules that do not
    divide I; the partials buffer starts as NaN, so a combine that read a row no piece wrote would fail."""
    monkeypatch.setattr(tri, "_partials", lambda rows, h, dev: torch.full((rows, h), float("nan"), device=dev))
    g = gen(70 + T + inter)
    x = randn(T, H, g=g, device=device)
    w13, w2 = _experts(E, H, inter, g=g, dtype=torch.float32, device=device)
    weights, ids = ref.topk_softmax(_logits(T, E, g=g, device=device), top_k, True)
    got = tri.fused_moe(x, w13, w2, weights, ids.to(torch.int32), config=tri.OnePassMoeConfig(**cfg))
    assert_close(got, ref.fused_moe(x, w13, w2, weights, ids), TOL[torch.float32], f"one-pass {cfg}")


def test_one_pass_bf16_shared_slot_equals_gemv_path(device):
    """bf16 with the shared expert as an always-on slot: the one-pass path agrees with the GEMV path (both
    round h and each expert's output once, as the reference does) within the bf16 tolerance."""
    E, top_k, T, H, inter = 8, 2, 2, 64, 32
    g = gen(81)
    x = randn(T, H, g=g, dtype=torch.bfloat16, device=device)
    w13, w2 = _experts(E + 1, H, inter, g=g, dtype=torch.bfloat16, device=device)
    weights, ids = ref.topk_softmax(_logits(T, E, g=g, device=device), top_k, True)
    ids = torch.cat([ids, torch.full((T, 1), E, dtype=ids.dtype, device=device)], 1).contiguous()
    weights = torch.cat([weights, torch.sigmoid(randn(T, 1, g=g, device=device))], 1).contiguous()
    cfg = tri.OnePassMoeConfig(rows=16, granule=8, block_k=32, block_n=32, programs_per_sm=2)
    got = tri.fused_moe(x, w13, w2, weights, ids, config=cfg)
    assert_close(got, ref.fused_moe(x, w13, w2, weights, ids), TOL[torch.bfloat16], "one-pass vs reference")
    assert_close(got, tri.fused_moe(x, w13, w2, weights, ids, config=tri.GemvMoeConfig(block_n1=8, block_k1=32,
                 block_n2=8, block_k2=32)), TOL[torch.bfloat16], "one-pass vs gemv")


def test_one_pass_bad_configs(device):
    x, w13 = torch.zeros(1, 64, device=device), torch.zeros(4, 64, 64, device=device)
    w2 = torch.zeros(4, 64, 32, device=device)
    w, ids = torch.ones(1, 2, device=device), torch.zeros(1, 2, dtype=torch.int64, device=device)
    with pytest.raises(ValueError, match="rows=24 must be a power of two"):
        tri.fused_moe(x, w13, w2, w, ids, config=tri.OnePassMoeConfig(rows=24))
    with pytest.raises(ValueError, match="granule=32 must be <= rows=16"):
        tri.fused_moe(x, w13, w2, w, ids, config=tri.OnePassMoeConfig(rows=16, granule=32))
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="pdl=True needs a CUDA device"):
            tri.fused_moe(x, w13, w2, w, ids, config=tri.OnePassMoeConfig(pdl=True))
        with pytest.raises(ValueError, match="pdl_w13=True needs a CUDA device"):
            tri.fused_moe(x, w13, w2, w, ids, config=tri.GemvMoeConfig(pdl_w13=True))


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 2, 4, 8])
def test_one_pass_real_shape_gpu(T, device):
    """The 35B-A3B decode shape (256 experts + the shared one as expert 256, top-8 + its slot, H 2048,
    I 512, bf16): the one-pass path (programmatic launches after the routing kernel, as in the layer)
    against the fp32 reference and the grouped path, the GEMV path with w13 launched programmatically
    against it, and CUDA-graph replays of route + fused_moe (both) on new inputs equal to eager calls."""
    E, top_k, H, inter = 256, 8, 2048, 512
    g = gen(90 + T)
    w13, w2 = _experts(E + 1, H, inter, g=g, dtype=torch.bfloat16, device=device)
    cfg = tri.ONE_PASS_T1

    def inputs(seed):
        gg = gen(seed)
        x = randn(T, H, g=gg, dtype=torch.bfloat16, device=device)
        logits = _logits(T, E + 1, g=gg, device=device).to(torch.bfloat16)
        return x, logits

    def run(x, logits, config=cfg):
        w, i = route.topk_softmax(logits, top_k, True, shared_slices=1)
        return tri.fused_moe(x, w13, w2, w, i, config=config)

    x, logits = inputs(1)
    w, i = route.topk_softmax(logits, top_k, True, shared_slices=1)
    want = ref.fused_moe(x.float(), w13.float(), w2.float(), w, i)
    got = run(x, logits)
    assert_close(got, want, TOL[torch.bfloat16], f"one-pass T={T} vs fp32 reference")
    assert_close(got, tri.fused_moe(x, w13, w2, w, i, config=tri.MoeConfig()), TOL[torch.bfloat16], "vs grouped")
    for variant in (dict(pdl=False), dict(rows=32, warps=4, programs_per_sm=4, combine_cols=32, combine_warps=2)):
        assert_close(run(x, logits, dataclasses.replace(cfg, **variant)), got, TOL[torch.bfloat16], f"{variant}")
    gemv = dataclasses.replace(tri.GEMV_T1 if T == 1 else tri.GemvMoeConfig(), pdl_w13=True)
    assert_close(run(x, logits, gemv), got, TOL[torch.bfloat16], "gemv pdl_w13")
    graphs, outs = [], []
    for config in (cfg, gemv):
        graphs.append(torch.cuda.CUDAGraph())
        with torch.cuda.graph(graphs[-1]):
            outs.append(run(x, logits, config))
    x2, logits2 = inputs(2)
    x.copy_(x2), logits.copy_(logits2)
    for config, graph, out in zip((cfg, gemv), graphs, outs):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, run(x2, logits2, config)), f"graph replay differs from eager ({config})"


# ---- fused_moe_routed: the routing inside the w13 GEMV kernel ------------------------------------------

def _routed_in_w13(x, w13, w2, logits, top_k, renorm, slices, cfg):
    """The fused path with its routing outputs kept (the op itself returns only y)."""
    T, E = x.shape[0], logits.shape[1] - (1 if slices else 0)
    w = torch.full((T, top_k + slices), float("nan"), device=x.device)
    ids = torch.full((T, top_k + slices), -1, dtype=torch.int64, device=x.device)
    y = tri._fused_moe("t", x, w13, w2, w, ids, cfg, tri._Routing(logits, E, top_k, slices, renorm))
    return y, w, ids


def _tied_logits(T, E, *, g, device, dtype):
    """Logits from a few values only: many exact ties, in the choice and at the k-th place."""
    return (torch.randint(-2, 3, (T, E), generator=g).float() * 0.5).to(device=device, dtype=dtype)


@pytest.mark.parametrize("T,E,top_k,slices,renorm,dtype,ties", [
    (1, 16, 4, 1, True, torch.float32, False),
    (3, 16, 4, 1, True, torch.float32, True),
    (2, 12, 3, 2, True, torch.bfloat16, True),      # E not a power of two, two shared slices
    (2, 16, 4, 0, True, torch.float32, False),      # no shared expert
    (3, 16, 4, 1, False, torch.float32, True),      # not renormalised
])
def test_fused_routing_picks_what_topk_softmax_picks(T, E, top_k, slices, renorm, dtype, ties, device):
    """The w13 kernel's own routing writes the same ids and weights as topk_softmax (ties included: lowest
    index first), and the block's output equals topk_softmax + fused_moe with the same tiles exactly and
    the reference composition within tolerance."""
    g = gen(300 + T + E)
    H, inter = 64, 32
    x = randn(T, H, g=g, dtype=dtype, device=device)
    w13, w2 = _experts(E + slices, H, inter, g=g, dtype=dtype, device=device)
    width = E + (1 if slices else 0)
    logits = _tied_logits(T, width, g=g, device=device, dtype=dtype) if ties \
        else randn(T, width, g=g, scale=2.0).to(device=device, dtype=dtype)
    cfg = tri.GemvMoeConfig(block_n1=8, block_k1=32, block_n2=8, block_k2=16)
    y, w, ids = _routed_in_w13(x, w13, w2, logits, top_k, renorm, slices, cfg)
    w_sep, i_sep = route.topk_softmax(logits, top_k, renorm, shared_slices=slices)
    assert torch.equal(ids, i_sep), "another expert choice than topk_softmax"
    assert torch.equal(w, w_sep), "other weights than topk_softmax"
    assert torch.equal(y, tri.fused_moe(x, w13, w2, w_sep, i_sep, config=cfg)), "differs from route + fused_moe"
    # with ties torch.topk's order is not defined: the reference experts on our choice
    want = ref.fused_moe(x, w13, w2, w_sep, i_sep) if ties \
        else ref.fused_moe_routed(x, w13, w2, logits, top_k, renorm, shared_slices=slices)
    assert_close(tri.fused_moe_routed(x, w13, w2, logits, top_k, renorm, shared_slices=slices, config=cfg), want,
                 TOL[dtype], "vs reference")
    if not ties:
        w_ref, i_ref = ref.topk_softmax(logits, top_k, renorm, shared_slices=slices)
        assert torch.equal(ids, i_ref)
        assert_close(w, w_ref, 1e-6, "weights vs reference")


@pytest.mark.parametrize("max_tokens", [0, 8])
def test_fused_moe_routed_rule_and_fallback(max_tokens, device, monkeypatch):
    """Up to FUSED_ROUTING_MAX_TOKENS tokens (or with fuse_routing=True) the routing runs inside w13 (no
    topk_softmax call); beyond it, or on the grouped path, topk_softmax then fused_moe. All equal the
    reference."""
    monkeypatch.setattr(tri, "FUSED_ROUTING_MAX_TOKENS", max_tokens)
    E, top_k, H, inter = 8, 2, 64, 32
    g = gen(320)
    w13, w2 = _experts(E + 1, H, inter, g=g, dtype=torch.float32, device=device)
    calls = []
    original = route.topk_softmax
    monkeypatch.setattr(route, "topk_softmax", lambda *a, **k: calls.append(1) or original(*a, **k))
    for T, force in ((1, None), (8, None), (9, None), (2, True), (2, False)):
        fused = force if force is not None else T <= max_tokens
        calls.clear()
        x = randn(T, H, g=g, device=device)
        logits = randn(T, E + 1, g=g, scale=2.0).to(device)
        got = tri.fused_moe_routed(x, w13, w2, logits, top_k, True, shared_slices=1, fuse_routing=force)
        assert (not calls) == fused, f"T={T} fuse_routing={force}: fused={fused} expected"
        assert_close(got, ref.fused_moe_routed(x, w13, w2, logits, top_k, True, shared_slices=1), 1e-5, f"T={T}")
    calls.clear()
    got = tri.fused_moe_routed(x[:2], w13, w2, logits[:2], top_k, True, shared_slices=1, config=GROUPED_SMALL)
    assert calls, "the grouped path routes first"
    assert_close(got, ref.fused_moe_routed(x[:2], w13, w2, logits[:2], top_k, True, shared_slices=1), 1e-5, "grouped")


def test_fused_moe_routed_bad_inputs(device):
    x, w13 = torch.zeros(2, 64, device=device), torch.zeros(9, 64, 64, device=device)
    w2 = torch.zeros(9, 64, 32, device=device)
    with pytest.raises(ValueError, match="fuse_routing needs the GEMV path"):
        tri.fused_moe_routed(x, w13, w2, torch.zeros(2, 9, device=device), 2, True, shared_slices=1,
                             config=GROUPED_SMALL, fuse_routing=True)
    with pytest.raises(ValueError, match="routing needs 10"):
        tri.fused_moe_routed(x, w13, w2, torch.zeros(2, 10, device=device), 2, True, shared_slices=1)
    with pytest.raises(ValueError, match="same tokens"):
        tri.fused_moe_routed(x, w13, w2, torch.zeros(3, 9, device=device), 2, True, shared_slices=1)
    with pytest.raises(ValueError, match="top_k"):
        tri.fused_moe_routed(x, w13, w2, torch.zeros(2, 9, device=device), 9, True, shared_slices=1)


def test_fused_moe_routed_signature_matches_the_reference():
    import inspect

    want = [(p.name, p.kind) for p in inspect.signature(ref.fused_moe_routed).parameters.values()]
    params = inspect.signature(tri.fused_moe_routed).parameters.values()
    assert [(p.name, p.kind) for p in params if p.name not in ("config", "fuse_routing")] == want


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 2, 4, 8])
def test_fused_routing_real_shape_gpu(T, device):
    """The 35B-A3B block as the layer runs it (router GEMV with the pre-norm folded, released early; 256
    experts + the shared one as expert 256, top-8 + its slot): the routing inside w13 (launched
    programmatically after the GEMV) picks the experts and weights the routing kernel does, bit for bit,
    on random and tied logits; the output equals route + fused_moe exactly and the fp32 reference within
    tolerance; a CUDA-graph replay on new inputs equals the eager call."""
    from deltaserve.ops.linear import triton as lin

    E, top_k, H, inter = 256, 8, 2048, 512
    g = gen(400 + T)
    w13, w2 = _experts(E + 1, H, inter, g=g, dtype=torch.bfloat16, device=device)
    router = (randn(E + 1, H, g=g) * H ** -0.5).to(device=device, dtype=torch.bfloat16)
    norm_w = (randn(H, g=g) * 0.1).to(device=device, dtype=torch.bfloat16)
    x, r = (randn(T, H, g=g).to(device=device, dtype=torch.bfloat16) for _ in range(2))
    cfg = tri.default_moe_config(T, top_k + 1, E + 1, H, inter, pdl=True)
    assert isinstance(cfg, tri.GemvMoeConfig) and cfg.pdl_w13

    def block(x):
        logits, normed, _ = lin.rms_norm_linear(x, r, norm_w, 1e-6, router)
        return tri.fused_moe_routed(normed, w13, w2, logits, top_k, True, shared_slices=1, fuse_routing=True), \
            logits, normed

    y, logits, normed = block(x)
    w_sep, i_sep = route.topk_softmax(logits, top_k, True, shared_slices=1)
    assert torch.equal(y, tri.fused_moe(normed, w13, w2, w_sep, i_sep)), "differs from route + fused_moe"
    want = ref.fused_moe(normed.float(), w13.float(), w2.float(), w_sep, i_sep)
    assert_close(y, want, TOL[torch.bfloat16], f"T={T} vs fp32 reference")
    for lg in (logits, _tied_logits(T, E + 1, g=g, device=device, dtype=torch.bfloat16)):
        _, w, ids = _routed_in_w13(normed, w13, w2, lg, top_k, True, 1, dataclasses.replace(cfg, pdl_w13=False))
        w_sep, i_sep = route.topk_softmax(lg, top_k, True, shared_slices=1)
        assert torch.equal(ids, i_sep) and torch.equal(w, w_sep), "another choice than the routing kernel"
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = block(x)[0]
    x2 = randn(T, H, g=g).to(device=device, dtype=torch.bfloat16)
    x.copy_(x2)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, block(x2)[0]), "graph replay differs from eager"


# ---- the shared expert's slots set apart from the routing (GemvMoeConfig.shared_*, session 6) ---------------

_SMALL_GEMV = tri.GemvMoeConfig(block_n1=8, block_k1=16, block_n2=4, block_k2=16, all_experts=True)
SHARED_VARIANTS = {
    "shared_first": dict(shared_first=True),
    "shared_in_route": dict(shared_in_route=True),
    "shared_in_route rows 4": dict(shared_in_route=True, shared_rows=4),
    "shared_in_route + shared_w2": dict(shared_in_route=True, shared_w2=True, shared_w2_rows=16),
}


@pytest.mark.parametrize("variant", list(SHARED_VARIANTS))
@pytest.mark.parametrize("T,slices,dtype,all_experts", [
    (1, 1, torch.float32, True),
    (3, 2, torch.float32, True),        # two shared slices, tokens > 1
    (2, 1, torch.bfloat16, True),
    (2, 1, torch.float32, False),       # the one-expert-at-a-time w2 kernel (not with shared_w2)
])
def test_shared_variants_match_reference_and_default(variant, T, slices, dtype, all_experts, device):
    """Every shared-slot variant equals the reference within tolerance and the default GEMV path with the
    same tiles (shared_first: bit for bit, the same arithmetic; the others sum the shared slots' products
    in another order). H, I not multiples of the tiles."""
    kw = SHARED_VARIANTS[variant]
    if kw.get("shared_w2") and not all_experts:
        pytest.skip("shared_w2 needs all_experts")
    E, top_k, H, inter = 8, 2, 72, 40
    g = gen(600 + T + slices)
    x = randn(T, H, g=g, dtype=dtype, device=device)
    w13, w2 = _experts(E + slices, H, inter, g=g, dtype=dtype, device=device)
    logits = randn(T, E + 1, g=g, scale=2.0).to(device=device, dtype=dtype)
    base = dataclasses.replace(_SMALL_GEMV, all_experts=all_experts)
    cfg = dataclasses.replace(base, **kw)
    got = tri.fused_moe_routed(x, w13, w2, logits, top_k, True, shared_slices=slices, config=cfg)
    default = tri.fused_moe_routed(x, w13, w2, logits, top_k, True, shared_slices=slices, config=base)
    want = ref.fused_moe_routed(x, w13, w2, logits, top_k, True, shared_slices=slices)
    assert_close(got, want, TOL[dtype], f"{variant} vs reference")
    if kw.get("shared_first"):
        assert torch.equal(got, default), "shared_first differs from the default path"
    else:
        assert_close(got, default, 1e-6 if dtype == torch.float32 else 1e-2, f"{variant} vs default")


def test_shared_variants_bad_configs(device):
    E, top_k, H, inter = 8, 2, 32, 16
    g = gen(620)
    x = randn(2, H, g=g, device=device)
    w13, w2 = _experts(E + 1, H, inter, g=g, dtype=torch.float32, device=device)
    logits = randn(2, E + 1, g=g).to(device)
    weights, ids = ref.topk_softmax(logits, top_k, True, shared_slices=1)
    cfg = dataclasses.replace(_SMALL_GEMV, shared_in_route=True)
    with pytest.raises(ValueError, match="need fused_moe_routed"):
        tri.fused_moe(x, w13, w2, weights, ids, config=cfg)
    with pytest.raises(ValueError, match="shared_slices >= 1"):
        tri.fused_moe_routed(x, w13[:E], w2[:E], logits[:, :E], top_k, True, config=cfg)
    with pytest.raises(ValueError, match="fuse_routing excludes"):
        tri.fused_moe_routed(x, w13, w2, logits, top_k, True, shared_slices=1, config=cfg, fuse_routing=True)
    for bad, match in ((dict(shared_first=True, shared_in_route=True), "exclude each other"),
                       (dict(shared_w2=True), "shared_w2 needs"),
                       (dict(shared_in_route=True, shared_w2=True, all_experts=False), "shared_w2 needs"),
                       (dict(shared_in_route=True, shared_rows=3), "shared_rows=3"),
                       (dict(shared_in_route=True, shared_w2=True, shared_w2_rows=0), "shared_w2_rows=0")):
        with pytest.raises(ValueError, match=match):
            tri.fused_moe_routed(x, w13, w2, logits, top_k, True, shared_slices=1,
                                 config=dataclasses.replace(_SMALL_GEMV, **bad))


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 2, 4, 8])
def test_shared_variants_real_shape_gpu(T, device):
    """The 35B-A3B block as the layer runs it (router GEMV with the pre-norm folded, released early; 256
    experts + the shared one as expert 256, top-8 + its slot), with the default config and each shared-slot
    variant the benchmark times: equal to the fp32 reference within tolerance and to the GEMV path without
    the variants (shared_first: bit for bit); a CUDA-graph replay on new inputs equals the eager call (the
    programs that start before the routing's wait read nothing stale)."""
    import sys
    from pathlib import Path

    from deltaserve.ops.linear import triton as lin

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from attention_moe_ops import SHARED_T1, SHARED_TN

    E, top_k, H, inter = 256, 8, 2048, 512
    g = gen(700 + T)
    w13, w2 = _experts(E + 1, H, inter, g=g, dtype=torch.bfloat16, device=device)
    router = (randn(E + 1, H, g=g) * H ** -0.5).to(device=device, dtype=torch.bfloat16)
    norm_w = (randn(H, g=g) * 0.1).to(device=device, dtype=torch.bfloat16)
    x, r = (randn(T, H, g=g).to(device=device, dtype=torch.bfloat16) for _ in range(2))

    def block(x, cfg):
        logits, normed, _ = lin.rms_norm_linear(x, r, norm_w, 1e-6, router)
        return tri.fused_moe_routed(normed, w13, w2, logits, top_k, True, shared_slices=1, config=cfg), logits, normed

    plain = tri.GEMV_T1 if T == 1 else tri.GemvMoeConfig(pdl_w13=True)      # the defaults before session 6
    default, logits, normed = block(x, plain)
    w_sep, i_sep = route.topk_softmax(logits, top_k, True, shared_slices=1)
    want = ref.fused_moe(normed.float(), w13.float(), w2.float(), w_sep, i_sep)
    variants = {"default": None, **(SHARED_T1 if T == 1 else SHARED_TN)}
    for label, cfg in variants.items():
        got = block(x, cfg)[0]
        assert_close(got, want, TOL[torch.bfloat16], f"T={T} {label} vs fp32 reference")
        if cfg is not None and cfg.shared_first:
            assert torch.equal(got, default), f"T={T} {label} differs from the GEMV path without it"
        else:
            assert_close(got, default, 1e-2, f"T={T} {label} vs the GEMV path without the shared variants")
    graphs, outs = [], []
    for cfg in variants.values():
        graphs.append(torch.cuda.CUDAGraph())
        with torch.cuda.graph(graphs[-1]):
            outs.append(block(x, cfg)[0])
    x.copy_(randn(T, H, g=g).to(device=device, dtype=torch.bfloat16))
    for (label, cfg), graph, out in zip(variants.items(), graphs, outs):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, block(x, cfg)[0]), f"T={T} {label}: graph replay differs from eager"
