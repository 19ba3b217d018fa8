"""`speculative_config` (vLLM's keys), parsed from the dict the LLM API takes or the JSON string of
`--speculative-config`. Unknown keys and bad values are refused by name, never ignored."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

METHODS = ("mtp", "ngram")
# widest verify tested (FlashInfer's GDN verify crashed beyond 4: wave2.md §2.2); raise it with a test
MAX_SPECULATIVE_TOKENS = 8


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int              # the most drafts per step (adaptive K picks <= this)
    prompt_lookup_min: int | None = None     # ngram only: shortest suffix n-gram matched
    prompt_lookup_max: int | None = None     # ngram only: longest suffix n-gram matched

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"speculative_config: method must be one of {METHODS}, got {self.method!r}")
        k = self.num_speculative_tokens
        if not _is_int(k) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative_config: num_speculative_tokens must be an int in "
                             f"[1, {MAX_SPECULATIVE_TOKENS}], got {k!r}")
        if self.method == "ngram":
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            # vLLM's defaults: either one given alone sets both
            if lo is None and hi is None:
                lo = hi = 3
            elif lo is None:
                lo = hi
            elif hi is None:
                hi = lo
            for key, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
                if not _is_int(v) or v < 1:
                    raise ValueError(f"speculative_config: {key} must be an int >= 1, got {v!r}")
            if lo > hi:
                raise ValueError(f"speculative_config: prompt_lookup_min ({lo}) > prompt_lookup_max ({hi})")
            object.__setattr__(self, "prompt_lookup_min", lo)
            object.__setattr__(self, "prompt_lookup_max", hi)
        else:
            for key in ("prompt_lookup_min", "prompt_lookup_max"):
                if getattr(self, key) is not None:
                    raise ValueError(f"speculative_config: {key} applies to method 'ngram' only, "
                                     f"not {self.method!r}")

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict[str, Any] | str | None) -> SpeculativeConfig | None:
        """From the LLM argument (a dict), the CLI's JSON string, or an existing config; None: off."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config: not valid JSON ({e})") from None
        if not isinstance(value, dict):
            raise ValueError(  # noqa: TRY004 (a bad user value, refused like the others)
                f"speculative_config: expected a JSON object, got {type(value).__name__}")
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - fields)
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {unknown} (supported: {sorted(fields)})")
        for key in ("method", "num_speculative_tokens"):
            if key not in value:
                raise ValueError(f"speculative_config: {key} is required")
        return cls(**value)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_model(config: SpeculativeConfig | None, model_config) -> None:
    """Refuse a method the checkpoint cannot run (model_config: deltaserve.config.ModelConfig)."""
    if config is not None and config.method == "mtp" and model_config.mtp_num_layers < 1:
        raise ValueError("speculative_config: method 'mtp' needs a checkpoint with an MTP head, and this "
                         "config declares none (mtp_num_hidden_layers / num_nextn_predict_layers is 0); "
                         "use method 'ngram' or no speculative_config")
