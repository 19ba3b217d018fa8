"""Inputs a Gluon chain reads itself instead of the prep's copies (dispatch.ChunkConfig.chain "gluon" /
"gluon_t"): the prep stores U's factor T diag(beta) as two bf16 limbs instead of U = (T diag(beta)) V in fp32 (the
chain forms U = hi V + lo V from them and the chunk's rows of v: the products the prep's bf16x2 U makes, moved),
and the chain reads whole chunks' K rows from k, so the prep writes the zero-padded K copy only for a sequence's
partial last chunk. These tests check the Triton prep's buffers for that (under the interpreter at head dims 32,
where the Gluon prep does not run); the Gluon chain itself: test_gdn_gluon_chain*.py, test_gdn_chunk.py (gpu)."""

from __future__ import annotations

import pytest
import torch

from deltaserve.ops.gdn import reference as ref
from deltaserve.ops.gdn import triton_chunk as tc

from .helpers import assert_close
from .test_gdn_chunk import _batch


def _prep_buffers(lengths, seed, device):
    """The batch and the wide prep's chunk-layout buffers at head dims 32 (interpreter only), for the Triton chain
    and for a Gluon chain."""
    if device.type == "cuda":
        pytest.skip("the GPU refuses head dims 32 in bf16; the real-shape GPU tests of test_gdn_chunk cover it")
    d = _batch(lengths, 2, torch.bfloat16, device, seed=seed, dk=32, dv=32)
    g, beta = ref.gdn_gating(d["A_log"], d["a"], d["dt_bias"], d["b"])
    args = (d["q"], d["k"], d["v"], g, beta, False, None, None, d["scale"], d["cu"], len(lengths), True)
    triton_chain = tc.ChunkConfig(prep="wide", layout="chunk")
    gluon_chain = tc.ChunkConfig(prep="wide", layout="chunk", chain="gluon")
    return d, tc.launch_prep(*args, triton_chain), tc.launch_prep(*args, gluon_chain)


def test_gluon_chain_prep_stores_u_factor_limbs(device):
    """Behind a Gluon chain the prep's Ub holds the two limbs of T diag(beta) per chunk row: hi + lo times the
    chunk's v rows (zeros past the sequence) gives the U the prep stores for the Triton chain."""
    lengths = [65, 1, 70]
    d, base, got = _prep_buffers(lengths, 52, device)
    want = base["Ub"]
    assert got["Ub"].dtype == torch.bfloat16 and got["Ub"].shape == (want.shape[0], 2 * tc.CHUNK)
    hv, dv = d["v"].shape[1:]
    coff = got["coff"].tolist()
    cu = d["cu"].tolist()
    for n, L in enumerate(lengths):
        for c in range(-(-L // tc.CHUNK)):
            t0, left = cu[n] + c * tc.CHUNK, min(tc.CHUNK, L - c * tc.CHUNK)
            vrows = torch.zeros(tc.CHUNK, hv, dv, dtype=torch.float32, device=device)
            vrows[:left] = d["v"][t0:t0 + left].float()
            for h in range(hv):
                r = ((coff[n] + c) * hv + h) * tc.CHUNK
                fac = got["Ub"][r:r + tc.CHUNK].float()
                u = fac[:, :tc.CHUNK] @ vrows[:, h] + fac[:, tc.CHUNK:] @ vrows[:, h]
                assert_close(u, want[r:r + tc.CHUNK], 1e-6, f"sequence {n} chunk {c} head {h}")


def test_gluon_chain_prep_writes_k_copy_only_for_partial_chunks(device):
    """Behind a Gluon chain the TMA prep leaves the K copy of whole chunks unwritten (the chain reads k) and
    writes the zero-padded rows of each sequence's partial last chunk as for the Triton chain."""
    lengths = [65, 64, 70]
    d, want, got = _prep_buffers(lengths, 54, device)
    assert got["k"] is d["k"] and "k" not in want
    hk = d["k"].shape[1]
    coff = got["coff"].tolist()
    for n, L in enumerate(lengths):
        for c in range(-(-L // tc.CHUNK)):
            rows = slice((coff[n] + c) * hk * tc.CHUNK, (coff[n] + c + 1) * hk * tc.CHUNK)
            if L - c * tc.CHUNK < tc.CHUNK:
                assert torch.equal(got["Kb"][rows], want["Kb"][rows]), f"sequence {n} chunk {c}: the padded copy"
