"""A drafter for tests and benchmarks: it proposes the tokens the target will produce, read from
continuations recorded in a plain (non-speculative) greedy run, and replaces each draft by a wrong token
with probability `reject_prob`, so acceptance is high and set while rollback is still exercised (random
weights or random prompts accept almost nothing from a real drafter). Never used for serving."""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch

from .drafter import DraftContext


class OracleDrafter:
    name = "oracle"
    uses_hidden = False

    def __init__(self, runs: Sequence[tuple[Sequence[int], Sequence[int]]], *, vocab_size: int,
                 reject_prob: float = 0.0, seed: int = 0, device: torch.device | str = "cpu"):
        """runs: (prompt token ids, the tokens plain greedy decoding generated after it)."""
        if not 0.0 <= reject_prob <= 1.0:
            raise ValueError(f"reject_prob must be in [0, 1], got {reject_prob}")
        self._by_len: dict[int, dict[tuple[int, ...], list[int]]] = {}
        for prompt, generated in runs:
            self._by_len.setdefault(len(prompt), {})[tuple(prompt)] = list(prompt) + list(generated)
        self.vocab_size, self.reject_prob = vocab_size, reject_prob
        self.rng = random.Random(seed)
        self.device = torch.device(device)

    def _expected(self, tokens: list[int]) -> list[int] | None:
        for n, table in self._by_len.items():
            full = table.get(tuple(tokens[:n])) if len(tokens) >= n else None
            if full is not None and full[: len(tokens)] == tokens:
                return full
        return None

    def propose(self, ctx: DraftContext) -> torch.Tensor:
        out = torch.full((len(ctx.seq_ids), max(ctx.k, 0)), -1, dtype=torch.long)
        for i, tokens in enumerate(ctx.token_ids):
            full = self._expected(tokens)
            if full is None or ctx.k <= 0:
                continue
            drafts = full[len(tokens): len(tokens) + ctx.k]
            for j, t in enumerate(drafts):
                if self.rng.random() < self.reject_prob:
                    t = (t + 1 + self.rng.randrange(self.vocab_size - 1)) % self.vocab_size
                out[i, j] = t
        return out.to(self.device)

    def release(self, seq_ids: list[int]) -> None:
        pass
