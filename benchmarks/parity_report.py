"""Largest logprob difference against transformers, per family, fp32 and bf16.

Builds the tiny random checkpoints the tests use (every family and layout), runs deltaserve and transformers
(eager attention, torch fallbacks) on prompts of 1..150 tokens, and prints the max / p99 / mean absolute
difference of the prompt logprobs. bf16 rows compare deltaserve-bf16 and transformers-bf16 each against the
transformers fp32 oracle.

    python benchmarks/parity_report.py [--device cuda]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deltaserve import LLM, SamplingParams  # noqa: E402
from tests.conftest import hf_logprobs, hf_reference, random_ids, save_tiny  # noqa: E402
from tests.models.test_parity import SPECS  # noqa: E402


def prompt_lp(llm: LLM, ids: list[int]) -> torch.Tensor:
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0),
                       use_tqdm=False)[0]
    return torch.tensor([out.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))])


def target(lp: torch.Tensor, ids: list[int]) -> torch.Tensor:
    return lp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]


def stats(d: torch.Tensor) -> str:
    d = d.abs()
    return f"max {d.max():.2e}  p99 {d.quantile(0.99):.2e}  mean {d.mean():.2e}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    prompts = [random_ids(n, seed=n) for n in (63, 64, 65, 150)]
    with tempfile.TemporaryDirectory() as tmp:
        for name, spec in SPECS.items():
            path = save_tiny(spec, Path(tmp) / name)
            ref32 = [target(hf_logprobs(hf_reference(path), p), p) for p in prompts]
            ref16 = [target(hf_logprobs(hf_reference(path, torch.bfloat16), p), p) for p in prompts]
            for dtype in ("float32", "bfloat16"):
                llm = LLM(path, device=args.device, dtype=dtype)
                ours = torch.cat([prompt_lp(llm, p) for p in prompts])
                line = f"{name:32s} {dtype:9s} deltaserve vs HF fp32: {stats(ours - torch.cat(ref32))}"
                if dtype == "bfloat16":
                    line += f" | HF bf16 vs HF fp32: {stats(torch.cat(ref16) - torch.cat(ref32))}"
                print(line, flush=True)


if __name__ == "__main__":
    main()
