"""MoE routing (Triton topk_softmax, route_and_shared_w13) against the reference: plain top-k softmax,
renormalised or not, and with the shared expert's slices appended from the router's last logit column;
the shared slices' w13 rows computed in the routing launch; bad inputs."""

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
    """After the router GEMV (which releases it early) the routing kernel, launched as its programmatic
    dependent at these batch sizes, picks the reference's experts with its weights, eagerly and in a
    CUDA graph replayed on new inputs (the wait orders its logits read after the GEMV's writes)."""
    from deltaserve.ops.linear import triton as lin

    E, top_k, H = 256, 8, 2048
    g = gen(200 + T)
    router = (randn(E + 1, H, g=g) * H ** -0.5).to(device=device, dtype=torch.bfloat16)
    norm_w = (randn(H, g=g) * 0.1).to(device=device, dtype=torch.bfloat16)
    x, r = (randn(T, H, g=g).to(device=device, dtype=torch.bfloat16) for _ in range(2))

    def run():
        logits = lin.rms_norm_linear(x, r, norm_w, 1e-6, router)[0]
        return logits, *tri.topk_softmax(logits, top_k, True, shared_slices=1)

    def check_against_reference(logits, w, ids, what):
        w_ref, i_ref = ref.topk_softmax(logits, top_k, True, shared_slices=1)
        probs = torch.softmax(logits[:, :E].float(), dim=-1)
        assert torch.equal(probs.gather(1, ids[:, :top_k]), probs.gather(1, i_ref[:, :top_k])), what
        assert_close(w, w_ref, 1e-6, what)

    check_against_reference(*run(), "eager")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = run()
    x.copy_(randn(T, H, g=g).to(device=device, dtype=torch.bfloat16))
    graph.replay()
    torch.cuda.synchronize()
    check_against_reference(*outs, "graph replay")
    for a, b in zip(outs, run()):
        assert torch.equal(a, b), "graph replay differs from eager"


# ---- the routing kernel with the shared slices' w13 rows (route_and_shared_w13) -----------------------

@pytest.mark.parametrize("T,slices,dtype", [(1, 1, torch.float32), (3, 2, torch.float32), (2, 1, torch.bfloat16)])
def test_route_and_shared_w13_routes_as_topk_softmax_and_fills_the_shared_rows(T, slices, dtype, device):
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
    w, ids = tri.route_and_shared_w13(logits, top_k, True, slices, x, w13, h)
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
    with pytest.raises(ValueError, match="inter must be"):
        tri.route_and_shared_w13(logits, 2, True, 1, x, w13, torch.zeros(5, 4, device=device))
    with pytest.raises(ValueError, match="w13 must be"):
        tri.route_and_shared_w13(logits, 2, True, 1, x, w13[:8], h)
