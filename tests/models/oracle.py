"""The transformers oracle and how deltaserve is judged against it (shared by the parity and GPU oracle
tests): transformers in fp32 on its plain-torch paths is the reference; bf16 is judged by its error
against that reference, which must be no worse than transformers' own bf16 run's."""

from __future__ import annotations

import contextlib
import inspect
import sys
from pathlib import Path

import torch

from tests.conftest import hf_reference

# The functions transformers' GatedDeltaNet layers call through module globals, each resolved at import
# time to flash-linear-attention's / causal-conv1d's kernel when that package imports, else to the torch
# function it decorates.
GDN_FUNCTIONS = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn",
                 "causal_conv1d_update")

BF16_QUANTILES = (0.5, 0.9)
BF16_SLACK = (1.5, 0.01)          # ours <= 1.5 * transformers' bf16 error + 0.01, at each quantile


def target_logprobs(lp_rows: torch.Tensor, ids: list[int]) -> torch.Tensor:
    """logprob of ids[i] given ids[:i], for i >= 1, from rows over the same sequence."""
    return lp_rows[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]


def assert_bf16_error_within(ours: torch.Tensor, ref32: torch.Tensor, ref16: torch.Tensor, what: str) -> None:
    """bf16 cannot match bitwise (different rounding points; MoE routing near-ties flip experts): the
    quantiles of our error against the fp32 oracle must be no worse than transformers' bf16 run's."""
    assert torch.isfinite(ours).all(), f"{what}: non-finite logprobs"
    q = torch.tensor(BF16_QUANTILES, dtype=torch.float64)
    ours_err = (ours.double() - ref32.double()).abs().quantile(q)
    hf_err = (ref16.double() - ref32.double()).abs().quantile(q)
    scale, slack = BF16_SLACK
    assert (ours_err <= scale * hf_err + slack).all(), (
        f"{what}: bf16 error quantiles {BF16_QUANTILES} {ours_err.tolist()} vs transformers' {hf_err.tolist()}")


def gdn_modules(model: torch.nn.Module) -> set:
    """The transformers modeling modules whose GatedDeltaNet layers `model` holds."""
    return {sys.modules[type(m).__module__] for m in model.modules() if type(m).__name__.endswith("GatedDeltaNet")}


@contextlib.contextmanager
def torch_gdn_path(modules):
    """Point transformers' GDN kernels in `modules` at their torch functions for the duration (whether or
    not flash-linear-attention / causal-conv1d are installed), so the oracle shares no kernel with the
    peers deltaserve is benchmarked against. Fails if a name moved or resolves outside transformers."""
    saved = []
    try:
        for mod in modules:
            for name in GDN_FUNCTIONS:
                fn = getattr(mod, name)
                plain = inspect.unwrap(fn)
                assert plain.__code__.co_filename == mod.__file__, (
                    f"{mod.__name__}.{name} unwraps to {plain.__module__}.{plain.__qualname__}, not transformers' torch path")
                saved.append((mod, name, fn))
                setattr(mod, name, plain)
        yield
    finally:
        for mod, name, fn in reversed(saved):
            setattr(mod, name, fn)


def hf_oracle(path: Path, dtype: torch.dtype, device: str | torch.device) -> torch.nn.Module:
    """transformers' model on `device`: eager attention, per-expert (eager) MoE. Run it inside
    torch_gdn_path(gdn_modules(model))."""
    return hf_reference(path, dtype, experts_implementation="eager").to(device)


def assert_greedy_where_bf16_agrees(lp32: torch.Tensor, lp16: torch.Tensor, prompt_len: int,
                                    continuation: list[int], tie: float, what: str) -> None:
    """Teacher-forced greedy check of a bf16 run: lp32 / lp16 are transformers' fp32 / bf16 logprob rows
    over prompt + continuation. Wherever transformers' bf16 argmax is its fp32 argmax, the continuation
    token must be that argmax too, or within `tie` of it in fp32 (a near-tie that bf16 error can flip)."""
    for j, token in enumerate(continuation):
        r32, r16 = lp32[prompt_len - 1 + j], lp16[prompt_len - 1 + j]
        best = int(r32.argmax())
        if token == best or int(r16.argmax()) != best:
            continue
        margin = float(r32[best] - r32[token])
        assert margin < tie, (f"{what}: greedy token {j} is {token}, transformers' fp32 and bf16 pick {best} "
                              f"(fp32 margin {margin:.3g}, tie {tie:.3g})")
