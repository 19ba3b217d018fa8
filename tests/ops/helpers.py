"""Random inputs in the ops' layouts and a relative-error check."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want| (fp32); 0 when both are zero."""
    got, want = got.float(), want.float()
    scale = want.abs().max().item()
    diff = (got - want).abs().max().item()
    return diff / scale if scale else diff


def assert_close(got: torch.Tensor, want: torch.Tensor, tol: float, what: str = "") -> None:
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} vs {tuple(want.shape)}"
    assert torch.isfinite(got.float()).all(), f"{what}: non-finite values"
    err = rel_err(got, want)
    assert err <= tol, f"{what}: relative error {err:.3g} > {tol:.3g}"


def cu_seqlens(lengths: list[int], device) -> torch.Tensor:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32, device=device)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(*shape, g: torch.Generator, dtype=torch.float32, device="cpu", scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=g) * scale).to(dtype=dtype, device=device)


def gdn_inputs(T: int, hk: int, hv: int, dk: int, dv: int, slots: int, *, g: torch.Generator, dtype, device):
    """q, k, v activations, pre-activation gates (a, b), gate parameters and an initial state pool.
    A_log / dt_bias span slow and fast decays as trained models do (g from ~-0.001 to ~-10)."""
    q = randn(T, hk, dk, g=g, dtype=dtype, device=device)
    k = randn(T, hk, dk, g=g, dtype=dtype, device=device)
    v = randn(T, hv, dv, g=g, dtype=dtype, device=device)
    a = randn(T, hv, g=g, dtype=dtype, device=device)
    b = randn(T, hv, g=g, dtype=dtype, device=device)
    A_log = torch.linspace(-3.0, 1.5, hv).to(device)
    dt_bias = randn(hv, g=g, device=device, scale=0.5)
    pool = randn(slots, hv, dk, dv, g=g, device=device, scale=0.3)
    return q, k, v, a, b, A_log, dt_bias, pool


def compile_for_sm90(script: str, *args) -> dict:
    """Run tests/ops/<script> (an sm_90 compile of a Gluon kernel) in a subprocess without the Triton interpreter
    (Gluon kernels cannot be compiled once it is on, and the op tests switch it on for CPU machines) and return the
    JSON it prints last."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in [env.get("PYTHONPATH")] if p])
    run = subprocess.run([sys.executable, os.path.join(os.path.dirname(__file__), script), *map(str, args)],
                         capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def require_fla(module: str = "fla.ops.gated_delta_rule"):
    """Import flash-linear-attention for a comparison with it. Where a CUDA device is present (where these GPU
    comparisons run) a missing FLA fails the test instead of skipping it, unless DELTASERVE_REQUIRE_FLA=0 opts
    out (then it skips); on CPU it skips."""
    import importlib

    import pytest

    try:
        return importlib.import_module(module)
    except ImportError as exc:
        if torch.cuda.is_available() and os.environ.get("DELTASERVE_REQUIRE_FLA", "1") != "0":
            pytest.fail(f"the comparison with flash-linear-attention needs {module} ({exc}); install FLA or set "
                        "DELTASERVE_REQUIRE_FLA=0 to skip it")
        pytest.skip(f"{module} not installed")
