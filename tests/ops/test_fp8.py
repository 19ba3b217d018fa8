"""Block-FP8 weights in the ops (ops/quant/fp8.py): block quantisation, the packed-rows loading format and its
row permutations, the references' FP8 variants (fp32 math on the dequantised values) and the dequantising
wrapper select_kernels puts in front of dense kernels."""

from __future__ import annotations

import pytest
import torch

from deltaserve.ops import FP8_WEIGHT_OPS, _dequantizing, select_kernels
from deltaserve.ops.linear import reference as linear_ref
from deltaserve.ops.moe import reference as moe_ref
from deltaserve.ops.quant.fp8 import (
    FP8_DTYPE,
    FP8_MAX,
    BlockFp8Weight,
    dequantize_blocks,
    dequantize_packed,
    load_packed_rows,
    pack_rows,
    quantize_blocks,
)


def _holder(n: int, k: int, g: int = 128, c: int = 128, lead: tuple = ()) -> BlockFp8Weight:
    return BlockFp8Weight(torch.zeros(*lead, n, k, dtype=FP8_DTYPE), torch.zeros(*lead, -(-n // g), -(-k // c)), g, c)


@pytest.mark.parametrize("shape", [(200, 300), (128, 256), (3, 5), (2, 130, 129)])
def test_quantize_blocks_layout_and_error(shape):
    w = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    q, s = quantize_blocks(w)
    assert q.dtype == FP8_DTYPE and q.shape == w.shape
    assert s.shape == (*shape[:-2], -(-shape[-2] // 128), -(-shape[-1] // 128)) and s.dtype == torch.float32
    assert q.float().abs().amax() == FP8_MAX          # each block's amax maps to the largest e4m3 value
    deq = dequantize_blocks(q, s)
    # e4m3 has 3 mantissa bits: relative rounding error <= 2^-4 of each element (normal range)
    assert ((deq - w).abs() <= w.abs() * 2 ** -4 + s.amax() * 2 ** -9).all()
    q2, s2 = quantize_blocks(deq)                     # the dequantised weight is a fixed point
    assert torch.equal(q2.float(), q.float()) and torch.equal(s2, s)


def test_packed_rows_round_trip_and_dequantise():
    w = torch.randn(200, 300)
    q, s = quantize_blocks(w)
    packed = pack_rows(q, s)
    assert packed.shape == (200, 300 + 3)
    assert torch.equal(dequantize_packed(packed, 300), dequantize_blocks(q, s))
    dst = _holder(200, 300)
    load_packed_rows(dst, 0, packed)
    assert torch.equal(dst.qweight.float(), q.float()) and torch.equal(dst.scale, s)


def test_row_permutations_move_scales_with_their_rows():
    """Rows regrouped by pieces of 32 (a fused projection of small heads): smaller scale groups hold the same
    multipliers, and the permuted weight dequantises to the permuted checkpoint weight."""
    w = torch.randn(256, 64) * torch.logspace(-2, 1, 256)[:, None]    # very different block scales
    q, s = quantize_blocks(w)
    perm = torch.arange(256).view(8, 32).flip(0).reshape(-1)         # piece order reversed
    dst = _holder(256, 64, g=32)
    load_packed_rows(dst, 0, pack_rows(q, s)[perm])
    assert torch.equal(dst.dequantize(), dequantize_blocks(q, s)[perm])
    with pytest.raises(ValueError, match="do not align"):
        load_packed_rows(_holder(256, 64, g=64), 32, pack_rows(q, s)[:64])


def test_column_slices_of_packed_rows():
    """The shared expert's down projection [H, S] cut into S / I column slices (one per stored slice)."""
    w = torch.randn(64, 512)
    q, s = quantize_blocks(w)
    for j in range(2):
        dst = _holder(64, 256)
        load_packed_rows(dst, 0, pack_rows(q, s), columns=(256 * j, 256 * (j + 1)))
        assert torch.equal(dst.dequantize(), dequantize_blocks(q, s)[:, 256 * j : 256 * (j + 1)])


def _fp8_weight(n: int, k: int, lead: tuple = (), seed: int = 0) -> BlockFp8Weight:
    w = torch.randn(*lead, n, k, generator=torch.Generator().manual_seed(seed)) * 0.05
    q, s = quantize_blocks(w)
    return BlockFp8Weight(q, s, 128, 128)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_linear_ops_compute_in_fp32_on_the_dequantised_weight(dtype):
    w = _fp8_weight(200, 136)
    x = torch.randn(5, 136).to(dtype)
    exact = x.float() @ w.dequantize().t()
    y = linear_ref.linear(x, w)
    assert y.dtype == dtype
    torch.testing.assert_close(y, exact.to(dtype), rtol=0, atol=0)
    norm_w, res = torch.randn(136).to(dtype), torch.randn(5, 136).to(dtype)
    dense = linear_ref.rms_norm_linear(x, res, norm_w, 1e-6, w.dequantize(dtype))
    fp8 = linear_ref.rms_norm_linear(x, res, norm_w, 1e-6, w)
    torch.testing.assert_close(fp8[0].float(), dense[0].float(), rtol=2e-2, atol=2e-2)
    assert torch.equal(fp8[1], dense[1]) and torch.equal(fp8[2], dense[2])
    g = torch.randn(5, 136).to(dtype)
    torch.testing.assert_close(linear_ref.gated_linear(x, g, w).float(),
                               linear_ref.gated_linear(x, g, w.dequantize(dtype)).float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("tokens", [1, 7])
def test_reference_fused_moe_fp8_equals_dense_on_the_dequantised_experts(tokens):
    E, inter, H = 5, 96, 136
    w13, w2 = _fp8_weight(2 * inter, H, (E,), 1), _fp8_weight(H, inter, (E,), 2)
    x = torch.randn(tokens, H)
    logits = torch.randn(tokens, E)
    dense = moe_ref.fused_moe_routed(x, w13.dequantize(), w2.dequantize(), logits, 2, True)
    fp8 = moe_ref.fused_moe_routed(x, w13, w2, logits, 2, True)
    torch.testing.assert_close(fp8, dense, rtol=1e-5, atol=1e-6)


def test_dequantizing_wrapper_hands_dense_weights_to_a_dense_kernel():
    seen = []

    def kernel(x, weight, *, other=None):
        seen.append((weight.dtype, None if other is None else other.dtype))
        return x @ weight.t()

    w = _fp8_weight(64, 32)
    x = torch.randn(3, 32, dtype=torch.bfloat16)
    y = _dequantizing(kernel)(x, w, other=w)
    assert seen == [(torch.bfloat16, torch.bfloat16)]
    torch.testing.assert_close(y, x @ w.dequantize(torch.bfloat16).t())


def test_select_kernels_names_the_fp8_path():
    k = select_kernels("cpu", fp8_weights=True)
    assert k.fp8_path == "reference" and "FP8 weights: reference" in k.summary()
    assert select_kernels("cpu").fp8_path == ""
    assert set(FP8_WEIGHT_OPS) <= set(k.backend)


def test_chunked_dequantize_equals_the_expanded_scales(monkeypatch):
    from deltaserve.ops.quant import fp8 as fp8_mod

    monkeypatch.setattr(fp8_mod, "_DEQUANT_CHUNK", 128 * 384)            # several chunks
    w = torch.randn(3, 256, 384)
    q, s = quantize_blocks(w)
    for holder in (BlockFp8Weight(q, s, 128, 128), BlockFp8Weight(q, s.repeat_interleave(4, 1), 32, 128),
                   BlockFp8Weight(q[:, :200], s, 128, 128)):                # the last: N not a multiple of 128
        ref = dequantize_blocks(holder.qweight, s)
        assert torch.equal(holder.dequantize(), ref)
        assert torch.equal(holder.dequantize(torch.bfloat16), ref.to(torch.bfloat16))
