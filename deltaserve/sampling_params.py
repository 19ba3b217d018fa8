"""Per-request sampling options with vLLM's names and meanings. Invalid values raise ValueError saying
which field and why."""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any


@dataclasses.dataclass(frozen=True)
class StructuredOutputsParams:
    """Constrain the output to a grammar (vLLM's names); exactly one field is set. Compiled by the engine
    (xgrammar) when the request is added: one that cannot be compiled is a ValueError naming the problem.

    json: a JSON schema (dict or JSON text); json_object: any JSON object; regex: a regular expression;
    choice: one of these strings exactly; grammar: an EBNF grammar (xgrammar / GBNF syntax, rule `root`);
    structural_tag: an xgrammar structural tag (JSON text or dict). disable_any_whitespace: JSON schemas
    allow only single spaces after ',' and ':' (vLLM's option; by default any whitespace is allowed)."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | dict[str, Any] | None = None
    disable_any_whitespace: bool = False    # json / json_object: no free whitespace between JSON tokens

    def __post_init__(self) -> None:
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))
        set_fields = [f for f in _SO_FIELDS if getattr(self, f) not in (None, False)]
        if len(set_fields) != 1:
            raise ValueError("SamplingParams.structured_outputs: exactly one of "
                             f"{', '.join(_SO_FIELDS)} must be set (got {set_fields or 'none'})")
        kind = set_fields[0]
        value = getattr(self, kind)
        if kind in ("json", "structural_tag"):
            if isinstance(value, str):
                try:
                    json.loads(value)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"SamplingParams.structured_outputs.{kind}: not valid JSON ({exc})") from None
            elif not isinstance(value, dict):
                raise ValueError(f"SamplingParams.structured_outputs.{kind}: must be a dict or JSON text")
        elif kind in ("regex", "grammar"):
            if not isinstance(value, str) or not value:
                raise ValueError(f"SamplingParams.structured_outputs.{kind}: must be a non-empty string")
        elif kind == "choice":
            if not value or any(not isinstance(c, str) or not c for c in value):
                raise ValueError("SamplingParams.structured_outputs.choice: must be a non-empty list of "
                                 "non-empty strings")
        elif value is not True:
            raise ValueError("SamplingParams.structured_outputs.json_object: must be True when given")
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError("SamplingParams.structured_outputs.disable_any_whitespace: must be a bool")

    @property
    def kind(self) -> str:
        return next(f for f in _SO_FIELDS if getattr(self, f) not in (None, False))

    def key(self) -> tuple[str, str, bool]:
        """(kind, canonical text, disable_any_whitespace): identifies the compiled grammar."""
        value = getattr(self, self.kind)
        if isinstance(value, dict):
            value = json.dumps(value, sort_keys=True)
        elif isinstance(value, tuple):
            value = json.dumps(value)
        return self.kind, str(value), self.disable_any_whitespace


_SO_FIELDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


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
    structured_outputs: StructuredOutputsParams | None = None  # a grammar the output must follow
    logit_bias: dict[int, float] | None = None   # token id -> added to its logit before anything else
    bad_words: list[str] | None = None           # never generate these words (their token sequences)
    # bad_words as token-id sequences, filled by the engine from its tokenizer (`resolve_bad_words`)
    _bad_words_token_ids: list[list[int]] | None = dataclasses.field(default=None, repr=False, compare=False)
    truncate_prompt_tokens: int | None = None  # keep only the last k prompt tokens; -1 = max_model_len

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if self.logit_bias is not None:
            self.logit_bias = dict(self.logit_bias)
        if self.bad_words is not None:
            self.bad_words = list(self.bad_words)
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

        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                fail("structured_outputs", "must be a StructuredOutputsParams (or a dict of its fields)")
            if self.min_tokens:
                fail("min_tokens", "cannot be combined with structured_outputs (a completed grammar allows "
                                   "only the end of the sequence)")
        if self.logit_bias is not None:
            for tok, bias in self.logit_bias.items():
                if isinstance(tok, bool) or not isinstance(tok, int) or tok < 0:
                    fail("logit_bias", f"keys must be token ids (integers >= 0), found {tok!r}")
                if not _finite(bias):
                    fail("logit_bias", f"values must be finite numbers, found {bias!r} for token {tok}")
        if self.bad_words is not None and any(not isinstance(w, str) or not w.strip() for w in self.bad_words):
            fail("bad_words", "must be a list of non-blank strings")

    def clone(self, **changes) -> "SamplingParams":
        new = dataclasses.replace(self, **changes)
        new._bad_words_token_ids = self._bad_words_token_ids if "bad_words" not in changes else None
        return new

    @property
    def bad_words_token_ids(self) -> list[list[int]]:
        """The token sequences `bad_words` bans (set by `resolve_bad_words`); empty without bad words."""
        if self.bad_words and self._bad_words_token_ids is None:
            raise ValueError("SamplingParams.bad_words: not resolved to token ids (needs the engine's tokenizer)")
        return self._bad_words_token_ids or []

    def resolve_bad_words(self, encode) -> None:
        """Tokenize each bad word as vLLM does, alone and after a space (the two ways it can appear in
        text), keeping distinct non-empty sequences. encode: text -> token ids (no special tokens)."""
        seqs: list[list[int]] = []
        for word in self.bad_words or []:
            for prefix in ("", " "):
                ids = list(encode(prefix + word.lstrip()))
                if ids and ids not in seqs:
                    seqs.append(ids)
        self._bad_words_token_ids = seqs


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
