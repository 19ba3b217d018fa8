"""Causal conv1d (prefill over packed sequences, one-token update) and the RMSNorm variants (Triton)
against their references. In bf16 the results are bit-exact: same fp32 arithmetic, one rounding."""

from __future__ import annotations

import pytest
import torch

from deltaserve.ops.conv1d import reference as conv_ref
from deltaserve.ops.conv1d import triton as conv_tri
from deltaserve.ops.norm import reference as norm_ref
from deltaserve.ops.norm import triton as norm_tri

from .helpers import assert_close, cu_seqlens, gen, randn


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conv_prefill_matches_reference(dtype, device):
    g = gen(1)
    D, W = 40, 4
    lengths = [1, 2, 3, 70, 0, 64, 65]
    T = sum(lengths)
    x = randn(T, D + 6, g=g, dtype=dtype, device=device)[:, :D]          # strided rows
    w = randn(D, W, g=g, dtype=dtype, device=device)
    pool = randn(9, W - 1, D, g=g, dtype=dtype, device=device)
    idx = torch.tensor([3, 0, 8, -1, 2, 5, 1], dtype=torch.int32, device=device)
    has_init = torch.tensor([True, True, False, True, True, False, True], device=device)
    kw = dict(cu_seqlens=cu_seqlens(lengths, device), state_indices=idx, has_initial_state=has_init)
    p_ref, p_tri = pool.clone(), pool.clone()
    y_ref = conv_ref.causal_conv1d_fn(x, w, conv_state=p_ref, **kw)
    y_tri = conv_tri.causal_conv1d_fn(x, w, conv_state=p_tri, **kw)
    tol = 1e-6 if dtype == torch.float32 else 0.0
    assert_close(y_tri, y_ref, tol, "output")
    assert_close(p_tri, p_ref, tol, "conv windows")


def test_conv_update_matches_reference_and_continues_prefill(device):
    """prefill 5 tokens then 3 updates == prefill of all 8 (window hand-over between the two kernels)."""
    g = gen(2)
    D, W = 24, 4
    x = randn(8, D, g=g, device=device)
    w = randn(D, W, g=g, device=device)
    one = torch.tensor([1], dtype=torch.int32, device=device)
    pool = torch.zeros(2, W - 1, D, device=device)
    whole = conv_ref.causal_conv1d_fn(x, w, conv_state=pool.clone(), cu_seqlens=cu_seqlens([8], device),
                                      state_indices=one, has_initial_state=torch.tensor([False], device=device))
    p = pool.clone()
    outs = [conv_tri.causal_conv1d_fn(x[:5], w, conv_state=p, cu_seqlens=cu_seqlens([5], device), state_indices=one,
                                      has_initial_state=torch.tensor([False], device=device))]
    for t in range(5, 8):
        p_ref = p.clone()
        want = conv_ref.causal_conv1d_update(x[t:t + 1], w, conv_state=p_ref, state_indices=one)
        got = conv_tri.causal_conv1d_update(x[t:t + 1], w, conv_state=p, state_indices=one)
        assert_close(got, want, 1e-6, "update output")
        assert_close(p, p_ref, 0.0, "update window")
        outs.append(got)
    assert_close(torch.cat(outs), whole, 1e-6, "prefill + updates vs whole")
    pad = torch.tensor([-1], dtype=torch.int32, device=device)
    before = p.clone()
    assert (conv_tri.causal_conv1d_update(x[:1], w, conv_state=p, state_indices=pad) == 0).all()
    assert torch.equal(p, before), "padded row must not touch the pool"


@pytest.mark.parametrize("activation", ["silu", "sigmoid"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_gated_matches_reference(activation, dtype, device):
    g = gen(3)
    x = randn(7, 3, 32, g=g, dtype=dtype, device=device)
    z = randn(7, 3 * 32 + 5, g=g, dtype=dtype, device=device)[:, :96].view(7, 3, 32)   # strided, like the layer
    w = randn(32, g=g, dtype=dtype, device=device)
    want = norm_ref.rms_norm_gated(x, z, w, 1e-6, activation=activation)
    got = norm_tri.rms_norm_gated(x, z, w, 1e-6, activation=activation)
    assert_close(got, want, 1e-6 if dtype == torch.float32 else 0.0, "output")
    with pytest.raises(ValueError, match="unsupported gate activation"):
        norm_tri.rms_norm_gated(x, z, w, 1e-6, activation="gelu")


@pytest.mark.parametrize("zero_centered", [True, False])
def test_rms_norm_matches_reference(zero_centered, device):
    g = gen(4)
    x = randn(5, 96, g=g, dtype=torch.bfloat16, device=device)
    r = randn(5, 96, g=g, dtype=torch.bfloat16, device=device)
    w = randn(96, g=g, dtype=torch.bfloat16, device=device, scale=0.1)
    assert_close(norm_tri.rms_norm(x, w, 1e-6, zero_centered=zero_centered),
                 norm_ref.rms_norm(x, w, 1e-6, zero_centered=zero_centered), 0.0, "no residual")
    y_ref, s_ref = norm_ref.rms_norm(x, w, 1e-6, zero_centered=zero_centered, residual=r)
    y_tri, s_tri = norm_tri.rms_norm(x, w, 1e-6, zero_centered=zero_centered, residual=r)
    assert_close(y_tri, y_ref, 0.0, "with residual")
    assert_close(s_tri, s_ref, 0.0, "residual sum")


def test_conv_prefill_takes_the_steps_chunk_offsets(device):
    """The step's precomputed chunk offsets (ForwardBatch.prefill_chunk_offsets) give what the op builds itself;
    offsets of the wrong shape are refused."""
    from deltaserve.ops.chunks import PREFILL_CHUNK, chunk_offsets

    g = gen(3)
    D, W = 24, 4
    lengths = [5, 70, 1]
    x = randn(sum(lengths), D, g=g, device=device)
    w = randn(D, W, g=g, device=device)
    pool = randn(4, W - 1, D, g=g, device=device)
    cu = cu_seqlens(lengths, device)
    kw = dict(cu_seqlens=cu, state_indices=torch.tensor([2, 0, 3], dtype=torch.int32, device=device),
              has_initial_state=torch.tensor([True, False, True], device=device))
    p_own, p_given = pool.clone(), pool.clone()
    y_own = conv_tri.causal_conv1d_fn(x, w, conv_state=p_own, **kw)
    y_given = conv_tri.causal_conv1d_fn(x, w, conv_state=p_given, chunk_offsets=chunk_offsets(cu, PREFILL_CHUNK), **kw)
    assert torch.equal(y_given, y_own) and torch.equal(p_given, p_own)
    with pytest.raises(ValueError, match="chunk_offsets must be int32"):
        conv_tri.causal_conv1d_fn(x, w, conv_state=p_given, chunk_offsets=chunk_offsets(cu[:-1], PREFILL_CHUNK), **kw)
