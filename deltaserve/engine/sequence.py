"""One request's CPU-side state: the request (prompt, options, timing) and its n sequences (tokens,
progress, finish). A Sequence is the unit the scheduler schedules and the cache manager provisions; it
never touches cache resources itself.
"""

from __future__ import annotations

import enum

from ..outputs import CompletionOutput, PositionLogprobs, RequestOutput
from ..sampling_params import SamplingParams
from ..step_io import NewSequence
from .detokenizer import IncrementalDetokenizer


class SeqStatus(enum.Enum):
    WAITING = "waiting"      # queued: holds no cache resources (new, or preempted)
    RUNNING = "running"      # in the running batch: holds a state slot and KV blocks
    FINISHED = "finished"


class Request:
    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
                 arrival_time: float, *, stream: bool = True, priority: int = 0):
        self.request_id = request_id
        self.arrival_time = arrival_time
        self.priority = priority          # lower runs first under the "priority" scheduling policy
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.stream = stream              # report every new token (False: only the final output)
        self.seqs: list[Sequence] = []
        self.prompt_logprobs: list[PositionLogprobs | None] | None = (
            [None] if params.prompt_logprobs is not None else None)
        self.metrics: dict[str, float] = {"arrival_time": arrival_time}

    @property
    def finished(self) -> bool:
        return all(s.status is SeqStatus.FINISHED for s in self.seqs)

    def output(self) -> RequestOutput:
        """Cumulative output; while a sequence runs its text leaves out a tail that may become a stop
        string, so streamed text is never retracted."""
        outs = [CompletionOutput(s.index, s.text(), list(s.output_token_ids),
                                 None if s.logprobs is None else list(s.logprobs), s.finish_reason, s.stop_reason)
                for s in self.seqs]
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids,
                             None if self.prompt_logprobs is None else list(self.prompt_logprobs), outs,
                             self.finished, dict(self.metrics), self.seqs[0].num_cached_tokens or 0)


class Sequence:
    def __init__(self, seq_id: int, request: Request, index: int, *, max_new_tokens: int,
                 eos_token_ids: frozenset[int], detokenizer: IncrementalDetokenizer | None):
        params = request.params
        self.seq_id = seq_id
        self.request = request
        self.index = index
        self.params = params
        self.token_ids = list(request.prompt_token_ids)     # prompt + generated
        self.num_prompt_tokens = len(self.token_ids)
        self.output_token_ids: list[int] = []
        self.num_computed = 0                                # tokens whose KV / state is in the cache
        # prefix caching: positions whose state is saved once computed (ascending; the scheduler's policy)
        self.commit_points: list[int] = []
        self.num_cached_tokens: int | None = None            # the prefix hit at first admission
        # tokens being sampled by a launched step whose result has not been read yet (0 or 1; async
        # scheduling schedules the next step before the current one's tokens reach the host)
        self.num_pending = 0
        # speculative decoding: drafts the runner proposed after the last step, fed as a verify chunk next
        self.draft_token_ids: list[int] = []
        self.max_num_tokens = self.num_prompt_tokens + max_new_tokens
        self.max_new_tokens = max_new_tokens
        self.status = SeqStatus.WAITING
        self.num_preemptions = 0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.logprobs: list[PositionLogprobs] | None = [] if params.logprobs is not None else None
        self.detok = detokenizer
        self.eos_token_ids = frozenset() if params.ignore_eos else eos_token_ids
        self.stop_token_ids = frozenset(params.stop_token_ids)
        self.wants_prompt_logprobs = params.prompt_logprobs is not None and index == 0

    @property
    def num_tokens(self) -> int:
        """Tokens known on the host (prompt + generated)."""
        return len(self.token_ids)

    @property
    def num_scheduled_tokens(self) -> int:
        """Tokens the scheduler can feed: the known ones plus the one still being sampled."""
        return len(self.token_ids) + self.num_pending

    @property
    def generation_done(self) -> bool:
        """Every token it may generate has been sampled (some perhaps not read yet): nothing more to run."""
        return len(self.output_token_ids) + self.num_pending >= self.max_new_tokens

    @property
    def seed(self) -> int | None:
        return None if self.params.seed is None else self.params.seed + self.index

    def cut_at_commit(self, n: int) -> int:
        """n, shortened so a chunk from num_computed ends at the next commit point rather than past it."""
        if self.commit_points and self.commit_points[0] > self.num_computed:
            return min(n, self.commit_points[0] - self.num_computed)
        return n

    def runner_data(self, state_slot: int, block_ids: list[int]) -> NewSequence:
        prompt_lp = self.params.prompt_logprobs if self.needs_prompt_logprobs else None
        return NewSequence(self.seq_id, list(self.token_ids), self.num_prompt_tokens, self.params, self.seed,
                           self.eos_token_ids | self.stop_token_ids, prompt_lp, state_slot, block_ids)

    @property
    def needs_prompt_logprobs(self) -> bool:
        return self.wants_prompt_logprobs and len(self.request.prompt_logprobs) < self.num_prompt_tokens

    def reset_for_recompute(self) -> None:
        """Preempted: the cache is gone; on readmission it is recomputed from the longest cached prefix
        (position 0 without prefix caching)."""
        self.num_computed = 0
        self.commit_points = []
        self.draft_token_ids = []
        self.num_preemptions += 1
        if self.needs_prompt_logprobs:
            self.request.prompt_logprobs = [None]      # partial: recomputed with the prompt

    def append_token(self, token: int, logprobs: PositionLogprobs | None) -> bool:
        """Record a sampled token and apply the stop rules; True when the sequence is now finished."""
        self.token_ids.append(token)
        self.output_token_ids.append(token)
        if self.logprobs is not None:
            self.logprobs.append(logprobs)
        n = len(self.output_token_ids)
        may_stop = n >= self.params.min_tokens
        if may_stop and token in self.stop_token_ids:
            self.finish_reason, self.stop_reason = "stop", token
        elif may_stop and token in self.eos_token_ids:
            self.finish_reason, self.stop_reason = "stop", None
        if self.detok is not None:
            # A stop token's text is left out unless include_stop_str_in_output (as vLLM does).
            if self.finish_reason is None or self.params.include_stop_str_in_output:
                if self.detok.add_token(token, check_stop=may_stop and self.finish_reason is None):
                    self.finish_reason, self.stop_reason = "stop", self.detok.stop_reason
        if self.finish_reason is None and n >= self.max_new_tokens:
            self.finish_reason = "length"
        return self.finish_reason is not None

    def text(self) -> str:
        if self.detok is None:
            return ""
        return self.detok.text if self.finish_reason is not None else self.detok.stream_text
