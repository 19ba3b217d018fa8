"""Gating activations (Triton) against the plain-torch references: strided row views as the layers pass
them, odd widths, fp32 and bf16 (one rounding instead of the reference's two: one bf16 ulp)."""

from __future__ import annotations

import pytest
import torch

from deltaserve.ops.activation import reference as ref
from deltaserve.ops.activation import triton as tri

from .helpers import assert_close, gen, randn

TOL = {torch.float32: 1e-6, torch.bfloat16: 1e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_matches_reference(dtype, device):
    x = randn(5, 2 * 1100, g=gen(0), dtype=dtype, device=device, scale=3.0)
    assert_close(tri.silu_and_mul(x), ref.silu_and_mul(x), TOL[dtype], "silu_and_mul")
    x3 = x.view(5, 2, 1100)                                      # leading dims merge
    assert_close(tri.silu_and_mul(x3), ref.silu_and_mul(x3), TOL[dtype], "3-d")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sigmoid_mul_matches_reference(dtype, device):
    # o and gate as halves of one wider tensor: strided rows, like the attention layer's q/gate split
    both = randn(7, 2 * 1030, g=gen(1), dtype=dtype, device=device, scale=3.0)
    o, gate = both[:, :1030], both[:, 1030:]
    assert_close(tri.sigmoid_mul(o, gate), ref.sigmoid_mul(o, gate), TOL[dtype], "sigmoid_mul")


def test_bad_inputs_raise(device):
    with pytest.raises(ValueError, match="even"):
        tri.silu_and_mul(torch.zeros(3, 5, device=device))
    with pytest.raises(ValueError, match="one shape"):
        tri.sigmoid_mul(torch.zeros(3, 4, device=device), torch.zeros(3, 5, device=device))
