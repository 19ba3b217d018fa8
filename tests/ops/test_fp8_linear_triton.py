"""The FP8 projection kernels against their references: the per-token-group activation quantisation (bit for bit),
the W8A8 block GEMM (against the same quantisation in torch, then against the dequantised weight's product
within a stated bound), the weight-only GEMM for fp32 x, the FP8 forms of the projection ops (the GEMV up to
16 rows, the GEMM above; dense weights untouched), the loud fallback, and select_kernels' choice. Real shapes
on the GPU (`gpu` marks)."""

from __future__ import annotations

import logging

import pytest
import torch

from deltaserve import ops
from deltaserve.ops.linear import reference as ref
from deltaserve.ops.linear import triton_fp8
from deltaserve.ops.linear.triton_fp8_gemm import quantize_activations, w8a8_gemm
from deltaserve.ops.linear.triton_fp8_gemv import MAX_ROWS, Fp8GemvConfig, fp8_gemv
from deltaserve.ops.quant import fp8

from .helpers import assert_close, gen


def _weight(N, K, device, groups=(128, 128), seed=0):
    w = torch.randn(N, K, generator=gen(seed)) * torch.logspace(-2, 0, N)[:, None]   # block scales that differ
    q, s = fp8.quantize_blocks(w, groups)
    return fp8.BlockFp8Weight(q.to(device), s.to(device), *groups)


def _x(M, K, device, dtype=torch.float32, seed=1):
    x = torch.randn(M, K, generator=gen(seed)) * torch.logspace(-1, 1, K)[None, :]     # groups of different range
    return x.to(device, dtype)


def _within_one_rounding(got, want):
    """got and want are one value rounded twice at most apart: |d| <= 2^-7 |want| (bf16) plus a floor."""
    d = (got.float() - want.float()).abs()
    assert (d <= want.float().abs() * 2 ** -7 + 1e-3 * want.float().abs().max()).all(), d.max()


@pytest.mark.parametrize("M, K, group", [(5, 200, 128), (3, 96, 32), (2, 256, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activation_quant_kernel_is_the_reference_bit_for_bit(device, M, K, group, dtype):
    x = _x(M, K, device, dtype)
    x[1] = 0                                                           # an all-zero row: the floor scale
    q, s = quantize_activations(x, group)
    rq, rs = fp8.quantize_activations(x, group)
    assert q.dtype == fp8.FP8_DTYPE and s.shape == (M, -(-K // group))
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s, rs)
    assert q.float().abs().amax(dim=1)[0] == fp8.FP8_MAX               # the group amax maps to the largest value


@pytest.mark.parametrize("M, N, K, groups", [(20, 40, 200, (128, 128)), (33, 130, 96, (32, 32)),
                                             (17, 17, 256, (8, 64))])
def test_w8a8_gemm_matches_the_same_quantisation_in_torch(device, M, N, K, groups):
    w = _weight(N, K, device, groups)
    x = _x(M, K, device, torch.bfloat16)
    y = w8a8_gemm(x, w)
    assert y.dtype == torch.bfloat16 and y.shape == (M, N)
    _within_one_rounding(y, fp8.w8a8_linear_reference(x, w))


def test_w8a8_gemm_is_within_the_activation_quantisation_bound_of_the_dequantised_product(device):
    """Against bf16 x times the dequantised weight (fp32 math): e4m3 rounds each activation by at most 2^-4
    relative; over K = 512 random terms the product's error stays a few percent of its largest value."""
    w = _weight(96, 512, device)
    x = _x(40, 512, device, torch.bfloat16)
    assert_close(w8a8_gemm(x, w), ref.linear(x, w), 0.03, "w8a8 vs dequantised")


def test_fp32_x_runs_the_gemm_weight_only(device):
    w = _weight(70, 300, device, (32, 32))
    x = _x(24, 300, device)
    torch.testing.assert_close(w8a8_gemm(x, w), ref.linear(x, w), rtol=1e-5, atol=1e-4)


def test_fp8_linear_takes_the_gemv_up_to_its_rows_and_the_gemm_above(device):
    w = _weight(48, 256, device)
    x = _x(MAX_ROWS + 1, 256, device, torch.bfloat16)
    small, large = x[:MAX_ROWS], x
    # up to MAX_ROWS: weight-only (the dequantised product, one rounding); above: W8A8 (its own reference)
    _within_one_rounding(triton_fp8.linear(small, w), ref.linear(small, w))
    _within_one_rounding(triton_fp8.linear(large, w), fp8.w8a8_linear_reference(large, w))
    assert not torch.equal(fp8.w8a8_linear_reference(small, w), ref.linear(small, w)), "the test tells them apart"


@pytest.mark.parametrize("cfg", [Fp8GemvConfig(block_n=4, k_groups=1), Fp8GemvConfig(block_n=8, k_groups=4),
                                 Fp8GemvConfig(block_n=16, k_groups=16), Fp8GemvConfig(block_n=64, dot=True),
                                 Fp8GemvConfig(block_n=16, dot=True, split_k=3)])
def test_fp8_gemv_tiles_agree(device, cfg):
    """One row (the M = 1 kernel: column groups per step, partial last step, K not a multiple of the group),
    and the tensor-core form (K split in 3 over 8 groups: uneven splits): the dequantised product whatever the
    tiles."""
    w = _weight(37, 1000, device, (8, 128))
    for M in (1, 3):
        x = _x(M, 1000, device, torch.bfloat16)
        if M > 1 and not cfg.dot:
            continue
        _within_one_rounding(fp8_gemv(x, w, cfg), ref.linear(x, w))


def test_dense_weights_reach_the_dense_kernels(device):
    dense_w = torch.randn(40, 64, generator=gen(3)).to(device)
    x = _x(3, 64, device)
    from deltaserve.ops.linear import triton as dense

    torch.testing.assert_close(triton_fp8.linear(x, dense_w), dense.linear(x, dense_w), rtol=0, atol=0)


@pytest.mark.parametrize("M", [1, 3, 20])
def test_fp8_projection_ops_match_their_references(device, M):
    K, N = 256, 72
    w = _weight(N, K, device, (8, 128), seed=M)
    x, r = _x(M, K, device), _x(M, K, device, seed=2)
    nw = torch.randn(K, generator=gen(4)).to(device) * 0.1
    got = triton_fp8.rms_norm_linear(x, r, nw, 1e-6, w)
    want = ref.rms_norm_linear(x, r, nw, 1e-6, w)
    for g, e in zip(got, want):      # fp32 x: the weight-only GEMV (M <= 16) or GEMM, exact up to summation order
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)
    gate = _x(M, K, device, seed=5)
    for norm in (None, torch.ones(64, device=device)):
        for act in ("sigmoid", "silu"):
            torch.testing.assert_close(triton_fp8.gated_linear(x, gate, w, norm_weight=norm, activation=act),
                                       ref.gated_linear(x, gate, w, norm_weight=norm, activation=act),
                                       rtol=1e-5, atol=1e-5)


def test_fp8_rms_norm_linear_conv_matches_the_reference(device):
    M, K, N, D, W = 2, 128, 80, 48, 4
    w = _weight(N, K, device, (16, 128))
    x = _x(M, K, device)
    nw = torch.zeros(K, device=device)
    conv_w = torch.randn(D, W, generator=gen(6)).to(device)
    state = torch.randn(3, W - 1, D, generator=gen(7)).to(device)
    slots = torch.tensor([2, -1], device=device)
    ref_state = state.clone()
    got = triton_fp8.rms_norm_linear_conv(x, None, nw, 1e-6, w, conv_weight=conv_w, conv_state=state,
                                          state_indices=slots)
    want = ref.rms_norm_linear_conv(x, None, nw, 1e-6, w, conv_weight=conv_w, conv_state=ref_state,
                                    state_indices=slots)
    for g, e in zip(got, want):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state, ref_state, rtol=1e-5, atol=1e-5)     # the new window row: the projection


def test_a_weight_the_kernels_cannot_take_falls_back_loudly_once(device, caplog):
    """Column groups of 16 (a tiny model's fused projection): the GEMV takes them, the W8A8 GEMM (fp8 dots of
    K >= 32) does not: the dequantising reference, with one warning naming the op and the shape."""
    triton_fp8._warned.clear()
    w = _weight(40, 64, device, (16, 16))
    x = _x(MAX_ROWS + 4, 64, device, torch.bfloat16)
    with caplog.at_level(logging.WARNING, logger="deltaserve.ops.linear.triton_fp8"):
        y1 = triton_fp8.linear(x, w)
        triton_fp8.linear(x, w)
    msgs = [r.message for r in caplog.records]
    assert len(msgs) == 1 and "linear" in msgs[0] and "(40, 64)" in msgs[0] and "W8A8 GEMM" in msgs[0]
    torch.testing.assert_close(y1, ref.linear(x, w), rtol=0, atol=0)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="deltaserve.ops.linear.triton_fp8"):
        triton_fp8.linear(x[:2], w)                                    # the GEMV: taken, no warning
    assert not caplog.records


def test_the_kernels_refuse_what_they_cannot_do(device):
    w = _weight(32, 128, device)
    with pytest.raises(ValueError, match="column group 16"):
        w8a8_gemm(_x(20, 128, device, torch.bfloat16), fp8.BlockFp8Weight(w.qweight, w.scale, 128, 16))
    with pytest.raises(ValueError, match="K = 128"):
        w8a8_gemm(_x(20, 64, device, torch.bfloat16), w)
    with pytest.raises(ValueError, match="x must be"):
        triton_fp8.linear(_x(2, 64, device), w)


def test_select_kernels_picks_the_fp8_forms_once(monkeypatch):
    """Every weight-reading op that runs on Triton gets its FP8 form (no dequantising wrapper), the summary says
    it; the decode-graph backend (no FP8 kernels) keeps the dequantise-per-call path, said too."""
    from deltaserve.ops.moe import triton_fp8 as moe_fp8

    usable = dict(ops.REFERENCE_OPS)
    monkeypatch.setattr(ops, "_triton_ops", lambda device, shapes: (usable, {}, {}))
    k = ops.select_kernels("cuda", fp8_weights=True)
    for name in ("linear", "rms_norm_linear", "rms_norm_linear_conv", "gated_linear"):
        assert getattr(k, name) is triton_fp8.OPS[name]
    assert k.fused_moe is moe_fp8.fused_moe and k.fused_moe_routed is moe_fp8.fused_moe_routed
    assert k.fp8_path.startswith("triton FP8 kernels") and "dequantize" not in k.fp8_path
    assert ops.FP8_GEMV_MAX_ROWS == MAX_ROWS and f"up to {MAX_ROWS} rows" in k.fp8_path
    assert "FP8 weights: triton FP8 kernels" in k.summary()
    assert ops.select_kernels("cuda").linear is usable["linear"], "no FP8 forms without FP8 weights"
    g = ops.select_kernels("cpu", decode_graph_ops=True, fp8_weights=True)
    assert "dequantize-then-decode-graph" in g.fp8_path


# ---- real shapes (GPU) ------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("N, K", [(12288, 2048), (9216, 2048), (2048, 4096), (2049, 2000)])
@pytest.mark.parametrize("M", [17, 64, 300, 2048, 8192])
def test_w8a8_real_shapes(N, K, M):
    w = _weight(N, K, "cuda")
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    y = w8a8_gemm(x, w)
    assert_close(y, fp8.w8a8_linear_reference(x, w), 1e-2, f"w8a8 {M}x{N}x{K}")
    assert_close(y, ref.linear(x, w), 0.05, f"w8a8 vs dequantised {M}x{N}x{K}")


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 2, 4, 8, 16])
@pytest.mark.parametrize("N, K", [(12288, 2048), (2048, 4096), (9216, 2048), (2049, 2000)])
def test_fp8_linear_decode_real_shapes(M, N, K):
    w = _weight(N, K, "cuda")
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    assert_close(triton_fp8.linear(x, w), ref.linear(x, w), 1e-2, f"fp8 gemv {M}x{N}x{K}")


@pytest.mark.gpu
def test_fp8_linear_graph_equals_eager():
    w = _weight(4096, 2048, "cuda")
    for M in (1, 8, 64):
        x = torch.randn(M, 2048, device="cuda", dtype=torch.bfloat16)
        eager = triton_fp8.linear(x, w)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = triton_fp8.linear(x, w)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)


def test_the_fp8_forms_share_the_reference_signatures():
    import inspect

    from deltaserve.ops.moe import triton_fp8 as moe_fp8

    for name, fn in {**triton_fp8.OPS, **moe_fp8.OPS}.items():
        want = [(p.name, p.kind) for p in inspect.signature(ops.REFERENCE_OPS[name]).parameters.values()]
        assert [(p.name, p.kind) for p in inspect.signature(fn).parameters.values()] == want, name
