"""What generation returns, shaped like vLLM's outputs so code written against vLLM reads the same."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class Logprob:
    logprob: float
    rank: int | None = None             # 1 = most likely token
    decoded_token: str | None = None


# One position: token id -> Logprob (the sampled / prompt token plus the top-n alternatives).
PositionLogprobs = dict[int, Logprob]


@dataclasses.dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None    # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[PositionLogprobs | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: dict[str, float] | None = None  # arrival / first-token / finish times (monotonic seconds)
    num_cached_tokens: int = 0               # prompt tokens resumed from the prefix cache (first sequence)
