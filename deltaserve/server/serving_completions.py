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
    want_prompt_logprobs = req.echo and req.logprobs is not None
    params = to_sampling_params(req, max_tokens=req.max_tokens, logprobs=req.logprobs,
                                prompt_logprobs=req.logprobs if want_prompt_logprobs else None)
    ticket = state.waiting.admit(len(raw))
    group = state.engine.open_group()
    try:
        prompts = [_Prompt(item, await state.encode(item)) if isinstance(item, str) else _Prompt(None, item)
                   for item in raw]
        for p in prompts:
            state.check_length(len(p.token_ids), req.max_tokens, prompt_field="prompt", max_field="max_tokens")
        base_id = f"cmpl-{uuid.uuid4().hex}"
        state.log_request(base_id, [(p.text, p.token_ids) for p in prompts], params)
        try:
            for i, p in enumerate(prompts):
                group.add(f"{base_id}-{i}", p.token_ids, params)
            await group.accepted()
        except ValueError as exc:  # the engine's own validation (token ids out of range, too long, ...)
            raise APIError(str(exc)) from None
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
        completion = sum(len(c.token_ids) for out in self.finals.values() for c in out.outputs)
        cached = sum(getattr(out, "num_cached_tokens", 0) for out in self.finals.values())
        return usage(prompt, completion, cached)

    def _logprobs(self, out: RequestOutput, c: CompletionOutput, start: int, with_prompt: bool,
                  offset: int) -> dict[str, Any] | None:
        if self.req.logprobs is None:
            return None
        ids, positions = c.token_ids[start:], list((c.logprobs or [])[start:len(c.token_ids)])
        if with_prompt:
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
        for out in sorted(self.finals.values(), key=self._prompt_index):
            i = self._prompt_index(out)
            prompt = self.prompts[i]
            for c in out.outputs:
                text = (prompt.text or "") + c.text if self.req.echo else c.text
                choices.append({"index": i * self.req.n + c.index, "text": text,
                                "logprobs": self._logprobs(out, c, 0, self.req.echo, 0),
                                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
                if self.state.tokenizer is None:    # no text to return: the token ids are the completion
                    choices[-1]["token_ids"] = list(c.token_ids)
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
