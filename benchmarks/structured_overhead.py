"""Decode throughput with and without a JSON-schema constraint (structured output), batch 1 and 64, on the
embedded default model (CPU by default).

Both runs decode the same prompts for the same number of steps: the constrained requests use a schema whose
string field must be at least 400 characters long, so the grammar cannot end within the run, and every request
is ignore_eos, so both runs count the same decode steps. Decode tokens/s =
B * N / (time(prefill + 1 + N tokens) - time(prefill + 1 token)), so prompt processing is excluded; median of
--repeats. It also prints the host cost per step of filling the masks (`StructuredOutputManager.fill`) and of
applying them (the sampler's `_apply_bitmask`), which is what the constraint adds to a step.

    PYTHONPATH=. python benchmarks/structured_overhead.py [--batch 1 64] [--tokens 32] [--repeats 3] [--device cpu]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deltaserve import LLM, SamplingParams  # noqa: E402
from deltaserve.runner.sampler import _apply_bitmask  # noqa: E402
from deltaserve.sampling_params import StructuredOutputsParams  # noqa: E402

SCHEMA = {"type": "object", "properties": {"text": {"type": "string", "minLength": 400}}, "required": ["text"]}
PROMPTS = ["The meaning of life is", "Once upon a time, there was", "The President said on Tuesday that",
           "In the morning, the old man", "Scientists have discovered that", "She opened the door and"]


def decode_seconds(llm: LLM, batch: int, tokens: int, constrained: bool) -> float:
    """Seconds of `tokens` decode steps for `batch` sequences (prefill + first token excluded)."""
    so = StructuredOutputsParams(json=SCHEMA) if constrained else None

    def run(n: int) -> float:
        params = SamplingParams(temperature=1.0, seed=0, max_tokens=n, ignore_eos=True, structured_outputs=so)
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(batch)]
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == n for o in outs), "a sequence ended early"
        return time.perf_counter() - t0

    return run(tokens + 1) - run(1)


def host_costs(llm: LLM, batch: int) -> tuple[float, float]:
    """(ms to fill `batch` masks, ms to apply them to [batch, vocab] logits) for the schema's string state."""
    mgr = llm.engine.grammars.manager()
    grammar = mgr.compile(StructuredOutputsParams(json=SCHEMA))
    ids = list(range(-batch, 0))
    for i in ids:
        mgr.add(i, grammar, "json")
        for ch in '{"text": "ab':
            tok = llm.tokenizer.encode(ch, add_special_tokens=False)[0]
            mgr.accept(i, tok)
    reps = 20
    t0 = time.perf_counter()
    for _ in range(reps):
        mask = mgr.fill(ids)
    fill = (time.perf_counter() - t0) / reps
    logits = torch.randn(batch, llm.config.vocab_size, device=llm.device)
    t0 = time.perf_counter()
    for _ in range(reps):
        _apply_bitmask(logits.clone(), mask, list(range(batch)))
    apply = (time.perf_counter() - t0) / reps
    for i in ids:
        mgr.remove(i)
    return fill * 1e3, apply * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    llm = LLM(device=args.device, max_num_seqs=max(args.batch))
    print(f"device {llm.device}, {args.tokens} decode steps, median of {args.repeats}")
    for batch in args.batch:
        free, constrained = [], []
        for _ in range(args.repeats):          # interleaved, so machine load hits both alike
            free.append(decode_seconds(llm, batch, args.tokens, False))
            constrained.append(decode_seconds(llm, batch, args.tokens, True))
        f, c = statistics.median(free), statistics.median(constrained)
        fill, apply = host_costs(llm, batch)
        tps = batch * args.tokens
        print(f"batch {batch:3d}: free {tps / f:8.1f} tok/s, json-schema {tps / c:8.1f} tok/s, overhead "
              f"{100 * (c / f - 1):+.1f} %; per step: fill {fill:.3f} ms, apply {apply:.3f} ms, step {1e3 * f / args.tokens:.1f} ms")


if __name__ == "__main__":
    main()
