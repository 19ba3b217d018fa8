"""Per-request sampling options with vLLM's names and meanings. Invalid values raise ValueError saying
which field and why."""

from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0          # 0 = greedy
    top_p: float = 1.0                # nucleus mass in (0, 1]
    top_k: int = 0                    # 0 or -1 = all tokens
    min_p: float = 0.0                # drop tokens with p < min_p * p_max
    seed: int | None = None           # per-request seed: same tokens whatever else is in the batch
    max_tokens: int | None = 16       # None = up to the context limit; 0 = prefill only (needs prompt_logprobs)
    min_tokens: int = 0               # EOS / stop token ids are suppressed until this many tokens
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None       # top-n logprobs per generated token (plus the sampled one)
    prompt_logprobs: int | None = None
    repetition_penalty: float = 1.0   # > 1 discourages tokens seen in prompt or output (divides / multiplies logits)
    presence_penalty: float = 0.0     # subtracted once from logits of tokens already generated
    frequency_penalty: float = 0.0    # subtracted per occurrence in the generated tokens
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    detokenize: bool = True
    truncate_prompt_tokens: int | None = None  # keep only the last k prompt tokens; -1 = max_model_len

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    def _validate(self) -> None:
        def fail(field: str, why: str):
            raise ValueError(f"SamplingParams.{field}: {why} (got {getattr(self, field)!r})")

        if not isinstance(self.n, int) or self.n < 1:
            fail("n", "must be an integer >= 1")
        if not _finite(self.temperature) or self.temperature < 0:
            fail("temperature", "must be a finite number >= 0")
        if not _finite(self.top_p) or not 0 < self.top_p <= 1:
            fail("top_p", "must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            fail("top_k", "must be an integer >= 0 (0 or -1 disables it)")
        if not _finite(self.min_p) or not 0 <= self.min_p <= 1:
            fail("min_p", "must be in [0, 1]")
        if self.seed is not None and not isinstance(self.seed, int):
            fail("seed", "must be an integer or None")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool)
                                            or self.max_tokens < 0):
            fail("max_tokens", "must be an integer >= 1 or None (0 only with prompt_logprobs)")
        if self.max_tokens == 0 and self.prompt_logprobs is None:
            fail("max_tokens", "0 (no generated token) needs prompt_logprobs: there would be nothing to return")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            fail("min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            fail("min_tokens", f"must not exceed max_tokens ({self.max_tokens})")
        if any(not isinstance(s, str) or not s for s in self.stop):
            fail("stop", "must be a non-empty string or a list of non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            fail("stop_token_ids", "must be a list of non-negative token ids")
        for field in ("logprobs", "prompt_logprobs"):
            value = getattr(self, field)
            if value is not None and (not isinstance(value, int) or value < 0):
                fail(field, "must be an integer >= 0 or None")
        k = self.truncate_prompt_tokens
        if k is not None and (not isinstance(k, int) or isinstance(k, bool) or (k < 1 and k != -1)):
            fail("truncate_prompt_tokens", "must be an integer >= 1, -1 (max_model_len) or None")
        if not _finite(self.repetition_penalty) or self.repetition_penalty <= 0:
            fail("repetition_penalty", "must be a finite number > 0")
        for field in ("presence_penalty", "frequency_penalty"):
            if not _finite(getattr(self, field)) or not -2 <= getattr(self, field) <= 2:
                fail(field, "must be in [-2, 2]")

    def clone(self, **changes) -> "SamplingParams":
        return dataclasses.replace(self, **changes)


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
