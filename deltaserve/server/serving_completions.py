"""POST /v1/completions: one engine request per prompt, `n` choices each, streamed or collected."""

from __future__ import annotations

import dataclasses
import uuid
from typing import Any, AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse

from ..outputs import CompletionOutput, RequestOutput
from .async_engine import EngineDeadError, RequestGroup
from .logprobs import completion_logprobs
from .protocol import APIError, CompletionRequest, parse_request, to_sampling_params
from .state import ServerState, WaitingTicket, now, unless_disconnected, usage
from .streaming import StreamingRun


@dataclasses.dataclass
class _Prompt:
    text: str | None          # None for a token-id prompt (decoded only when echoed)
    token_ids: list[int]


async def create_completion(state: ServerState, http: Request):
    req: CompletionRequest = parse_request(CompletionRequest, await http.body())
    req.check(state.limits)
    state.check_model(req.model)
    raw = _raw_prompts(state, req)
    params = _sampling_params(req)
    keep = _kept_prompt_tokens(state, req)
    ticket = state.waiting.admit(len(raw))
    group = state.engine.open_group()
    try:
        prompts = [_Prompt(item, await state.encode(item)) if isinstance(item, str) else _Prompt(None, item)
                   for item in raw]
        for p in prompts:
            if keep is not None and len(p.token_ids) > keep:   # the echoed text is the kept tokens' text
                p.text, p.token_ids = None, p.token_ids[-keep:]
            state.check_length(len(p.token_ids), req.max_tokens, prompt_field="prompt", max_field="max_tokens")
        base_id = f"cmpl-{uuid.uuid4().hex}"
        state.log_request(base_id, [(p.text, p.token_ids) for p in prompts], params)
        try:
            for i, p in enumerate(prompts):
                group.add(f"{base_id}-{i}", p.token_ids, params, priority=req.priority)
            await group.accepted()
        except ValueError as exc:  # the engine's own validation (token ids out of range, too long, ...)
            raise APIError(str(exc), param="priority" if str(exc).startswith("priority") else None) from None
        if req.echo and state.tokenizer is not None:  # token-id prompts are known to be valid now
            for p in prompts:
                if p.text is None:
                    p.text = await state.in_pool(state.tokenizer.decode, p.token_ids, False)
    except BaseException:
        group.close()
        ticket.release()
        raise
    run = _Run(state, req, base_id, prompts, ticket)
    run.own(group)
    if req.stream:
        return StreamingResponse(run.stream(group), media_type="text/event-stream")
    return JSONResponse(await unless_disconnected(http, run.collect(group)))


def _sampling_params(req: CompletionRequest):
    """The engine's params. echo + logprobs: the prompt's logprobs are computed too. max_tokens=0 (scoring):
    the prompt only, no generated token (the engine needs prompt logprobs for it; echo without logprobs asks
    for them and does not show them). best_of > n: best_of candidates, each with its sampled tokens'
    logprobs (their sum ranks them)."""
    echo_logprobs = req.echo and req.logprobs is not None
    prompt_logprobs = req.logprobs if echo_logprobs else req.prompt_logprobs
    if req.max_tokens == 0 and prompt_logprobs is None:
        prompt_logprobs = 0
    logprobs = req.logprobs
    if req.num_candidates > req.n and logprobs is None:
        logprobs = 0
    return to_sampling_params(req, n=req.num_candidates, max_tokens=req.max_tokens, logprobs=logprobs,
                              prompt_logprobs=prompt_logprobs)


def _kept_prompt_tokens(state: ServerState, req: CompletionRequest) -> int | None:
    """truncate_prompt_tokens as a token count (vLLM: -1 is the context length; more than it is refused)."""
    k = req.truncate_prompt_tokens
    if k is None:
        return None
    if k > state.max_model_len:
        raise APIError(f"truncate_prompt_tokens={k} exceeds the model's context of {state.max_model_len} tokens",
                       param="truncate_prompt_tokens")
    return state.max_model_len if k == -1 else k


def prompt_logprobs_json(out: RequestOutput) -> list[dict[str, dict[str, Any]] | None] | None:
    """vLLM's prompt_logprobs: per prompt token null (the first) or {token id: {logprob, rank, decoded_token}}."""
    if out.prompt_logprobs is None:
        return None
    return [None if pos is None else
            {str(t): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
             for t, lp in pos.items()}
            for pos in out.prompt_logprobs]


def _cumulative_logprob(c: CompletionOutput) -> float:
    return sum(pos[t].logprob for t, pos in zip(c.token_ids, c.logprobs or []) if pos is not None and t in pos)


def _raw_prompts(state: ServerState, req: CompletionRequest) -> list[str | list[int]]:
    """The prompts as given (texts or token-id lists), checked for size before anything is tokenized."""
    raw = req.prompt
    if isinstance(raw, str) or (raw and isinstance(raw[0], int)):
        raw = [raw]
    for item in raw:
        if isinstance(item, str):
            state.need_tokenizer("prompt")
            state.check_prompt_chars(len(item), "prompt")
        elif not item:
            raise APIError("a token-id prompt must not be empty", param="prompt")
    return [item if isinstance(item, str) else list(item) for item in raw]


class _Run(StreamingRun):
    """The response being built for one completions request."""

    chunk_object = "text_completion"

    def __init__(self, state: ServerState, req: CompletionRequest, base_id: str, prompts: list[_Prompt],
                 ticket: WaitingTicket):
        self.state, self.req, self.id, self.prompts, self.ticket = state, req, base_id, prompts, ticket
        self.created = now()
        self.sent_text: dict[int, int] = {}     # choice index -> characters sent
        self.sent_tokens: dict[int, int] = {}   # choice index -> tokens whose logprobs were sent
        self.finals: dict[str, RequestOutput] = {}

    def _prompt_index(self, out: RequestOutput) -> int:
        return int(out.request_id.rsplit("-", 1)[1])

    def _usage(self) -> dict[str, int]:
        prompt = sum(len(out.prompt_token_ids) for out in self.finals.values())
        # every candidate counts (best_of > n: the ones not returned too, as vLLM and OpenAI bill them)
        completion = sum(len(c.token_ids) for out in self.finals.values() for c in out.outputs)
        cached = sum(getattr(out, "num_cached_tokens", 0) for out in self.finals.values())
        return usage(prompt, completion, cached)

    def _logprobs(self, out: RequestOutput, c: CompletionOutput, start: int, with_prompt: bool,
                  offset: int) -> dict[str, Any] | None:
        if self.req.logprobs is None:
            return None
        ids, positions = c.token_ids[start:], list((c.logprobs or [])[start:len(c.token_ids)])
        if with_prompt:   # the first prompt token has no logprob (null), as in OpenAI and vLLM
            prompt_positions = list(out.prompt_logprobs or [None] * len(out.prompt_token_ids))
            ids, positions = out.prompt_token_ids + ids, prompt_positions + positions
        return completion_logprobs(ids, positions, self.state.token_text, offset)

    # ---- non-streaming -------------------------------------------------------------------------
    async def collect(self, group: RequestGroup) -> dict[str, Any]:
        try:
            async for out in self._outputs(group):
                if out.finished:
                    self.finals[out.request_id] = out
        except EngineDeadError as exc:
            raise APIError(str(exc), status=500, type="internal_server_error") from None
        choices = []
        prompt_lps = self.req.prompt_logprobs is not None
        for out in sorted(self.finals.values(), key=self._prompt_index):
            i = self._prompt_index(out)
            prompt = self.prompts[i]
            outputs = out.outputs
            if self.req.num_candidates > self.req.n:   # best_of: the n likeliest candidates, best first
                outputs = sorted(outputs, key=_cumulative_logprob, reverse=True)[:self.req.n]
            for rank, c in enumerate(outputs):
                text = (prompt.text or "") + c.text if self.req.echo else c.text
                choice = {"index": i * self.req.n + rank, "text": text,
                          "logprobs": self._logprobs(out, c, 0, self.req.echo, 0),
                          "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                if prompt_lps:
                    choice["prompt_logprobs"] = prompt_logprobs_json(out)
                if self.state.tokenizer is None:    # no text to return: the token ids are the completion
                    choice["token_ids"] = list(c.token_ids)
                choices.append(choice)
        choices.sort(key=lambda ch: ch["index"])
        return {"id": self.id, "object": "text_completion", "created": self.created,
                "model": self.state.config.served_model_name, "choices": choices, "usage": self._usage()}

    # ---- streaming -----------------------------------------------------------------------------
    async def stream(self, group: RequestGroup) -> AsyncIterator[str]:
        include_usage = self.req.stream_options is not None and self.req.stream_options.include_usage
        async for event in self._stream_outputs(group, include_usage):
            yield event

    def _on_output(self, out: RequestOutput) -> list[dict[str, Any]]:
        if out.finished:
            self.finals[out.request_id] = out
        return [ch for ch in (self._delta(out, c) for c in out.outputs) if ch is not None]

    def _delta(self, out: RequestOutput, c: CompletionOutput) -> dict[str, Any] | None:
        i = self._prompt_index(out)
        index = i * self.req.n + c.index
        first = index not in self.sent_text
        sent_text, sent_tokens = self.sent_text.get(index, 0), self.sent_tokens.get(index, 0)
        text = c.text[sent_text:]
        echo = first and self.req.echo
        prompt_text = self.prompts[i].text or ""
        offset = 0 if echo else sent_text + (len(prompt_text) if self.req.echo else 0)
        logprobs = self._logprobs(out, c, sent_tokens, echo, offset)
        if echo:
            text = prompt_text + text
        self.sent_text[index], self.sent_tokens[index] = len(c.text), len(c.token_ids)
        # without a tokenizer there is no text: each chunk carries its new token ids instead
        new_ids = c.token_ids[sent_tokens:] if self.state.tokenizer is None else None
        if not text and not c.finish_reason and not (logprobs and logprobs["tokens"]) and not first and not new_ids:
            return None
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": c.finish_reason,
                  "stop_reason": c.stop_reason}
        if new_ids is not None:
            choice["token_ids"] = new_ids
        return choice
