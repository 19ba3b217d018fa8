"""The FP8 decode GEMV (ops/linear/triton_fp8_gemv.py) against the dequantising reference: M from 1 to its
limit, N and K not multiples of 128, small scale groups (a fused projection of small heads), fp32 and bf16;
real shapes on the GPU."""

from __future__ import annotations

import pytest
import torch

from deltaserve.ops.linear import reference as ref
from deltaserve.ops.linear.triton_fp8_gemv import MAX_ROWS, fp8_gemv
from deltaserve.ops.quant.fp8 import BlockFp8Weight, quantize_blocks


def _weight(N, K, device, row_group=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=g) * torch.logspace(-2, 0, N)[:, None]       # block scales that differ
    q, s = quantize_blocks(w)
    s = s.repeat_interleave(128 // row_group, 0)[: -(-N // row_group)]
    return BlockFp8Weight(q.to(device), s.to(device), row_group, 128)


@pytest.mark.parametrize("M", [1, 2, 3, 8, MAX_ROWS])
@pytest.mark.parametrize("N, K, row_group", [(40, 200, 128), (130, 136, 32), (17, 256, 8)])
def test_fp8_gemv_matches_the_reference(device, M, N, K, row_group):
    w = _weight(N, K, device, row_group, seed=M)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(1)).to(device)
    torch.testing.assert_close(fp8_gemv(x, w), ref.linear(x, w), rtol=1e-5, atol=1e-5)


def test_fp8_gemv_bf16_and_leading_dims(device):
    w = _weight(72, 160, device)
    x = torch.randn(2, 3, 160).to(device, torch.bfloat16)
    y = fp8_gemv(x, w)
    assert y.shape == (2, 3, 72) and y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), ref.linear(x, w).float(), rtol=1e-2, atol=1e-2)


def test_fp8_gemv_refuses_what_it_cannot_take(device):
    w = _weight(32, 128, device)
    with pytest.raises(ValueError, match="at most"):
        fp8_gemv(torch.randn(MAX_ROWS + 1, 128).to(device), w)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fp8_gemv(torch.randn(1, 128).to(device), BlockFp8Weight(w.qweight.float(), w.scale, 128, 128))


@pytest.mark.gpu
@pytest.mark.parametrize("N, K", [(12288, 2048), (2048, 4096), (1024, 2048), (2049, 2000)])
@pytest.mark.parametrize("M", [1, 4, 16])
def test_fp8_gemv_real_shapes(N, K, M):
    w = _weight(N, K, "cuda")
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    torch.testing.assert_close(fp8_gemv(x, w).float(), ref.linear(x, w).float(), rtol=1e-2, atol=2e-2)
