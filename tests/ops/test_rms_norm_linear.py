"""The pre-norm projection (RMSNorm(x + residual) folded into the GEMV kernels) against its reference
(rms_norm, then linear): both GEMV kernels, with and without a residual, plain and zero-centred norm
weights, fp32 and bf16, strided rows and leading dims; the two-launch path where the default does not
fold (M > 1) and above the crossover; bad inputs; the model with the fused op against the unfused; real
shapes and CUDA-graph replay on the GPU."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch
import torch.nn.functional as F

from deltaserve.ops.linear import reference as ref
from deltaserve.ops.linear import triton as tri
from deltaserve.ops.norm import triton as norm_tri

from .helpers import assert_close, gen, randn

# y: as the GEMV tests (fp32: summation order; bf16: one rounding of the output; the folded norm's operand
# is not rounded to bf16 as the two-launch path's is, a difference within that rounding).
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
C = tri.LinearConfig
# several K steps per program (K = 93): the norm's statistics gathered over the whole main loop
CONFIGS = {"fma": C(block_n=4, block_k=32, warps=2), "fma-wide": C(block_n=2, block_k=128, warps=4, stages=1),
           "dot": C(block_n=16, block_k=32, warps=4, stages=2, dot=True), "default": None}


def _inputs(M, N, K, dtype, device, seed, residual=True):
    g = gen(seed)
    x = randn(M, K, g=g, dtype=dtype, device=device)
    r = randn(M, K, g=g, dtype=dtype, device=device) if residual else None
    nw = randn(K, g=g, dtype=dtype, device=device, scale=0.3)
    w = randn(N, K, g=g, dtype=dtype, device=device, scale=K ** -0.5)
    return x, r, nw, w


def _check(got, want, w, dtype, what):
    y, h, s = got
    y_ref, h_ref, s_ref = want
    assert torch.equal(s, s_ref), f"{what}: the residual sum differs"
    # the normed rows: one rounding of the same product (the mean square summed in another order)
    assert_close(h, h_ref, 1e-6 if dtype == torch.float32 else 8e-3, f"{what}: normed")
    assert_close(y, y_ref, TOL[dtype], f"{what}: y")
    # y is the product of the normed rows it returns (summation order only)
    assert_close(y, F.linear(h.float(), w.float()).to(dtype), TOL[dtype], f"{what}: y vs its own normed rows")


@pytest.mark.parametrize("cfg", list(CONFIGS), ids=list(CONFIGS))
@pytest.mark.parametrize("M,dtype,residual,zc", [
    (1, torch.float32, True, True), (3, torch.bfloat16, True, True), (2, torch.bfloat16, False, True),
    (5, torch.float32, True, False), (1, torch.bfloat16, True, True)])
def test_matches_reference(cfg, M, dtype, residual, zc, device):
    """Odd N and K (masks on both edges of the weight tiles and of the prologue's row chunks)."""
    N, K = 45, 93
    x, r, nw, w = _inputs(M, N, K, dtype, device, seed=M + 10 * residual, residual=residual)
    got = tri.rms_norm_linear(x, r, nw, 1e-6, w, zero_centered=zc, config=CONFIGS[cfg])
    # the reference in fp32 from the rounded sum and normed rows: exact products, one rounding of y
    _, h_ref, s_ref = ref.rms_norm_linear(x, r, nw, 1e-6, w, zero_centered=zc)
    want = (F.linear(h_ref.float(), w.float()).to(dtype), h_ref, s_ref)
    _check(got, want, w, dtype, f"{cfg} M={M} {dtype} residual={residual} zc={zc}")
    if r is None:
        assert got[2] is x, "without a residual the sum is x itself"


def test_leading_dims_and_strided_rows(device):
    N, K = 24, 40
    g = gen(3)
    wide = randn(3, K + 24, g=g, device=device)
    x = wide[:, 8:8 + K]
    r, nw, w = randn(3, K, g=g, device=device), randn(K, g=g, device=device), randn(N, K, g=g, device=device)
    for cfg in (CONFIGS["fma"], CONFIGS["dot"]):
        y, h, s = tri.rms_norm_linear(x, r, nw, 1e-6, w, config=cfg)
        y_ref, h_ref, s_ref = ref.rms_norm_linear(x, r, nw, 1e-6, w)
        assert torch.equal(s, s_ref)
        assert_close(h, h_ref, 1e-6, "strided normed")
        assert_close(y, y_ref, TOL[torch.float32], "strided rows")
    x3, r3 = randn(2, 2, K, g=g, device=device), randn(2, 2, K, g=g, device=device)
    y, h, s = tri.rms_norm_linear(x3, r3, nw, 1e-6, w)
    assert y.shape == (2, 2, N) and h.shape == s.shape == (2, 2, K)
    assert_close(y, ref.rms_norm_linear(x3, r3, nw, 1e-6, w)[0], TOL[torch.float32], "leading dims")


@pytest.mark.parametrize("M, N", [(3, 45), (17, tri.SMALL_N + 3)])
def test_two_launches_where_the_default_does_not_fold(M, N, device):
    """M > 1 (our GEMV tiles) and above the crossover (F.linear): the norm kernel, then `linear`, exactly."""
    K = 24
    x, r, nw, w = _inputs(M, N, K, torch.float32, device, seed=4)
    assert tri.default_prenorm_config(M, N, K) is None
    y, h, s = tri.rms_norm_linear(x, r, nw, 1e-6, w)
    h_want, s_want = norm_tri.rms_norm(x, nw, 1e-6, residual=r)
    assert torch.equal(h, h_want) and torch.equal(s, s_want) and torch.equal(y, tri.linear(h_want, w))
    y, h, s = tri.rms_norm_linear(x, None, nw, 1e-6, w)
    assert s is x and torch.equal(h, norm_tri.rms_norm(x, nw, 1e-6))


def test_default_folds_at_one_row_only():
    for K, N in ((2048, 12352), (2048, 9216), (2048, 257), (5120, 16480), (4096, 2048)):
        assert tri.default_prenorm_config(1, N, K) == tri.default_linear_config(1, N, K) is not None
        assert tri.default_linear_config(1, N, K).split_k == 1
        assert all(tri.default_prenorm_config(M, N, K) is None for M in range(2, tri.GEMV_MAX_M + 2))


def test_empty_rows(device):
    x, r, nw, w = _inputs(0, 5, 8, torch.float32, device, seed=1)
    y, h, s = tri.rms_norm_linear(x, r, nw, 1e-6, w)
    assert y.shape == (0, 5) and h.shape == s.shape == (0, 8)


@pytest.mark.parametrize("change, match", [
    (lambda a: {**a, "norm_weight": a["norm_weight"][:-1]}, r"norm_weight must be \[8\]"),
    (lambda a: {**a, "residual": a["residual"][:, :-1]}, "residual must match x"),
    (lambda a: {**a, "residual": a["residual"].double()}, "residual must match x"),
    (lambda a: {**a, "weight": a["weight"][:, :-1]}, r"x must be \[\.\.\., 7\]"),
    (lambda a: {**a, "config": C(block_n=4, block_k=4, split_k=2)}, "split_k=2: the folded norm needs"),
])
def test_bad_inputs_raise(change, match, device):
    x, r, nw, w = _inputs(2, 4, 8, torch.float32, device, seed=2)
    args = change(dict(x=x, residual=r, norm_weight=nw, eps=1e-6, weight=w))
    with pytest.raises(ValueError, match=match):
        tri.rms_norm_linear(**args)


def test_signature_matches_the_reference():
    want = [(p.name, p.kind) for p in inspect.signature(ref.rms_norm_linear).parameters.values()]
    got = [(p.name, p.kind) for p in inspect.signature(tri.rms_norm_linear).parameters.values() if p.name != "config"]
    assert got == want


# ---- real shapes on the GPU ------------------------------------------------------------------------

REAL = [(2048, 12352), (2048, 257)]   # 35B-A3B GDN in_proj (attention qkv takes the same tiles), router


def _unfused(x, r, nw, w):
    h, s = norm_tri.rms_norm(x, nw, 1e-6, residual=r)
    return tri.linear(h, w), h, s


@pytest.mark.gpu
@pytest.mark.parametrize("K,N", REAL)
def test_real_shapes_equal_the_unfused_kernels_gpu(K, N, device):
    """bf16 at the model's pre-norm projections, every M through the crossover: the fused op equals the
    norm kernel followed by the GEMV (the residual sum exactly; y within the GEMV tolerances)."""
    g = torch.Generator(device=device).manual_seed(K + N)
    w = (torch.randn(N, K, device=device, generator=g) * K ** -0.5).to(torch.bfloat16)
    nw = (torch.randn(K, device=device, generator=g) * 0.3).to(torch.bfloat16)
    for M in (1, 2, 4, 8, 16, 32):
        x, r = (torch.randn(2, M, K, device=device, generator=g) * 4).to(torch.bfloat16).unbind(0)
        y_u, h_u, s_u = _unfused(x, r, nw, w)
        cfg = tri.default_linear_config(M, N, K)
        folded = cfg and dataclasses.replace(cfg, split_k=1)
        for tiles in (None, folded) if cfg is not None else (None,):
            y, h, s = tri.rms_norm_linear(x, r, nw, 1e-6, w, config=tiles)
            what = f"K={K} N={N} M={M} {tiles}"
            assert torch.equal(s, s_u), what
            assert_close(h, h_u, 8e-3, f"{what} normed")
            assert_close(y, y_u, 1e-2, f"{what} vs unfused")
            assert_close(y, F.linear(h.float(), w.float()).to(y.dtype), 1e-2, f"{what} vs fp32")


@pytest.mark.gpu
def test_graph_replay_gpu(device):
    """Captured in a CUDA graph (split K at M = 8), a replay on new inputs equals an eager call."""
    K, N = 2048, 2048
    g = torch.Generator(device=device).manual_seed(5)
    w = torch.randn(N, K, device=device, generator=g).to(torch.bfloat16)
    nw = torch.randn(K, device=device, generator=g).to(torch.bfloat16)
    for M in (1, 8):
        x, r = torch.randn(2, M, K, device=device, generator=g).to(torch.bfloat16).unbind(0)
        tri.rms_norm_linear(x, r, nw, 1e-6, w)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = tri.rms_norm_linear(x, r, nw, 1e-6, w)
        x.copy_(torch.randn(M, K, device=device, generator=g))
        graph.replay()
        torch.cuda.synchronize()
        for a, b in zip(out, tri.rms_norm_linear(x, r, nw, 1e-6, w)):
            assert torch.equal(a, b), f"M={M}: graph replay differs from eager"


# ---- the model with the fused op ---------------------------------------------------------------------

def _batch(seqs, device):
    """seqs: (new tokens, tokens already cached, slot); prefills first; blocks 4 s .. 4 s + 3 of 16 tokens."""
    from deltaserve.batch import ForwardBatch

    ids, pos, mapping, cu, tables = [], [], [], [0], []
    for toks, done, slot in seqs:
        blocks = [4 * slot + j for j in range(4)]
        ids += toks
        pos += list(range(done, done + len(toks)))
        mapping += [blocks[p // 16] * 16 + p % 16 for p in range(done, done + len(toks))]
        cu.append(cu[-1] + len(toks))
        tables.append(blocks)
    n_pre = sum(not (len(t) == 1 and d > 0) for t, d, _ in seqs)
    t = lambda x, dt: torch.tensor(x, dtype=dt, device=device)
    return ForwardBatch(
        input_ids=t(ids, torch.long), positions=t(pos, torch.long), cu_seqlens=t(cu, torch.int32),
        seq_lens=t([d + len(x) for x, d, _ in seqs], torch.int32), state_slots=t([s[2] for s in seqs], torch.int32),
        has_initial_state=t([d > 0 for _, d, _ in seqs], torch.bool), slot_mapping=t(mapping, torch.long),
        block_tables=t(tables, torch.int32), num_prefills=n_pre, num_prefill_tokens=cu[n_pre])


@pytest.mark.parametrize("family", ["qwen3_5_moe", "qwen3_5"])
def test_model_with_the_fused_op_equals_the_unfused(tiny_model, family, device):
    """A tiny MoE / dense model whose pre-norm projections run the Triton op against the same model with
    the reference (norm, then projection): a prefill of two prompts, then decode steps of both sequences
    and of one. On the CPU (interpreter) the norm is folded in at every token count (CUDA-core kernel up
    to 4 rows, else tensor-core, wide tiles); on the GPU the op chooses (folded at one row)."""
    from deltaserve.batch import CacheBuffers
    from deltaserve.models.loader import load_model
    from deltaserve.ops import select_kernels
    from tests.conftest import TinySpec, random_ids

    path = tiny_model(TinySpec(family=family, ratio=2, seed=41, num_layers=4))
    ref_k = select_kernels(device, force_reference=True)

    def fused(x, *args, **kw):   # wide tiles: few programs for the interpreter (the default tiles are tested above)
        cfg = C(block_n=128, block_k=64, dot=x.shape[0] > 4) if device.type == "cpu" else None
        return tri.rms_norm_linear(x, *args, config=cfg, **kw)

    fused_k = dataclasses.replace(ref_k, rms_norm_linear=fused, backend={**ref_k.backend, "rms_norm_linear": "triton"})
    out = []
    for kernels in (ref_k, fused_k):
        model = load_model(path, device=device, dtype=torch.float32, kernels=kernels, show_progress=False)
        cache = CacheBuffers.allocate(model.config, num_slots=2, num_blocks=8, block_size=16, device=device,
                                      dtype=torch.float32)
        a, b = random_ids(5, seed=1), random_ids(3, seed=2)
        steps = [[(a, 0, 0), (b, 0, 1)]] + [[([a[i]], 5 + i, 0), ([b[i]], 3 + i, 1)] for i in range(2)] + \
            [[([a[2]], 7, 0)]]
        with torch.inference_mode():
            out.append(torch.cat([model.compute_logits(model(_batch(s, device), cache)) for s in steps]))
    assert_close(out[1], out[0], 1e-5, f"{family}: fused vs unfused logits")
