"""Shared pieces of the speculative-decoding engine tests: engines over the embedded model with a fixed K
(adaptive K pinned), the oracle drafter installed from a plain greedy run, and output comparison."""

from __future__ import annotations

import random

from deltaserve import LLM, SamplingParams
from deltaserve.spec.adaptive import AdaptiveK, AdaptivePolicy
from deltaserve.spec.oracle import OracleDrafter

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def spec_llm(k: int = 4, **kw) -> LLM:
    llm = LLM(device="cpu", speculative_config={**NGRAM, "num_speculative_tokens": k}, **kw)
    pin_k(llm, k)
    return llm


def pin_k(llm: LLM, k: int) -> None:
    """Every step drafts k tokens (no cost table, no acceptance)."""
    llm.engine.runner.speculation.adaptive = AdaptiveK(k, AdaptivePolicy.pinned(k))


def use_oracle(llm: LLM, prompts: list[list[int]], plain_outputs, reject_prob: float, seed: int = 0) -> OracleDrafter:
    runs = [(p, o.outputs[0].token_ids) for p, o in zip(prompts, plain_outputs)]
    drafter = OracleDrafter(runs, vocab_size=llm.config.vocab_size, reject_prob=reject_prob, seed=seed)
    llm.engine.runner.speculation.drafter = drafter
    return drafter


def ids(prompts: list[list[int]]) -> list[dict]:
    return [{"prompt_token_ids": p} for p in prompts]


def generate(llm: LLM, prompts, params):
    outs = llm.generate(ids(prompts), params, use_tqdm=False)
    llm.engine.cache.check_integrity()
    assert llm.engine.get_stats().kv_blocks_used == 0
    return outs


def mixed_prompts(n: int, seed: int, lo: int = 5, hi: int = 60, vocab: int = 8000) -> list[list[int]]:
    """Random prompts with repeats inside (so n-gram lookups find matches)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        base = [rng.randrange(vocab) for _ in range(rng.randrange(lo, hi))]
        out.append(base + base[: rng.randrange(1, len(base) + 1)])
    return out


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def tokens(outs) -> list[list[int]]:
    return [c.token_ids for o in outs for c in o.outputs]
