"""Chunked prefill (Triton) against the plain-torch references: mixed lengths around the chunk size in
one batch, GVA head ratios, slots out of order and padded, with and without initial state. The `gpu`
tests at the end run every kept configuration (dispatch.ChunkConfig) at the real Qwen3-Next shape."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import triton
import triton.language as tl

from deltaserve.ops.gdn import gluon_chain
from deltaserve.ops.gdn import reference as ref
from deltaserve.ops.gdn import triton_chunk as tc
from deltaserve.ops.gdn.triton_ut import ut_inverse_blocks, ut_inverse_wide

from .helpers import assert_close, cu_seqlens, gdn_inputs, gen, rel_err

# bf16 activations: outputs are rounded to bf16 (on the GPU kernel 2 also rounds its operands to tf32).
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


def _batch(lengths, ratio, dtype, device, seed, dk=16, dv=32, hk=1):
    if device.type == "cuda" and dtype != torch.float32 and not (
            dk in tc.DEVICE_VERIFIED_DIMS and dv in tc.DEVICE_VERIFIED_DIMS):
        pytest.skip(f"head dims {dk} / {dv} in {dtype}: refused on the GPU (test_unverified_dims_are_refused_on_gpu)")
    hv = hk * ratio
    g = gen(seed)
    T = sum(lengths)
    N = len(lengths)
    slots = N + 3
    q, k, v, a, b, A_log, dt_bias, pool = gdn_inputs(T, hk, hv, dk, dv, slots, g=g, dtype=dtype, device=device)
    perm = torch.randperm(slots, generator=g)[:N]
    idx = perm.to(torch.int32)
    idx[N // 2] = -1                                      # one padded row in the middle
    has_init = (torch.arange(N) % 2 == 0)                 # half start from the pool, half from zero
    return dict(q=q, k=k, v=v, a=a, b=b, A_log=A_log, dt_bias=dt_bias, pool=pool,
                cu=cu_seqlens(lengths, device), idx=idx.to(device), has_init=has_init.to(device), scale=dk ** -0.5)


def _run(fn, d, pool, **extra):
    g, beta = ref.gdn_gating(d["A_log"], d["a"], d["dt_bias"], d["b"])
    return fn(d["q"], d["k"], d["v"], g, beta, scale=d["scale"], cu_seqlens=d["cu"], ssm_state=pool,
              state_indices=d["idx"], has_initial_state=d["has_init"], **extra)


@pytest.mark.parametrize("ratio,dtype", [(1, torch.float32), (2, torch.float32), (4, torch.float32),
                                         (2, torch.bfloat16)])
def test_chunk_matches_reference(ratio, dtype, device):
    # lengths around the chunk size in one batch; the 1000-token sequence once (interpreter time)
    lengths = [65, 1, 1000, 64, 63] if (ratio, dtype) == (2, torch.float32) else [1, 63, 64, 65, 130]
    d = _batch(lengths, ratio, dtype, device, seed=ratio)
    p_ref, p_tri = d["pool"].clone(), d["pool"].clone()
    o_ref = _run(ref.chunk_gated_delta_rule, d, p_ref)
    o_tri = _run(tc.chunk_gated_delta_rule, d, p_tri)
    assert_close(o_tri, o_ref, TOL[dtype], "output")
    assert_close(p_tri, p_ref, TOL[dtype], "state pool")
    padded = d["cu"][len(lengths) // 2].item(), d["cu"][len(lengths) // 2 + 1].item()
    assert (o_tri[padded[0]:padded[1]] == 0).all(), "padded sequence must produce zeros"
    untouched = torch.ones(p_ref.shape[0], dtype=torch.bool)
    untouched[d["idx"][d["idx"] >= 0].long().cpu()] = False
    assert torch.equal(p_tri[untouched.to(device)], d["pool"][untouched.to(device)]), "only live slots may change"


def test_chunk_matches_token_recurrence(device):
    """The chunked form against the literal token-by-token recurrence (fp32)."""
    d = _batch([70, 7, 64], 2, torch.float32, device, seed=7)
    p_rec, p_tri = d["pool"].clone(), d["pool"].clone()
    o_rec = _run(ref.recurrent_gated_delta_rule, d, p_rec)
    o_tri = _run(tc.chunk_gated_delta_rule, d, p_tri)
    assert_close(o_tri, o_rec, 2e-5, "output")
    assert_close(p_tri, p_rec, 2e-5, "state pool")


def test_fused_gates_prefill_matches_reference(device):
    d = _batch([70, 1, 64], 2, torch.bfloat16, device, seed=3)
    kw = dict(A_log=d["A_log"], dt_bias=d["dt_bias"], scale=d["scale"], cu_seqlens=d["cu"],
              state_indices=d["idx"], has_initial_state=d["has_init"])
    p_ref, p_tri = d["pool"].clone(), d["pool"].clone()
    o_ref = ref.gdn_prefill(d["q"], d["k"], d["v"], d["a"], d["b"], ssm_state=p_ref, **kw)
    o_tri = tc.gdn_prefill(d["q"], d["k"], d["v"], d["a"], d["b"], ssm_state=p_tri, **kw)
    assert_close(o_tri, o_ref, TOL[torch.bfloat16], "output")
    assert_close(p_tri, p_ref, TOL[torch.bfloat16], "state pool")


def test_split_prefill_equals_whole(device):
    """A prompt prefilled in two pieces (the second continuing from the pool) == prefilled at once."""
    d = _batch([200], 2, torch.float32, device, seed=11)
    d["idx"][:] = 2
    whole, split = d["pool"].clone(), d["pool"].clone()
    g, beta = ref.gdn_gating(d["A_log"], d["a"], d["dt_bias"], d["b"])
    common = dict(scale=d["scale"], state_indices=d["idx"])
    o_whole = tc.chunk_gated_delta_rule(d["q"], d["k"], d["v"], g, beta, cu_seqlens=d["cu"], ssm_state=whole,
                                        has_initial_state=torch.ones(1, dtype=torch.bool, device=device), **common)
    outs = []
    for lo, hi, init in ((0, 77, False), (77, 200, True)):
        outs.append(tc.chunk_gated_delta_rule(
            d["q"][lo:hi], d["k"][lo:hi], d["v"][lo:hi], g[lo:hi], beta[lo:hi],
            cu_seqlens=cu_seqlens([hi - lo], device), ssm_state=split,
            has_initial_state=torch.tensor([init or True], device=device), **common))
    assert_close(torch.cat(outs), o_whole, 2e-5, "output")
    assert_close(split, whole, 2e-5, "state")


def test_strided_inputs_from_one_projection(device):
    """q, k, v as views into one packed activation (how the layer passes them)."""
    g = gen(5)
    T, hk, hv, dk, dv = 90, 2, 4, 16, 16
    mixed = torch.randn(T, 2 * hk * dk + hv * dv + 8, generator=g).to(device)
    q = mixed[:, : hk * dk].view(T, hk, dk)
    k = mixed[:, hk * dk : 2 * hk * dk].view(T, hk, dk)
    v = mixed[:, 2 * hk * dk : 2 * hk * dk + hv * dv].view(T, hv, dv)
    gg = -torch.rand(T, hv, generator=g).to(device)
    beta = torch.rand(T, hv, generator=g).to(device)
    kw = dict(scale=dk ** -0.5, cu_seqlens=cu_seqlens([T], device),
              state_indices=torch.tensor([0], dtype=torch.int32, device=device),
              has_initial_state=torch.tensor([False], device=device))
    p1 = torch.zeros(1, hv, dk, dv, device=device)
    p2 = p1.clone()
    o_ref = ref.chunk_gated_delta_rule(q, k, v, gg, beta, ssm_state=p1, **kw)
    o_tri = tc.chunk_gated_delta_rule(q, k, v, gg, beta, ssm_state=p2, **kw)
    assert_close(o_tri, o_ref, 2e-5, "output")


def test_unsupported_inputs_raise(device):
    d = _batch([10], 1, torch.float32, device, seed=1, dk=24, dv=16)
    with pytest.raises(ValueError, match="K = 24"):
        _run(tc.chunk_gated_delta_rule, d, d["pool"])
    d = _batch([10], 1, torch.float32, device, seed=1)
    with pytest.raises(ValueError, match="chunk_size"):
        _run(tc.chunk_gated_delta_rule, d, d["pool"], chunk_size=32)
    with pytest.raises(ValueError, match="ssm_state must be float32"):
        _run(tc.chunk_gated_delta_rule, d, d["pool"].to(torch.bfloat16))


@pytest.mark.parametrize("prec", tc.PRECISIONS)
def test_chunk_operand_precisions(prec, device):
    """Every operand precision of the chain (bf16 limbs, one bf16 rounding, tf32, exact) runs and matches the
    reference (the interpreter computes all of them in fp32; the GPU tests check the real roundings)."""
    d = _batch([65, 1, 64], 2, torch.bfloat16, device, seed=9)
    p_ref, p_tri = d["pool"].clone(), d["pool"].clone()
    o_ref = _run(ref.chunk_gated_delta_rule, d, p_ref)
    o_tri = _run(tc.chunk_gated_delta_rule, d, p_tri, config=tc.ChunkConfig(prec=prec))
    assert_close(o_tri, o_ref, TOL[torch.bfloat16], "output")
    assert_close(p_tri, p_ref, TOL[torch.bfloat16], "state pool")


@pytest.mark.parametrize("cfg,word", [(tc.ChunkConfig(prec="fp8"), "prec='fp8'"),
                                      (tc.ChunkConfig(prep="subst"), "prep='subst'"),
                                      (tc.ChunkConfig(layout="rows"), "layout='rows'"),
                                      (tc.ChunkConfig(chain="cuda"), "chain='cuda'"),
                                      (tc.ChunkConfig(bv=48), "bv=48"),
                                      (tc.ChunkConfig(layout="chunk"), "layout='chunk' needs prep='wide'"),
                                      (tc.ChunkConfig(prep="wide", layout="chunk", prec="tf32"), "layout='chunk'"),
                                      (tc.ChunkConfig(prep="wide", layout="chunk", chain="gluon"), "chain='gluon'"),
                                      (tc.ChunkConfig(prep="wide", layout="chunk", chain="gluon_t"),
                                       "chain='gluon_t'")])
def test_chunk_rejects_unsupported_configs(cfg, word, device):
    """A configuration the kernels do not implement is refused, naming the field (a Gluon chain off sm_90 or
    at head dims other than 128 too)."""
    d = _batch([10], 1, torch.bfloat16, device, seed=1)
    with pytest.raises(ValueError, match=word):
        _run(tc.chunk_gated_delta_rule, d, d["pool"].clone(), config=cfg)


def test_chain_stages_fit_the_operand_dtype():
    """3 pipeline stages only with bf16 operand tiles of <= 32 columns: fp32 W / P tiles or 64-column
    slices at 3 stages overflow shared memory."""
    assert tc.ChunkConfig().state_stages() == 3
    assert tc.ChunkConfig(bv=64).state_stages() == 2
    assert tc.ChunkConfig(prec="tf32").state_stages() == 2
    assert tc.ChunkConfig(prec="ieee").state_stages() == 2


def test_default_config_follows_the_shape():
    """64-column slices once (sequences x value heads) fill the SMs, 32 below; exact products for fp32; the
    wide prep and the chunk layout for bf16 at head dims 128, the block prep and the token layout elsewhere."""
    assert tc.default_chunk_config(4, 32, 128, torch.bfloat16).bv == 64
    assert tc.default_chunk_config(1, 32, 128, torch.bfloat16).bv == 32
    assert tc.default_chunk_config(4, 32, 32, torch.bfloat16).bv == 32
    assert tc.default_chunk_config(4, 32, 128, torch.float32).prec == "ieee"
    assert tc.default_chunk_config(1, 32, 128, torch.bfloat16, k=128).layout == "chunk"
    assert tc.default_chunk_config(1, 32, 128, torch.bfloat16).layout == "chunk"
    assert tc.default_chunk_config(1, 32, 64, torch.bfloat16, k=64).layout == "token"
    assert tc.default_chunk_config(1, 32, 128, torch.float32, k=128).layout == "token"
    assert tc.default_chunk_config(4, 32, 128, torch.bfloat16, k=128).prep == "wide"
    assert tc.default_chunk_config(4, 32, 128, torch.float32, k=128).prep == "blocks"
    assert tc.default_chunk_config(4, 32, 64, torch.bfloat16, k=64).prep == "blocks"
    assert tc.default_chunk_config(4, 32, 128, torch.float16, k=128).prep == "blocks"
    # many short sequences: the chunk layout's padded rows would exceed 1.25 T, so the token layout
    assert tc.default_chunk_config(4, 32, 128, torch.bfloat16, k=128, tokens=32768).layout == "chunk"
    assert tc.default_chunk_config(32, 32, 128, torch.bfloat16, k=128, tokens=32 * 1024).layout == "chunk"
    many = tc.default_chunk_config(256, 32, 128, torch.bfloat16, k=128, tokens=256 * 30)
    assert many.layout == "token" and many.prep == "wide" and many.chain == "triton"
    # without the Gluon chain (no sm_90, or the interpreter) the Triton chain everywhere
    assert tc.default_chunk_config(1, 32, 128, torch.bfloat16, k=128, tokens=8192, max_seqlen=8192).chain == "triton"


def test_gluon_chain_choice_follows_the_batch():
    """With the Gluon chain: lengths unknown, 32 untransposed columns while the programs fit one wave, the
    one-consumer transposed chain past it; lengths known, the chain step estimate's pick (one long sequence:
    32 columns; sequences of about the longest length filling the SMs: the two-consumer transposed chain)."""
    def pick(n, tokens=None, max_seqlen=None):
        c = tc.default_chunk_config(n, 32, 128, torch.bfloat16, k=128, tokens=tokens, gluon=True, sms=132,
                                    max_seqlen=max_seqlen)
        assert (c.prep, c.layout) == ("wide", "chunk")
        return c.chain, c.bv

    assert pick(1) == ("gluon", 32)
    assert pick(2) == ("gluon_t", 64)
    assert pick(1, 32768, 32768) == ("gluon", 32)
    assert pick(4, 32768, 8192) == ("gluon_t", 128)
    assert pick(4, 8192 + 3 * 128, 8192) == ("gluon", 32)
    assert pick(2, 32768, 16384) == ("gluon_t", 64)


def test_chunk_wide_state_slices(device):
    """64-column state slices (one program per 64 value columns) == the reference."""
    d = _batch([65, 1, 70], 2, torch.bfloat16, device, seed=6, dk=16, dv=64)
    p_ref, p_tri = d["pool"].clone(), d["pool"].clone()
    o_ref = _run(ref.chunk_gated_delta_rule, d, p_ref)
    o_tri = _run(tc.chunk_gated_delta_rule, d, p_tri, config=tc.ChunkConfig(bv=64))
    assert_close(o_tri, o_ref, TOL[torch.bfloat16], "output")
    assert_close(p_tri, p_ref, TOL[torch.bfloat16], "state pool")


@pytest.mark.parametrize("dtype,l2norm", [(torch.float32, True), (torch.bfloat16, False), (torch.bfloat16, True)])
def test_wide_prep_matches_reference(dtype, l2norm, device):
    """The wide prep (whole-tile inverse, norms from the Gram diagonals, loads first) against the reference:
    bf16 with the in-kernel norms (fp16 inverse), fp32 activations (exact fp32 products: the fp32 tolerance) and
    without the in-kernel key norms (tf32 products: fp16's range bound needs unit keys)."""
    if device.type == "cuda":
        pytest.skip("the GPU refuses the wide prep at these head dims (FAST_PATH_DIMS)")
    d = _batch([65, 1, 70], 2, dtype, device, seed=20)
    if not l2norm:
        d["q"], d["k"] = (torch.nn.functional.normalize(x.float(), dim=-1).to(dtype) for x in (d["q"], d["k"]))
    p_ref, p_var = d["pool"].clone(), d["pool"].clone()
    o_ref = _run(ref.chunk_gated_delta_rule, d, p_ref, use_qk_l2norm_in_kernel=l2norm)
    cfg = tc.ChunkConfig(prep="wide", prec="ieee" if dtype == torch.float32 else "bf16x2")
    o_var = _run(tc.chunk_gated_delta_rule, d, p_var, config=cfg, use_qk_l2norm_in_kernel=l2norm)
    assert_close(o_var, o_ref, TOL[dtype], "output")
    assert_close(p_var, p_ref, TOL[dtype], "state pool")


@pytest.mark.parametrize("ratio,bv", [(1, 32), (2, 16), (4, 32)])
def test_chunk_layout_matches_token_layout_and_reference(ratio, bv, device):
    """The wide prep on the chunk layout (per-chunk zero-padded prep buffers, the TMA-descriptor chain) on
    lengths 1, 63, 64, 65, 130 in one batch, half from an initial state, one padded row: the reference's
    results, and the token layout's bit for bit under the interpreter (the same products of the same
    operands; only where they are stored and how they are loaded differ)."""
    if device.type == "cuda":
        pytest.skip("the GPU refuses the chunk layout at these head dims; test_chunk_layout_vs_token_layout_gpu "
                    "covers it at the real shape")
    lengths = [1, 63, 64, 65, 130]
    d = _batch(lengths, ratio, torch.bfloat16, device, seed=40 + ratio)
    p_ref, p_tok, p_chk = d["pool"].clone(), d["pool"].clone(), d["pool"].clone()
    o_ref = _run(ref.chunk_gated_delta_rule, d, p_ref)
    o_tok = _run(tc.chunk_gated_delta_rule, d, p_tok, config=tc.ChunkConfig(bv=bv, prep="wide"))
    o_chk = _run(tc.chunk_gated_delta_rule, d, p_chk, config=tc.ChunkConfig(bv=bv, prep="wide", layout="chunk"))
    assert_close(o_chk, o_ref, TOL[torch.bfloat16], "output")
    assert_close(p_chk, p_ref, TOL[torch.bfloat16], "state pool")
    assert torch.equal(o_chk, o_tok) and torch.equal(p_chk, p_tok)
    assert (o_chk[64:128] == 0).all(), "padded sequence gives zeros"
    untouched = torch.ones(d["pool"].shape[0], dtype=torch.bool)
    untouched[d["idx"][d["idx"] >= 0].long().cpu()] = False
    assert torch.equal(p_chk[untouched.to(p_chk.device)], d["pool"][untouched.to(p_chk.device)])


@pytest.mark.parametrize("layout", ["token", "chunk"])
def test_wide_prep_fused_gates_and_strided_inputs(layout, device):
    """gdn_prefill (gates from their pre-activations) through the wide prep == the block prep, with q, k, v as
    strided views of one projection row (which TMA cannot read whole: the pointer loads; q's rows through a
    descriptor over that row in the chunk layout)."""
    if device.type == "cuda":
        pytest.skip("the GPU refuses the wide prep at these head dims")
    lengths = [70, 1, 64]
    d = _batch(lengths, 2, torch.bfloat16, device, seed=5)
    T, hk, dk = d["q"].shape
    hv, dv = d["v"].shape[1:]
    row = torch.randn(T, 2 * hk * dk + hv * dv + 8, generator=gen(9)).to(device, torch.bfloat16)
    q = row[:, :hk * dk].view(T, hk, dk)
    k = row[:, hk * dk:2 * hk * dk].view(T, hk, dk)
    v = row[:, 2 * hk * dk:2 * hk * dk + hv * dv].view(T, hv, dv)
    kw = dict(A_log=d["A_log"], dt_bias=d["dt_bias"], scale=d["scale"], cu_seqlens=d["cu"],
              state_indices=d["idx"], has_initial_state=d["has_init"])
    p_blk, p_wide = d["pool"].clone(), d["pool"].clone()
    o_blk = tc.gdn_prefill(q, k, v, d["a"], d["b"], ssm_state=p_blk, config=tc.ChunkConfig(), **kw)
    o_wide = tc.gdn_prefill(q, k, v, d["a"], d["b"], ssm_state=p_wide,
                            config=tc.ChunkConfig(prep="wide", layout=layout), **kw)
    assert_close(o_wide, o_blk, TOL[torch.bfloat16] / 2, "output")
    assert_close(p_wide, p_blk, 1e-3, "state pool")


def test_chunk_layout_prep_buffers_are_padded_per_chunk(device):
    """The chunk layout's prep buffers: each sequence's chunks at its chunk offsets, rows past a sequence's
    end exactly zero (W, U, P, the K copy and the decay factors d), e^G_last the last row's decay."""
    if device.type == "cuda":
        pytest.skip("the GPU refuses the chunk layout at these head dims")
    lengths = [70, 1]
    d = _batch(lengths, 2, torch.bfloat16, device, seed=6)
    g, beta = ref.gdn_gating(d["A_log"], d["a"], d["dt_bias"], d["b"])
    cfg = tc.ChunkConfig(prep="wide", layout="chunk")
    bufs = tc.launch_prep(d["q"], d["k"], d["v"], g, beta, False, None, None, d["scale"], d["cu"], 2, True, cfg)
    HV, HK, C = 2, 1, 71 // 64 + 1 + 2
    W = bufs["Wb"].view(C, HV, 64, -1)
    U = bufs["Ub"].view(C, HV, 64, -1)
    Kc = bufs["Kb"].view(C, HK, 64, -1)
    # chunks: sequence 0 -> 0 (tokens 0-63), 1 (64-69); sequence 1 -> 2 (token 70)
    for ch, start, rows in ((1, 64, 6), (2, 70, 1)):
        for buf in (W[ch], U[ch], Kc[ch]):
            assert (buf[:, rows:] == 0).all()
        assert (bufs["Cb"][ch, :, 0, rows:] == 0).all()
        assert torch.equal(Kc[ch, 0, :rows], d["k"][start:start + rows, 0])
    G = torch.cumsum(g[64:70].float(), 0)
    assert_close(bufs["Lb"][1], torch.exp(G[-1]), 1e-6, "e^G_last")


@pytest.mark.gpu
def test_unverified_dims_are_refused_on_gpu():
    """bf16 head dims 16 / 32 gave non-finite outputs on the H200 (exact under the interpreter):
    the GPU refuses them loudly; fp32 activations (fp32 FMA products, which passed there) are accepted."""
    from .test_gpu import _inputs

    q, k, v, g, beta = _inputs([70], 1, 2, seed=3)
    kw = dict(scale=0.25, cu_seqlens=cu_seqlens([70], "cuda"), state_indices=torch.zeros(1, dtype=torch.int32,
              device="cuda"), has_initial_state=torch.zeros(1, dtype=torch.bool, device="cuda"))
    q, k, v = q[..., :32], k[..., :32], v[..., :32]
    pool = torch.zeros(1, 2, 32, 32, device="cuda")
    with pytest.raises(ValueError, match="not verified on the GPU"):
        tc.chunk_gated_delta_rule(q.contiguous(), k.contiguous(), v.contiguous(), g, beta, ssm_state=pool, **kw)
    o = tc.chunk_gated_delta_rule(q.float().contiguous(), k.float().contiguous(), v.float().contiguous(), g, beta,
                                  ssm_state=pool, **kw)
    assert torch.isfinite(o).all()


def test_ut_inverse_entries_are_bounded():
    """The range argument of the fp16 inverse (triton_ut): with unit keys, 0 <= beta <= 2 and decays <= 1,
    |(I + A)^-1|_ij <= max(1, max beta), also for identical or opposite keys and beta = 2 (float64 solve)."""
    g = gen(3)
    worst = 0.0
    for t in range(60):
        k = torch.randn(64, 16, generator=g, dtype=torch.float64)
        if t % 3 == 1:  # one key, signs flipped at random
            k = k[:1] * torch.where(torch.rand(64, 1, generator=g) < 0.5, -1.0, 1.0).double()
        k = torch.nn.functional.normalize(k, dim=-1)
        beta = torch.rand(64, generator=g, dtype=torch.float64) * 2 if t % 2 else torch.full((64,), 2.0).double()
        G = (-torch.rand(64, generator=g, dtype=torch.float64) * (t % 4) * 0.1).cumsum(0)
        A = (beta[:, None] * (k @ k.T) * torch.exp((G[:, None] - G[None, :]).tril())).tril(-1)
        T = torch.linalg.solve_triangular(torch.eye(64).double() + A, torch.eye(64).double(), upper=False)
        worst = max(worst, (T.abs().max() / beta.max().clamp(min=1.0)).item())
    assert worst <= 1.0 + 1e-9, f"max |T| / max(1, beta) = {worst}"


@triton.jit
def _wide_inverse_kernel(A_ptr, T_ptr, BT: tl.constexpr, PREC: tl.constexpr):
    r = tl.arange(0, BT)
    A = tl.load(A_ptr + r[:, None] * BT + r[None, :])
    tl.store(T_ptr + r[:, None] * BT + r[None, :], ut_inverse_wide(A, BT, PREC))


@pytest.mark.parametrize("prec,tol", [("ieee", 1e-6), ("tf32", 4e-3), ("fp16", 4e-3)])
@pytest.mark.parametrize("kind", ["random-keys", "identical-keys"])  # ids without spaces
@pytest.mark.parametrize("bt", [16, 32, 64])
def test_ut_inverse_wide(bt, kind, prec, tol, device):
    """The whole-tile UT inverse (every doubling level on the whole tile) against a float64 triangular solve:
    exact fp32 products to fp32 accuracy, tf32 / fp16 operands (11-bit significands) to ~1e-3 of max |T| = 1;
    identical keys with beta = 1 (binomial powers of A: no power series is formed)."""
    g = gen(18)
    if kind == "random-keys":
        k = torch.nn.functional.normalize(torch.randn(bt, 128, generator=g), dim=-1)
        A = (torch.rand(bt, 1, generator=g) * (k @ k.T)).tril(-1)
    else:
        A = torch.ones(bt, bt).tril(-1)
    T = torch.empty(bt, bt, device=device)
    _wide_inverse_kernel[(1,)](A.to(device), T, BT=bt, PREC=prec)
    eye = torch.eye(bt, dtype=torch.float64)
    want = torch.linalg.solve_triangular(eye + A.double(), eye, upper=False)
    assert_close(T.cpu().double(), want, tol, "inverse")


@triton.jit
def _inverse_kernel(A_ptr, T_ptr, BT: tl.constexpr):
    r = tl.arange(0, BT)
    A = tl.load(A_ptr + r[:, None] * BT + r[None, :])
    tl.store(T_ptr + r[:, None] * BT + r[None, :], ut_inverse_blocks(A, BT, "ieee"))


@pytest.mark.parametrize("kind", ["random keys", "identical keys"])
def test_ut_inverse_by_doubling(kind, device):
    """The tensor-core UT inverse (I + A)^-1 (recursive doubling: batched 16 x 16 diagonal blocks, then
    the 32- and 64-wide joins) against a float64 triangular solve, including identical keys with beta = 1,
    where powers of A grow to binomial sizes (a power series would cancel them; the joins never form them)."""
    g = gen(17)
    if kind == "random keys":
        k = torch.nn.functional.normalize(torch.randn(64, 128, generator=g), dim=-1)
        A = (torch.rand(64, 1, generator=g) * (k @ k.T)).tril(-1)
    else:
        A = torch.ones(64, 64).tril(-1)
    T = torch.empty(64, 64, device=device)
    _inverse_kernel[(1,)](A.to(device), T, BT=64)
    eye = torch.eye(64, dtype=torch.float64)
    want = torch.linalg.solve_triangular(eye + A.double(), eye, upper=False)
    assert_close(T.cpu().double(), want, 1e-6, "inverse")


# ---- real shape, every kept configuration (GPU only) ---------------------------------------------

_WIDE = dict(prep="wide", layout="chunk")
GPU_CONFIGS = {
    "default": None,
    "blocks-bv32": tc.ChunkConfig(bv=32),
    "blocks-bv64": tc.ChunkConfig(bv=64),
    "blocks-bf16": tc.ChunkConfig(prec="bf16"),
    "wide-token-bv32": tc.ChunkConfig(prep="wide", bv=32),
    "wide-token-bv64": tc.ChunkConfig(prep="wide", bv=64),
    "wide-chunk-bv32": tc.ChunkConfig(bv=32, **_WIDE),
    "wide-chunk-bv64": tc.ChunkConfig(bv=64, **_WIDE),
    "gluon-bv32": tc.ChunkConfig(bv=32, chain="gluon", **_WIDE),
    "gluon_t-bv64": tc.ChunkConfig(bv=64, chain="gluon_t", **_WIDE),
    "gluon_t-bv128": tc.ChunkConfig(bv=128, chain="gluon_t", **_WIDE),
}


def _needs_gluon(cfg):
    if cfg is not None and cfg.gluon and not gluon_chain.supported(torch.device("cuda")):
        pytest.skip("the Gluon chain needs compute capability 9.0")


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["blocks-bv32", "wide-token-bv32"])
def test_prep_buffers_match_torch_gpu(name):
    """The prep alone (token layout): W, U, P, G and the norms against torch (localises failures); U (fp32,
    where the inverse's rounding shows) within 1e-3."""
    from .test_gpu import HK, HV, D, _inputs, _prep_reference, _report

    lengths = [1, 63, 64, 65, 300]
    q, k, v, g, beta = _inputs(lengths, HK, HV, seed=12)
    bufs = tc.launch_prep(q, k, v, g, beta, False, None, None, D ** -0.5, cu_seqlens(lengths, "cuda"),
                          len(lengths), True, GPU_CONFIGS[name])
    want = _prep_reference(q, k, v, g, beta, lengths, D ** -0.5, HV)
    errs = {b: rel_err(bufs[b], want[b]) for b in ("Wb", "Ub", "Pb", "Gb", "rq", "rk")}
    _report(test="prep_buffers", config=name, **errs)
    for b, err in errs.items():
        assert err < 2e-2, f"{name} {b}: relative error {err:.3g}"
    assert errs["Ub"] < 1e-3, f"{name} U: relative error {errs['Ub']:.3g}"


def _real_shape_mixed_batch():
    """The real-shape mixed batch of the GPU configuration tests: lengths 1, 63, 64, 65, 1000, slots out of
    order, a padded row (slot -1), half the sequences without an initial state."""
    from .test_gpu import HK, HV, D, _inputs

    lengths = [1, 63, 64, 65, 1000]
    q, k, v, g, beta = _inputs(lengths, HK, HV, seed=21)
    pool = torch.randn(len(lengths) + 2, HV, D, D, generator=gen(1)).mul(0.1).cuda()
    kw = dict(scale=D ** -0.5, cu_seqlens=cu_seqlens(lengths, "cuda"),
              state_indices=torch.tensor([5, 0, -1, 3, 1], dtype=torch.int32, device="cuda"),
              has_initial_state=torch.tensor([True, False, True, True, False], device="cuda"))
    return q, k, v, g, beta, pool, kw


def _same_products(name, test, cand, base):
    """`cand` against `base`, a configuration forming the same products of the same operands, on the
    real-shape mixed batch: equal (reported) within a tight tolerance; zeros for the padded sequence."""
    from .test_gpu import _report

    q, k, v, g, beta, pool, kw = _real_shape_mixed_batch()
    p_base, p_cand = pool.clone(), pool.clone()
    o_base = tc.chunk_gated_delta_rule(q, k, v, g, beta, ssm_state=p_base, config=base, **kw)
    o_cand = tc.chunk_gated_delta_rule(q, k, v, g, beta, ssm_state=p_cand, config=cand, **kw)
    _report(test=test, config=name, identical_out=bool(torch.equal(o_cand, o_base)),
            identical_state=bool(torch.equal(p_cand, p_base)),
            out_max_abs=(o_cand.float() - o_base.float()).abs().max().item(), out_rel=rel_err(o_cand, o_base),
            state_rel=rel_err(p_cand, p_base))
    assert_close(o_cand, o_base, 1e-2, "output")
    assert_close(p_cand, p_base, 1e-5, "state")
    assert (o_cand[64:128] == 0).all(), "padded sequence gives zeros"


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(GPU_CONFIGS) + ["default-gates-fused"])
def test_chunk_configs_real_shape_gpu(name):
    """Mixed lengths around the chunk size, a padded row, slots out of order, half without initial state."""
    from .test_gpu import HV, TOL_BF16, _report

    cfg = GPU_CONFIGS.get(name)
    _needs_gluon(cfg)
    q, k, v, g, beta, pool, kw = _real_shape_mixed_batch()
    p_ref, p_tri = pool.clone(), pool.clone()
    if name.endswith("gates-fused"):
        a = torch.randn(q.shape[0], HV, generator=gen(2)).to("cuda", torch.bfloat16)
        b = torch.randn(q.shape[0], HV, generator=gen(3)).to("cuda", torch.bfloat16)
        gk = dict(A_log=torch.linspace(-3.0, 1.0, HV, device="cuda"), dt_bias=torch.zeros(HV, device="cuda"))
        o_ref = ref.gdn_prefill(q, k, v, a, b, ssm_state=p_ref, **gk, **kw)
        o_tri = tc.gdn_prefill(q, k, v, a, b, ssm_state=p_tri, **gk, **kw)
    else:
        o_ref = ref.chunk_gated_delta_rule(q, k, v, g, beta, ssm_state=p_ref, **kw)
        o_tri = tc.chunk_gated_delta_rule(q, k, v, g, beta, ssm_state=p_tri, config=cfg, **kw)
    _report(test="chunk_config_mixed", config=name, out_rel=rel_err(o_tri, o_ref), state_rel=rel_err(p_tri, p_ref))
    assert_close(o_tri, o_ref, TOL_BF16, "output")
    assert_close(p_tri, p_ref, TOL_BF16, "state")
    assert (o_tri[64:128] == 0).all(), "padded sequence gives zeros"


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["wide-chunk-bv32", "wide-chunk-bv64"])
def test_chunk_layout_vs_token_layout_gpu(name):
    """The chunk layout against the token layout behind the same (wide) prep and state slices, on the
    real-shape mixed batch: the same products of the same operands, so equal (reported) within a tight
    tolerance."""
    cand = GPU_CONFIGS[name]
    _same_products(name, "chunk_layout_vs_token", cand, dataclasses.replace(cand, layout="token"))


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["gluon-bv32"])
def test_gluon_chain_vs_triton_chain_gpu(name):
    """The Gluon chain (and the Gluon prep behind it) against the Triton chain behind the Triton prep, on the
    real-shape mixed batch: the same products of the same operands (the state bit for bit on the H200)."""
    cand = GPU_CONFIGS[name]
    _needs_gluon(cand)
    _same_products(name, "gluon_vs_triton_chain", cand, dataclasses.replace(cand, chain="triton"))


@pytest.mark.gpu
@pytest.mark.parametrize("names", [pytest.param(",".join(GPU_CONFIGS), id="all"),
                                   pytest.param("default", id="default")])
def test_chunk_configs_8k_not_less_accurate_than_fla_gpu(names):
    """One 8192-token sequence with slow decay against the fp32 token-by-token recurrence: each
    configuration's output and final-state errors must not exceed FLA's on the same inputs."""
    from .test_gpu import check_8k_not_less_accurate_than_fla

    configs = {name: GPU_CONFIGS[name] for name in names.split(",")}
    if not gluon_chain.supported(torch.device("cuda")):
        configs = {n: c for n, c in configs.items() if c is None or not c.gluon}
    check_8k_not_less_accurate_than_fla(configs, "chunk_8k_configs")


def test_chunk_takes_the_steps_chunk_offsets(device):
    """The step's precomputed chunk offsets give what the op builds itself (the reference ignores them)."""
    from deltaserve.ops.chunks import PREFILL_CHUNK, chunk_offsets

    d = _batch([3, 65, 1], 2, torch.float32, device, seed=9)
    offsets = chunk_offsets(d["cu"], PREFILL_CHUNK)
    p_own, p_given, p_ref = d["pool"].clone(), d["pool"].clone(), d["pool"].clone()
    o_own = _run(tc.chunk_gated_delta_rule, d, p_own)
    o_given = _run(tc.chunk_gated_delta_rule, d, p_given, chunk_offsets=offsets)
    o_ref = _run(ref.chunk_gated_delta_rule, d, p_ref, chunk_offsets=offsets)
    assert torch.equal(o_given, o_own) and torch.equal(p_given, p_own)
    assert_close(o_given, o_ref, TOL[torch.float32], "output")
