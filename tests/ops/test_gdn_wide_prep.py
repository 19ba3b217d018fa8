"""The wide prep's two program bodies (triton_prep._prep_wide_kernel): a chunk whose 64 rows all belong to its
sequence reads k / q / v by TMA, a sequence's partial last chunk (or inputs TMA cannot address) by masked pointer
loads. Both form the same products of the same operands in the same order, so their buffers must be equal
(exactly under the interpreter). The `gpu` test runs them at the real Qwen3-Next shape."""

from __future__ import annotations

import pytest
import torch

from deltaserve.ops.gdn import reference as ref
from deltaserve.ops.gdn import triton_chunk as tc
from deltaserve.ops.gdn.triton_prep import tma_rows

from .helpers import rel_err
from .test_gdn_chunk import _batch

BUFFERS = {"chunk": ("Wb", "Ub", "Pb", "Kb", "Cb", "Lb"), "token": ("Wb", "Ub", "Pb", "Gb", "rq", "rk")}


def _packed(d, pad):
    """q, k, v as the model hands them over: views of one projection row [q | k | v | pad columns], so the row
    stride is not the heads' width (pad = 1 makes it an odd number of bf16, which TMA cannot address)."""
    T = d["q"].shape[0]
    parts = [d[x].reshape(T, -1) for x in "qkv"]
    mixed = torch.cat(parts + [torch.zeros(T, pad, dtype=parts[0].dtype, device=parts[0].device)], 1)
    out, c0 = [], 0
    for x, part in zip("qkv", parts):
        out.append(mixed[:, c0:c0 + part.shape[1]].view(d[x].shape))
        c0 += part.shape[1]
    return out


@pytest.mark.parametrize("layout", ["chunk", "token"])
def test_wide_prep_tma_and_pointer_loads_give_equal_buffers(layout, device):
    """Two key heads (column offsets inside the projection row) on strided views of a packed projection: with an
    aligned row stride TMA reads the whole chunks (a sequence's partial last chunk takes the pointer loads), with
    an unaligned one the pointer loads run throughout. The buffers are exactly equal in both layouts."""
    if device.type == "cuda":
        pytest.skip("the GPU refuses the wide prep at these head dims; test_wide_prep_packed_projection_gpu covers it")
    lengths = [65, 1, 70, 3, 128]
    d = _batch(lengths, 2, torch.bfloat16, device, seed=33, dk=32, dv=32, hk=2)
    g, beta = ref.gdn_gating(d["A_log"], d["a"], d["dt_bias"], d["b"])
    cfg = tc.ChunkConfig(prep="wide", layout=layout)
    bufs = {}
    for pad in (0, 1):
        q, k, v = _packed(d, pad)
        assert all(tma_rows(x) for x in (q, k, v)) == (pad == 0)
        bufs[pad] = tc.launch_prep(q, k, v, g, beta, False, None, None, d["scale"], d["cu"], len(lengths), True, cfg)
    for b in BUFFERS[layout]:
        assert torch.equal(bufs[0][b], bufs[1][b]), (
            f"{layout} {b}: max diff {(bufs[0][b].float() - bufs[1][b].float()).abs().max()}")


def test_tma_rows_rule():
    """TMA reads [T, H, D] as [T, H * D] rows: contiguous heads, 16-byte aligned base and row stride."""
    x = torch.zeros(8, 3, 16, dtype=torch.bfloat16)
    assert tma_rows(x)
    assert not tma_rows(x[:, :, :8])                      # heads not contiguous
    assert not tma_rows(torch.zeros(8, 3 * 16 + 1, dtype=torch.bfloat16)[:, :48].view(8, 3, 16))  # row stride
    assert not tma_rows(torch.zeros(8 * 48 + 1, dtype=torch.bfloat16)[1:].view(8, 3, 16))  # base alignment


@pytest.mark.gpu
def test_wide_prep_packed_projection_gpu():
    """The wide prep at the real shape on q / k / v as views of one packed projection row (as the model hands them
    over), chunk layout: the TMA body's buffers (aligned rows) against the pointer body's (one pad column), equality
    reported, a tight tolerance asserted."""
    from .test_gdn_chunk import _real_shape_mixed_batch
    from .test_gpu import _report

    q, k, v, g, beta, pool, kw = _real_shape_mixed_batch()
    cfg = tc.ChunkConfig(prep="wide", layout="chunk")
    bufs = {}
    for pad in (0, 1):
        qp, kp, vp = _packed(dict(q=q, k=k, v=v), pad)
        assert all(tma_rows(x) for x in (qp, kp, vp)) == (pad == 0)
        bufs[pad] = tc.launch_prep(qp, kp, vp, g, beta, False, None, None, kw["scale"], kw["cu_seqlens"], 5, True,
                                   cfg)
    errs = {b: rel_err(bufs[0][b], bufs[1][b]) for b in BUFFERS["chunk"]}
    _report(test="wide_prep_packed", identical=all(torch.equal(bufs[0][b], bufs[1][b]) for b in BUFFERS["chunk"]),
            **errs)
    for b, err in errs.items():
        assert err < 1e-5, f"{b}: relative error {err:.3g} between the TMA and the pointer loads"
