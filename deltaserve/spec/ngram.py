"""Prompt-lookup drafts (method "ngram"): the sequence's own tokens after the most recent earlier
occurrence of its longest matching suffix n-gram (n from prompt_lookup_max down to prompt_lookup_min).

`NgramIndex` keeps, per n, the end position of the most recent occurrence of every n-gram, updated as
tokens are appended (sequences only grow: accepted tokens are appended, rejected drafts never enter
token_ids), so a proposal is max-min+1 dict lookups instead of a scan of the whole sequence. Plain
Python: the scheduler side owns it, one per sequence."""

from __future__ import annotations

from collections.abc import Sequence


class NgramIndex:
    def __init__(self, min_n: int, max_n: int):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"ngram: need 1 <= prompt_lookup_min <= prompt_lookup_max, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n
        self._tokens: list[int] = []
        # n -> {n-gram: end index of its most recent occurrence that is not the current suffix}
        self._last_end: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(min_n, max_n + 1)}

    def __len__(self) -> int:
        return len(self._tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        for t in tokens:
            self._append(t)

    def sync(self, token_ids: Sequence[int]) -> None:
        """Index the tokens of token_ids not seen yet (token_ids must extend what was indexed)."""
        if len(token_ids) < len(self._tokens):
            raise ValueError(f"ngram: sequence shrank from {len(self._tokens)} to {len(token_ids)} tokens")
        self.extend(token_ids[len(self._tokens):])

    def _append(self, t: int) -> None:
        toks = self._tokens
        # the n-grams ending at the old last token stop being the suffix: register them
        e = len(toks) - 1
        for n, table in self._last_end.items():
            if e - n + 1 >= 0:
                table[tuple(toks[e - n + 1:e + 1])] = e
        toks.append(t)

    def propose(self, k: int) -> list[int]:
        """Up to k draft tokens (fewer where the match sits near the end; [] where nothing matches)."""
        toks, L = self._tokens, len(self._tokens)
        if k <= 0:
            return []
        for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):
            e = self._last_end[n].get(tuple(toks[L - n:]))
            if e is not None:
                return toks[e + 1:e + 1 + k]
        return []


def propose_ngram(token_ids: Sequence[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The same proposal by a direct scan (the reference the index is tested against; O(len) per call)."""
    L = len(token_ids)
    toks = list(token_ids)
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        suffix = toks[L - n:]
        for start in range(L - n - 1, -1, -1):          # most recent occurrence first, not the suffix itself
            if toks[start:start + n] == suffix:
                return toks[start + n:start + n + k]
    return []
