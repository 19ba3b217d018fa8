"""MoE routing (Triton topk_softmax) against the reference: plain top-k softmax, renormalised or not, and
with the shared expert's slices appended from the router's last logit column; bad inputs."""

from __future__ import annotations

import pytest
import torch

from deltaserve.ops.moe import reference as ref
from deltaserve.ops.moe import triton_routing as tri

from .helpers import assert_close, gen, randn


def _logits(T, E, *, seed, device, dtype):
    return (randn(T, E, g=gen(seed), scale=2.0)).to(device=device, dtype=dtype)


@pytest.mark.parametrize("E,top_k,renorm,slices", [(8, 2, True, 0), (8, 2, False, 0), (60, 4, True, 0),
                                                    (8, 2, True, 1), (60, 4, False, 2), (256, 8, True, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_topk_softmax_matches_reference(E, top_k, renorm, slices, dtype, device):
    logits = _logits(37, E + (1 if slices else 0), seed=E + top_k + slices, device=device, dtype=dtype)
    w_ref, i_ref = ref.topk_softmax(logits, top_k, renorm, shared_slices=slices)
    w_tri, i_tri = tri.topk_softmax(logits, top_k, renorm, shared_slices=slices)
    assert w_tri.shape == w_ref.shape == (37, top_k + slices)
    assert i_tri.dtype == i_ref.dtype and w_tri.dtype == w_ref.dtype == torch.float32
    # bf16 logits tie often; among equal probabilities the order is not defined (we take the lowest index)
    probs = torch.softmax(logits[:, :E].float(), dim=-1)
    assert torch.equal(probs.gather(1, i_tri[:, :top_k]), probs.gather(1, i_ref[:, :top_k])), "another expert set"
    assert all(len(set(r)) == top_k + slices for r in i_tri.tolist()), "an expert chosen twice"
    if dtype == torch.float32:
        assert torch.equal(i_tri, i_ref)
    assert torch.equal(i_tri[:, top_k:], torch.arange(E, E + slices, device=device).expand(37, slices))
    assert_close(w_tri, w_ref, 1e-6, "weights")


@pytest.mark.parametrize("T", [1, 100])                  # one token per program, and 16-token tiles
def test_batch_sizes_take_both_launch_shapes(T, device):
    logits = _logits(T, 61, seed=T, device=device, dtype=torch.float32)
    w_ref, i_ref = ref.topk_softmax(logits, 4, True, shared_slices=1)
    w_tri, i_tri = tri.topk_softmax(logits, 4, True, shared_slices=1)
    assert torch.equal(i_tri, i_ref)
    assert_close(w_tri, w_ref, 1e-6, "weights")


def test_shared_slices_weight_is_the_sigmoid_of_the_last_column(device):
    logits = torch.zeros(2, 9, device=device)
    logits[:, 8] = torch.tensor([0.0, 2.0])
    w, ids = tri.topk_softmax(logits, 2, True, shared_slices=2)
    assert_close(w[:, 2:], torch.sigmoid(torch.tensor([[0.0, 0.0], [2.0, 2.0]], device=device)), 1e-6, "shared")
    assert ids[:, 2:].tolist() == [[8, 9], [8, 9]]


def test_topk_softmax_bad_inputs(device):
    with pytest.raises(ValueError, match="top_k"):
        tri.topk_softmax(torch.zeros(4, 8, device=device), 9, True)
    with pytest.raises(ValueError, match="top_k"):
        tri.topk_softmax(torch.zeros(4, 9, device=device), 9, True, shared_slices=1)   # 8 experts + gate
    with pytest.raises(ValueError, match="shared_slices"):
        tri.topk_softmax(torch.zeros(4, 8, device=device), 2, True, shared_slices=-1)
    with pytest.raises(ValueError, match=r"\[T, E\]"):
        tri.topk_softmax(torch.zeros(8, device=device), 2, True)


def test_empty_batch(device):
    w, ids = tri.topk_softmax(torch.zeros(0, 9, device=device), 2, True, shared_slices=1)
    assert w.shape == ids.shape == (0, 3)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 8])
def test_programmatic_launch_after_the_router_gpu(T, device):
    """The routing kernel launched as a programmatic dependent of the router GEMV (pdl_wait) gives the same
    choice and weights as the ordinary launch, eagerly and in a CUDA graph replayed on new inputs (the
    wait orders its logits read after the GEMV's writes)."""
    from deltaserve.ops.linear import triton as lin

    E, top_k, H = 256, 8, 2048
    g = gen(200 + T)
    router = (randn(E + 1, H, g=g) * H ** -0.5).to(device=device, dtype=torch.bfloat16)
    norm_w = (randn(H, g=g) * 0.1).to(device=device, dtype=torch.bfloat16)
    x, r = (randn(T, H, g=g).to(device=device, dtype=torch.bfloat16) for _ in range(2))

    def run(pdl_wait):
        logits = lin.rms_norm_linear(x, r, norm_w, 1e-6, router)[0]
        return tri.routed(logits, top_k, True, shared_slices=1, pdl_wait=pdl_wait)

    for a, b in zip(run(True), run(False)):
        assert torch.equal(a, b)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = run(True)
    x.copy_(randn(T, H, g=g).to(device=device, dtype=torch.bfloat16))
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(outs, run(False)):
        assert torch.equal(a, b), "graph replay differs from the ordinary launch"


# ---- the router GEMV with the routing in its last program's tail (linear.triton.rms_norm_route) ----------

def _router_inputs(T, K, N, *, seed, device, dtype, residual=True, rows=None):
    g = gen(seed)
    w = randn(N, K, g=g, scale=K ** -0.5)
    if rows is not None:                 # ties: the router rows repeat (equal logits, bit for bit)
        w = w[torch.tensor(rows)]
    x = randn(T, K, g=g).to(device=device, dtype=dtype)
    r = randn(T, K, g=g).to(device=device, dtype=dtype) if residual else None
    nw = (randn(K, g=g) * 0.1).to(device=device, dtype=dtype)
    return x, r, nw, w.to(device=device, dtype=dtype)


def _separate(x, r, nw, w, top_k, renorm, slices):
    """The two launches the tail replaces: rms_norm_linear, then the routing kernel."""
    from deltaserve.ops.linear import triton as lin

    logits, h, s = lin.rms_norm_linear(x, r, nw, 1e-6, w)
    return (logits, h, s, *tri.topk_softmax(logits.reshape(-1, w.shape[0]), top_k, renorm, shared_slices=slices))


@pytest.mark.parametrize("E,top_k,renorm,slices,residual", [(16, 4, True, 1, True), (16, 4, False, 0, True),
                                                             (30, 3, True, 2, False), (9, 1, False, 1, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("keys", [True, False])
def test_rms_norm_route_equals_the_separate_kernels(E, top_k, renorm, slices, residual, dtype, keys, device):
    """One token: one launch whose last program routes; logits, normed rows, sum, choice and weights are the
    separate kernels' bit for bit (either tail choice loop), and the choice / weights match the reference
    composition."""
    from deltaserve.ops.linear import triton as lin

    N = E + (1 if slices else 0)
    x, r, nw, w = _router_inputs(1, 64, N, seed=E + top_k, device=device, dtype=dtype, residual=residual)
    got = lin.rms_norm_route(x, r, nw, 1e-6, w, top_k, renorm, shared_slices=slices, route_keys=keys)
    want = _separate(x, r, nw, w, top_k, renorm, slices)
    for name, a, b in zip(("logits", "normed", "sum", "weights", "ids"), got, want):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert torch.equal(a, b), f"{name} differs from the separate kernels"
    ref_w, ref_ids = ref.topk_softmax(got[0], top_k, renorm, shared_slices=slices)
    lg = got[0][:, :E].float()
    assert torch.equal(lg.gather(1, got[4][:, :top_k]), lg.gather(1, ref_ids[:, :top_k])), "another expert set"
    assert_close(got[3], ref_w, 1e-6, "weights vs reference")
    rw = ref.rms_norm_route(x.float(), None if r is None else r.float(), nw.float(), 1e-6, w.float(), top_k, renorm,
                            shared_slices=slices)
    assert_close(got[0].float(), rw[0], 2e-2 if dtype == torch.bfloat16 else 1e-5, "logits vs reference")


def test_rms_norm_route_ties_take_the_lowest_index(device):
    """Equal logits (repeated router rows): the choice is the lowest index among equal values, in the
    separate kernels' order, with their weights."""
    from deltaserve.ops.linear import triton as lin

    rows = [0, 1, 0, 2, 1, 1, 3, 0, 2, 3, 3, 1, 0, 2, 4]      # 14 experts from 4 distinct rows + the gate (4)
    x, r, nw, w = _router_inputs(1, 32, 5, seed=7, device=device, dtype=torch.bfloat16, rows=rows)
    for renorm, keys in ((True, True), (False, True), (True, False), (False, False)):
        got = lin.rms_norm_route(x, r, nw, 1e-6, w, 6, renorm, shared_slices=1, route_keys=keys)
        want = _separate(x, r, nw, w, 6, renorm, 1)
        assert torch.equal(got[4], want[4]) and torch.equal(got[3], want[3])
        lg = got[0][0, :14].float().tolist()
        order = sorted(range(14), key=lambda i: (-lg[i], i))[:6]
        assert got[4][0, :6].tolist() == order, "ties not broken by the lowest index"
        assert got[4][0, 6].item() == 14


def test_rms_norm_route_leaves_the_counter_zero(device):
    """The last program resets the arrival counter: calls back to back (and other shapes between) agree."""
    from deltaserve.ops.linear import triton as lin

    a = _router_inputs(1, 64, 17, seed=1, device=device, dtype=torch.float32)
    b = _router_inputs(1, 32, 9, seed=2, device=device, dtype=torch.float32)
    first = lin.rms_norm_route(*a[:3], 1e-6, a[3], 4, True, shared_slices=1)
    lin.rms_norm_route(*b[:3], 1e-6, b[3], 2, True, shared_slices=1)
    again = lin.rms_norm_route(*a[:3], 1e-6, a[3], 4, True, shared_slices=1)
    for u, v in zip(first, again):
        assert torch.equal(u, v)
    assert int(lin._route_counter(torch.device(device)).item()) == 0


@pytest.mark.parametrize("T", [0, 3])
def test_rms_norm_route_other_batches_take_the_two_ops(T, device):
    from deltaserve.ops.linear import triton as lin

    x, r, nw, w = _router_inputs(T, 64, 17, seed=T, device=device, dtype=torch.float32)
    got = lin.rms_norm_route(x, r, nw, 1e-6, w, 4, True, shared_slices=1)
    want = _separate(x, r, nw, w, 4, True, 1)
    for a, b in zip(got, want):
        assert a.shape == b.shape and torch.equal(a, b)


def test_rms_norm_route_bad_inputs(device):
    from deltaserve.ops.linear import triton as lin

    x, r, nw, w = _router_inputs(1, 32, 9, seed=3, device=device, dtype=torch.float32)
    with pytest.raises(ValueError, match="top_k"):
        lin.rms_norm_route(x, r, nw, 1e-6, w, 9, True, shared_slices=1)     # 8 experts + the gate
    with pytest.raises(ValueError, match="norm_weight"):
        lin.rms_norm_route(x, r, nw[:-1], 1e-6, w, 2, True)
    with pytest.raises(ValueError, match="routing tail"):
        lin.rms_norm_route(x, r, nw, 1e-6, w, 2, True, config=lin.LinearConfig(block_n=16, block_k=16, dot=True))


@pytest.mark.gpu
def test_rms_norm_route_real_shape_graph_gpu(device):
    """Qwen3.5-35B-A3B's router (256 experts + the shared gate, H 2048, top-8, bf16) as the layer's block:
    rms_norm_route then fused_moe equals rms_norm_linear then fused_moe_routed (routing kernel) bit for
    bit, eagerly and in a CUDA graph replayed on new inputs (graph == eager), with the PDL launches."""
    from deltaserve.ops.linear import triton as lin
    from deltaserve.ops.moe import triton as moe_t

    E, top_k, H, inter = 256, 8, 2048, 64       # narrow experts: the routing is what is tested
    g = gen(301)
    x, r, nw, router = _router_inputs(1, H, E + 1, seed=300, device=device, dtype=torch.bfloat16)
    w13 = (randn(E + 1, 2 * inter, H, g=g) * H ** -0.5).to(device=device, dtype=torch.bfloat16)
    w2 = (randn(E + 1, H, inter, g=g) * inter ** -0.5).to(device=device, dtype=torch.bfloat16)

    def tail(keys=True):
        logits, h, s, wts, ids = lin.rms_norm_route(x, r, nw, 1e-6, router, top_k, True, shared_slices=1,
                                                    route_keys=keys)
        return logits, s, wts, ids, moe_t.fused_moe(h, w13, w2, wts, ids)

    def separate():
        logits, h, s = lin.rms_norm_linear(x, r, nw, 1e-6, router)
        wts, ids = tri.topk_softmax(logits, top_k, True, shared_slices=1)
        return logits, s, wts, ids, moe_t.fused_moe_routed(h, w13, w2, logits, top_k, True, shared_slices=1)

    for keys in (True, False):
        for a, b in zip(tail(keys), separate()):
            assert torch.equal(a, b), f"the tail (route_keys={keys}) differs from the separate kernels"
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = tail()
    for _ in range(3):                          # new inputs each replay; the counter must be back at zero
        x.copy_(randn(1, H, g=g).to(device=device, dtype=torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        for a, b in zip(outs, tail()):
            assert torch.equal(a, b), "graph replay differs from the eager call"
        for a, b in zip(outs, separate()):
            assert torch.equal(a, b), "graph replay differs from the separate kernels"


# ---- the routing kernel with the shared slices' w13 rows (route_and_shared_w13, session 6) -------------------

@pytest.mark.parametrize("T,slices,rows,dtype", [(1, 1, 1, torch.float32), (3, 2, 4, torch.float32),
                                                 (2, 1, 2, torch.bfloat16)])
def test_route_and_shared_w13(T, slices, rows, dtype, device):
    """Same choice and weights as topk_softmax, bit for bit; the shared slots' intermediate rows equal
    SiLU(gate . x) * (up . x) of the shared experts; the routed slots' rows are left alone (H and I not
    powers of two)."""
    import torch.nn.functional as F

    E, top_k, H, inter = 12, 3, 40, 24
    g = gen(800 + T)
    logits = randn(T, E + 1, g=g, scale=2.0).to(device=device, dtype=dtype)
    x = randn(T, H, g=g).to(device=device, dtype=dtype)
    w13 = (randn(E + slices, 2 * inter, H, g=g) * H ** -0.5).to(device=device, dtype=dtype)
    width = top_k + slices
    h = torch.full((T * width, inter), 7.0, dtype=dtype, device=device)
    w, ids = tri.route_and_shared_w13(logits, top_k, True, slices, x, w13, h, rows=rows)
    w_sep, i_sep = tri.topk_softmax(logits, top_k, True, shared_slices=slices)
    assert torch.equal(ids, i_sep) and torch.equal(w, w_sep), "another routing than topk_softmax"
    h = h.view(T, width, inter)
    assert bool((h[:, :top_k] == 7.0).all()), "routed slots' rows were written"
    for s in range(slices):
        gate, up = w13[E + s].float().split(inter)
        want = F.silu(x.float() @ gate.T) * (x.float() @ up.T)
        assert_close(h[:, top_k + s], want, 1e-5 if dtype == torch.float32 else 1e-2, f"slice {s}")


def test_route_and_shared_w13_bad_inputs(device):
    logits, x = torch.zeros(2, 9, device=device), torch.zeros(2, 16, device=device)
    w13, h = torch.zeros(9, 8, 16, device=device), torch.zeros(6, 4, device=device)
    with pytest.raises(ValueError, match="shared_slices >= 1"):
        tri.route_and_shared_w13(logits[:, :8], 2, True, 0, x, w13, h)
    with pytest.raises(ValueError, match="rows=3"):
        tri.route_and_shared_w13(logits, 2, True, 1, x, w13, h, rows=3)
    with pytest.raises(ValueError, match="inter must be"):
        tri.route_and_shared_w13(logits, 2, True, 1, x, w13, torch.zeros(5, 4, device=device))
    with pytest.raises(ValueError, match="w13 must be"):
        tri.route_and_shared_w13(logits, 2, True, 1, x, w13[:8], h)
