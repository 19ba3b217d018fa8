"""Dense small-M projection (Triton GEMV kernels) against the reference F.linear: every M up to one past
the crossover, odd N and K, both kernels (CUDA-core and tensor-core), split K, fp32 and bf16, strided
rows of x, leading dims, the F.linear fallback above the crossover, bad inputs; real shapes on the GPU."""

from __future__ import annotations

import inspect
import os
import pathlib
import subprocess
import sys

import pytest
import torch

from deltaserve.ops.linear import reference as ref
from deltaserve.ops.linear import triton as tri
from deltaserve.ops.linear.triton_gemv import check_config

from .helpers import assert_close, gen, randn

# fp32: summation order only (dot kernel: IEEE fp32 products). bf16: one rounding of the output.
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}
FMA = tri.LinearConfig(block_n=4, block_k=32, warps=2)
FMA_SPLIT = tri.LinearConfig(block_n=8, block_k=16, warps=2, split_k=4)
DOT = tri.LinearConfig(block_n=16, block_k=32, warps=4, stages=2, dot=True)
DOT_SPLIT = tri.LinearConfig(block_n=16, block_k=16, warps=4, stages=2, dot=True, split_k=3)


def _inputs(M, N, K, dtype, device, seed):
    g = gen(seed)
    x = randn(M, K, g=g, dtype=dtype, device=device)
    w = randn(N, K, g=g, dtype=dtype, device=device, scale=K ** -0.5)
    return x, w


def _want(x, w):
    """The reference in fp32 (on bf16 inputs: exact products, one rounding at the end)."""
    return ref.linear(x.float(), w.float()).to(x.dtype)


@pytest.mark.parametrize("M", range(1, tri.GEMV_MAX_M + 2))
def test_every_m_default_config(M, device):
    """Default tiles at every M through the crossover (+1: the F.linear fallback)."""
    N, K = 37, 80
    x, w = _inputs(M, N, K, torch.float32, device, seed=M)
    cfg = tri.default_linear_config(M, N, K)
    assert (cfg is None) == (M > tri.GEMV_MAX_M)
    assert_close(tri.linear(x, w), _want(x, w), TOL[torch.float32], f"M={M} cfg={cfg}")


@pytest.mark.parametrize("M", [1, 3, 8])
def test_default_config_large_n(M, device):
    """The default tiles of a large-N shape (the many-program branch of the rule), odd K."""
    N, K = 2200, 72
    x, w = _inputs(M, N, K, torch.bfloat16, device, seed=20 + M)
    assert tri.default_linear_config(M, N, K) is not None
    assert_close(tri.linear(x, w), _want(x, w), TOL[torch.bfloat16], f"M={M} {tri.default_linear_config(M, N, K)}")


@pytest.mark.parametrize("cfg", [FMA, FMA_SPLIT, DOT, DOT_SPLIT], ids=["fma", "fma-split", "dot", "dot-split"])
@pytest.mark.parametrize("M,dtype", [(1, torch.float32), (3, torch.float32), (2, torch.bfloat16),
                                     (5, torch.bfloat16), (4, torch.float16)])
def test_kernels_odd_shapes(cfg, M, dtype, device):
    """N and K not multiples of the tiles (masks on both edges), each kernel, with and without split K."""
    N, K = 45, 93
    x, w = _inputs(M, N, K, dtype, device, seed=7 * M)
    got = tri.linear(x, w, config=cfg)
    assert got.dtype == dtype and got.shape == (M, N)
    assert_close(got, _want(x, w), TOL[dtype], f"{cfg} M={M} {dtype}")


def test_strided_rows_and_leading_dims(device):
    """x rows with a stride larger than K (a column slice of a wider tensor), and [B, S, K] inputs."""
    N, K = 24, 40
    g = gen(11)
    wide = randn(3, K + 24, g=g, device=device)
    x = wide[:, 8:8 + K]
    assert not x.is_contiguous() and x.stride(-1) == 1
    w = randn(N, K, g=g, device=device)
    for cfg in (FMA, DOT, None):
        assert_close(tri.linear(x, w, config=cfg), _want(x, w), TOL[torch.float32], f"strided rows {cfg}")
    x3 = randn(2, 2, K, g=g, device=device)
    got = tri.linear(x3, w)
    assert got.shape == (2, 2, N)
    assert_close(got, _want(x3, w), TOL[torch.float32], "leading dims")
    x1 = randn(K, g=g, device=device)
    assert_close(tri.linear(x1, w), _want(x1, w), TOL[torch.float32], "1-D x")


def test_split_partials_cover_every_column(device):
    """Split K where K is not a multiple of the split: every output written (poisoned output detects a
    missed column), the sum equals the unsplit kernel's to fp32 rounding."""
    M, N, K = 2, 19, 70
    x, w = _inputs(M, N, K, torch.float32, device, seed=5)
    whole = tri.linear(x, w, config=tri.LinearConfig(block_n=4, block_k=16, warps=2))
    for split in (2, 3, 8):
        got = tri.linear(x, w, config=tri.LinearConfig(block_n=4, block_k=16, warps=2, split_k=split))
        assert_close(got, whole, 1e-6, f"split {split}")


def test_empty_dims(device):
    w = torch.ones(5, 0, device=device)
    assert torch.equal(tri.linear(torch.ones(2, 0, device=device), w), torch.zeros(2, 5, device=device))
    assert tri.linear(torch.ones(0, 8, device=device), torch.ones(5, 8, device=device)).shape == (0, 5)


@pytest.mark.parametrize("make, match", [
    (lambda d: (torch.zeros(2, 8, device=d), torch.zeros(4, 9, device=d)), r"x must be \[\.\.\., 9\]"),
    (lambda d: (torch.zeros(2, 8, device=d), torch.zeros(4, 8, 1, device=d)), r"weight must be \[N, K\]"),
    (lambda d: (torch.zeros(2, 8, device=d), torch.zeros(4, 8, device=d, dtype=torch.bfloat16)), "share a dtype"),
    (lambda d: (torch.zeros(2, 8, device=d, dtype=torch.int32), torch.zeros(4, 8, device=d, dtype=torch.int32)),
     "unsupported dtype"),
    (lambda d: (torch.zeros(8, 2, device=d).t(), torch.zeros(4, 8, device=d)), "x must be contiguous"),
    (lambda d: (torch.zeros(2, 8, device=d), torch.zeros(8, 4, device=d).t()), "weight must be contiguous"),
])
def test_bad_inputs_raise(make, match, device):
    x, w = make(device)
    with pytest.raises(ValueError, match=match):
        tri.linear(x, w)


def test_bad_configs_raise(device):
    x, w = torch.zeros(2, 32, device=device), torch.zeros(16, 32, device=device)
    with pytest.raises(ValueError, match="block_n=3 must be a power of two"):
        tri.linear(x, w, config=tri.LinearConfig(block_n=3))
    with pytest.raises(ValueError, match="dot=True needs block_n"):
        tri.linear(x, w, config=tri.LinearConfig(block_n=8, dot=True))
    with pytest.raises(ValueError, match="dot=False supports at most 16 rows"):
        tri.linear(torch.zeros(17, 32, device=device), w, config=tri.LinearConfig())


def test_default_rule_is_deterministic_and_valid():
    """The tile rule gives a valid config for every small M at the model shapes, the same every call."""
    for M in range(1, tri.GEMV_MAX_M + 1):
        for K, N in ((2048, 12352), (4096, 2048), (2048, 257), (2048, 248320), (5120, 34816), (17408, 5120)):
            cfg = tri.default_linear_config(M, N, K)
            assert cfg == tri.default_linear_config(M, N, K)
            cublas = (M > 16 and N > tri.SMALL_N) or (M >= 2 and K >= 4096 and N >= 24576)
            assert (cfg is None) == cublas, (M, N, K)
            if cfg is not None:
                check_config(cfg, M)
    assert tri.default_linear_config(tri.GEMV_MAX_M + 1, 2048, 2048) is None


def test_launch_rules_import_without_triton():
    """config.py (the tile and fold rules) imports no triton: the rules are readable and testable anywhere."""
    code = "import sys, deltaserve.ops.linear.config; sys.exit('triton' in sys.modules)"
    root = pathlib.Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root, env={**os.environ, "PYTHONPATH": str(root)})


def test_fallback_above_the_crossover_is_cublas_path(device):
    """Above the crossover (M = 17 at a large N) `linear` is F.linear itself: bit-identical."""
    x, w = _inputs(17, tri.SMALL_N + 3, 24, torch.float32, device, seed=9)
    assert tri.default_linear_config(17, tri.SMALL_N + 3, 24) is None
    assert torch.equal(tri.linear(x, w), torch.nn.functional.linear(x, w))


def test_signature_matches_the_reference():
    want = [(p.name, p.kind) for p in inspect.signature(ref.linear).parameters.values()]
    got = [(p.name, p.kind) for p in inspect.signature(tri.linear).parameters.values() if p.name != "config"]
    assert got == want


# ---- real shapes on the GPU ------------------------------------------------------------------------

REAL = [(2048, 12352), (4096, 2048), (2048, 9216), (2048, 257), (2048, 248320), (5120, 34816), (17408, 5120)]


@pytest.mark.gpu
@pytest.mark.parametrize("K,N", REAL)
def test_real_shapes_gpu(K, N, device):
    """bf16 at the model shapes, every M through the crossover: within bf16 rounding of the fp32 product
    and of cuBLAS (summation order only)."""
    g = torch.Generator(device=device).manual_seed(K + N)
    w = (torch.randn(N, K, device=device, generator=g) * K ** -0.5).to(torch.bfloat16)
    for M in (1, 2, 3, 4, 8, 16, 32):
        x = torch.randn(M, K, device=device, generator=g).to(torch.bfloat16)
        got = tri.linear(x, w)
        assert_close(got, _want(x, w), 1e-2, f"K={K} N={N} M={M} vs fp32")
        assert_close(got, torch.nn.functional.linear(x, w), 1.6e-2, f"K={K} N={N} M={M} vs cuBLAS")


@pytest.mark.gpu
def test_graph_replay_gpu(device):
    """Captured in a CUDA graph (split K included), a replay on new inputs equals an eager call."""
    K, N = 4096, 2048
    g = torch.Generator(device=device).manual_seed(3)
    w = torch.randn(N, K, device=device, generator=g).to(torch.bfloat16)
    for M in (1, 8):
        x = torch.randn(M, K, device=device, generator=g).to(torch.bfloat16)
        cfg = tri.default_linear_config(M, N, K)
        tri.linear(x, w)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = tri.linear(x, w)
        x.copy_(torch.randn(M, K, device=device, generator=g))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, tri.linear(x, w)), f"M={M} {cfg}: graph replay differs from eager"
