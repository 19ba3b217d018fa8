"""Isolation of the requests of a packed prefill batch: one sequence's non-finite inputs (inf / NaN in its q, k or
v rows, in its gates, or in its initial state) must not change any other sequence's outputs or final state by a
single bit. Each case runs the whole op (`chunk_gated_delta_rule`: prep and chain) twice on the same batch, once
with the poisoned sequences' inputs finite and once poisoned, and compares the other sequences bit for bit.

The lengths are not multiples of the 64-token chunk, and each poisoned sequence follows a shorter one, so the last
chunk of the sequence before it is a partial tile whose 64 rows reach into it (the rows a TMA load brings in past a
sequence's end, which the wide prep's TMA loads must not use). Under the interpreter (CPU) the configurations of
head dims 128 run at head dims 32 (the interpreter accepts them there; TMA descriptors are emulated, out-of-bounds
rows zero-filled past T as on the device); on a CUDA device the same cases run at the real Qwen3-Next shape, the chain there being the
default's (Gluon on the H200)."""

from __future__ import annotations

import functools

import pytest
import torch

from deltaserve.ops.gdn import gluon_chain
from deltaserve.ops.gdn import reference as ref
from deltaserve.ops.gdn import triton_chunk as tc
from deltaserve.ops.gdn.triton_prep import tma_rows

from .helpers import cu_seqlens, gen

LENGTHS = (1, 63, 65, 130, 200)
BAD = (1, 3)                      # poisoned sequences: 63 rows after a 1-row one, 130 rows after a 65-row one
SLOTS = (4, 0, 6, 2, 5)           # pool slots, out of order; 1 and 3 stay untouched
NONFINITE = (float("inf"), float("-inf"), float("nan"))


def _shape(device):
    """(key heads, value heads, head dim): small under the interpreter, the real shape on the GPU."""
    return (1, 2, 32) if device.type == "cpu" else (16, 32, 128)


def _config(name: str, device, N: int, hv: int) -> tc.ChunkConfig | None:
    """The configuration under test. "default": the bf16 default of head dims 128 (the wide prep, the chunk layout;
    the Gluon chain and prep on the H200, the Triton ones under the interpreter). "token": the wide prep on the
    token layout (what the op picks for batches of many short sequences). "blocks": the block prep (other head
    dims, fp16). "fp32": fp32 activations (exact products). "gluon_t": the transposed Gluon chain (sm_90 only)."""
    gluon = device.type == "cuda" and gluon_chain.supported(device)
    base = tc.default_chunk_config(N, hv, 128, torch.float32 if name == "fp32" else torch.bfloat16, k=128,
                                   gluon=gluon)
    if name in ("default", "fp32"):
        return base
    if name == "token":
        return tc.ChunkConfig(bv=base.bv, prep="wide")
    if name == "blocks":
        return tc.ChunkConfig(bv=base.bv)
    if not gluon:
        pytest.skip("the Gluon chain needs compute capability 9.0")
    return tc.ChunkConfig(bv=64, prep="wide", layout="chunk", chain="gluon_t")


@functools.cache
def _inputs(device_type: str, dtype: torch.dtype):
    """The finite batch (CPU tensors; moved to the device by the caller)."""
    hk, hv, d = _shape(torch.device(device_type))
    g = gen(41)
    T = sum(LENGTHS)
    q = torch.randn(T, hk, d, generator=g).to(dtype)
    k = torch.randn(T, hk, d, generator=g).to(dtype)
    v = torch.randn(T, hv, d, generator=g).to(dtype)
    a = torch.randn(T, hv, generator=g).to(dtype)
    b = torch.randn(T, hv, generator=g).to(dtype)
    A_log = torch.linspace(-3.0, 1.5, hv)
    dt_bias = torch.randn(hv, generator=g) * 0.5
    pool = torch.randn(len(SLOTS) + 2, hv, d, d, generator=g) * 0.3
    return dict(q=q, k=k, v=v, a=a, b=b, A_log=A_log, dt_bias=dt_bias, pool=pool)


def _bad_rows() -> torch.Tensor:
    cu = cu_seqlens(list(LENGTHS), "cpu")
    return torch.cat([torch.arange(cu[n].item(), cu[n + 1].item()) for n in BAD])


def _poisoned(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """x with the given rows (first dim) replaced by inf, -inf and NaN in turn along every other dim."""
    out = x.clone()
    idx = torch.arange(out[rows].numel(), device=x.device).reshape(out[rows].shape)
    out[rows] = torch.tensor(NONFINITE, dtype=torch.float32, device=x.device)[idx % 3].to(out.dtype)
    return out


def _run(device, name: str, poison: str, fused: bool):
    """The whole op on the batch with the sequences BAD poisoned in `poison` ("" for none; "q", "k", "v", "qkv",
    "gates": g and beta, "ab": the gates' pre-activations, "state": the initial states): outputs and pool. fused:
    the gates from their pre-activations in the kernel (gdn_prefill)."""
    dtype = torch.float32 if name == "fp32" else torch.bfloat16
    d = {n: x.to(device, copy=True) for n, x in _inputs(device.type, dtype).items()}
    rows = _bad_rows().to(device)
    for x in poison if poison in ("q", "k", "v", "qkv", "ab") else "":  # each named input
        d[x] = _poisoned(d[x], rows)
    if poison == "state":
        slots = torch.tensor([SLOTS[n] for n in BAD], device=device)
        d["pool"] = _poisoned(d["pool"], slots)
    hv = d["v"].shape[1]
    kw = dict(scale=d["q"].shape[-1] ** -0.5, cu_seqlens=cu_seqlens(list(LENGTHS), device),
              state_indices=torch.tensor(SLOTS, dtype=torch.int32, device=device),
              has_initial_state=torch.ones(len(LENGTHS), dtype=torch.bool, device=device),
              config=_config(name, device, len(LENGTHS), hv), ssm_state=d["pool"])
    if fused:
        o = tc.gdn_prefill(d["q"], d["k"], d["v"], d["a"], d["b"], A_log=d["A_log"], dt_bias=d["dt_bias"], **kw)
    else:
        g, beta = ref.gdn_gating(d["A_log"], d["a"], d["dt_bias"], d["b"])
        if poison == "gates":
            g, beta = _poisoned(g, rows), _poisoned(beta, rows)
        o = tc.chunk_gated_delta_rule(d["q"], d["k"], d["v"], g, beta, **kw)
    return o, d["pool"]


@functools.cache
def _clean(device_type: str, name: str, fused: bool):
    return _run(torch.device(device_type), name, "", fused)


def _leaks(device, name: str, poison: str) -> list[str]:
    """What differs in the sequences outside BAD between the clean and the poisoned run."""
    fused = poison == "ab"
    o_clean, p_clean = _clean(device.type, name, fused)
    o_bad, p_bad = _run(device, name, poison, fused)
    cu = cu_seqlens(list(LENGTHS), "cpu").tolist()
    out = []
    for n in range(len(LENGTHS)):
        if n in BAD:
            continue
        rows = slice(cu[n], cu[n + 1])
        if not torch.isfinite(o_clean[rows].float()).all():
            out.append(f"sequence {n}: non-finite output in the clean run")
        if not torch.equal(o_bad[rows], o_clean[rows]):
            diff = o_bad[rows].float() - o_clean[rows].float()
            out.append(f"sequence {n} (length {LENGTHS[n]}) output: {int((diff != 0).sum())} entries differ, "
                       f"{int((~torch.isfinite(o_bad[rows].float())).sum())} non-finite")
        s = SLOTS[n]
        if not torch.equal(p_bad[s], p_clean[s]):
            out.append(f"sequence {n} final state: {int((p_bad[s] != p_clean[s]).sum())} entries differ, "
                       f"{int((~torch.isfinite(p_bad[s])).sum())} non-finite")
    untouched = [s for s in range(p_clean.shape[0]) if s not in SLOTS]
    if not torch.equal(p_bad[untouched], p_clean[untouched]):
        out.append("a pool slot outside the batch changed")
    return out


# (configuration, what is poisoned): every input of the default (bf16 at head dims 128); q, k, v at once for the
# other forms (the wide prep on the token layout, the block prep, fp32, the transposed Gluon chain)
CASES = ([("default", p) for p in ("q", "k", "v", "gates", "ab", "state")]
         + [("token", "qkv"), ("blocks", "qkv"), ("fp32", "qkv"), ("gluon_t", "v"), ("gluon_t", "qkv")])


@pytest.mark.parametrize("name,poison", CASES)
def test_poisoned_sequence_leaves_the_others_bitwise_unchanged(name, poison, device):
    """Non-finite inputs of two sequences of a packed batch: every other sequence's outputs and final state bit for
    bit those of the run where those inputs are finite (and finite), untouched pool slots unchanged."""
    leaks = _leaks(device, name, poison)
    assert not leaks, f"{name}: poison in {poison!r} of sequences {BAD} leaked: " + "; ".join(leaks)


@pytest.mark.gpu
def test_poisoned_sequence_in_packed_projection_gpu():
    """The default at the real shape on q / k / v as views of one packed projection row (as the model hands them
    over; TMA reads them), with a 1000-token sequence after the poisoned ones: the other sequences bit for bit."""
    from .test_gdn_wide_prep import _packed

    lengths = [1, 63, 65, 130, 200, 1000]
    hk, hv, dim = _shape(torch.device("cuda"))
    g = gen(43)
    T = sum(lengths)
    d = dict(q=torch.randn(T, hk, dim, generator=g), k=torch.randn(T, hk, dim, generator=g),
             v=torch.randn(T, hv, dim, generator=g))
    d = {n: x.to("cuda", torch.bfloat16) for n, x in d.items()}
    gate = (-torch.rand(T, hv, generator=g)).cuda()
    beta = torch.rand(T, hv, generator=g).cuda()
    pool = (torch.randn(len(lengths), hv, dim, dim, generator=g) * 0.3).cuda()
    cu = cu_seqlens(lengths, "cuda")
    bad = torch.cat([torch.arange(cu[n].item(), cu[n + 1].item()) for n in BAD]).cuda()
    kw = dict(scale=dim ** -0.5, cu_seqlens=cu, state_indices=torch.arange(len(lengths), dtype=torch.int32,
                                                                             device="cuda"),
              has_initial_state=torch.ones(len(lengths), dtype=torch.bool, device="cuda"))
    runs = []
    for poison in (False, True):
        x = {n: _poisoned(t, bad) if poison else t for n, t in d.items()}
        q, k, v = _packed(x, 0)
        assert all(tma_rows(t) for t in (q, k, v))
        p = pool.clone()
        runs.append((tc.chunk_gated_delta_rule(q, k, v, gate, beta, ssm_state=p, **kw), p))
    (o0, p0), (o1, p1) = runs
    for n in range(len(lengths)):
        if n in BAD:
            continue
        rows = slice(cu[n].item(), cu[n + 1].item())
        assert torch.isfinite(o0[rows].float()).all()
        assert torch.equal(o1[rows], o0[rows]), f"sequence {n}: output changed"
        assert torch.equal(p1[n], p0[n]), f"sequence {n}: final state changed"
