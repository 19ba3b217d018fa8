"""POST /v1/chat/completions: render the chat template, generate, and turn each choice's text into an
assistant message (content, reasoning_content, tool_calls) with `MessageParser`, streamed or collected."""

from __future__ import annotations

import uuid
from typing import Any, AsyncIterator, Callable

from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse

from ..outputs import CompletionOutput, RequestOutput
from ..tokenizer import TooManyTokens
from .async_engine import EngineDeadError, RequestGroup
from .logprobs import chat_logprobs
from .output_parser import MessageDelta, MessageParser
from .protocol import APIError, ChatCompletionRequest, NamedToolChoice, parse_request, to_sampling_params
from .reasoning import ReasoningParser, starts_in_reasoning
from .serving_completions import prompt_logprobs_json
from .state import ServerState, WaitingTicket, now, unless_disconnected, usage
from .streaming import StreamingRun
from .tool_parsers import QwenToolParser, ToolCallDelta


async def create_chat_completion(state: ServerState, http: Request):
    req: ChatCompletionRequest = parse_request(ChatCompletionRequest, await http.body())
    req.check(state.limits)
    state.check_model(req.model)
    if req.uses_tools and not state.tools_enabled:
        raise APIError("tool calling is not enabled on this server (start it with --tool-call-parser qwen)",
                       param="tools")
    state.check_prompt_chars(req.text_chars(), "messages")
    max_tokens = req.max_output_tokens
    max_field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    params = to_sampling_params(req, max_tokens=max_tokens, logprobs=logprobs)
    ticket = state.waiting.admit(1)
    group = state.engine.open_group()
    try:
        prompt, token_ids = await state.in_pool(tokenize_chat, state, req)
        state.check_length(len(token_ids), max_tokens, prompt_field="messages", max_field=max_field)
        params = _with_tool_call_grammar(state, req, params, prompt)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        state.log_request(request_id, [(prompt, token_ids)], params)
        try:
            group.add(request_id, token_ids, params, priority=req.priority)
            await group.accepted()
        except ValueError as exc:  # the engine's own validation
            raise APIError(str(exc), param="priority" if str(exc).startswith("priority") else None) from None
    except BaseException:
        group.close()
        ticket.release()
        raise
    run = _Run(state, req, request_id, in_reasoning=starts_in_reasoning(prompt), ticket=ticket)
    run.own(group)
    if req.stream:
        return StreamingResponse(run.stream(group), media_type="text/event-stream")
    return JSONResponse(await unless_disconnected(http, run.collect(group)))


def _with_tool_call_grammar(state: ServerState, req: ChatCompletionRequest, params, prompt: str):
    """tool_choice "required" / named, or parallel_tool_calls false: the output is constrained to the
    model's tool-call format (structured/tool_calls.py), so it parses as calls of the given tools."""
    if not req.tool_call_grammar:
        return params
    from ..structured.tool_calls import tool_call_constraint

    choice = req.tool_choice.model_dump() if isinstance(req.tool_choice, NamedToolChoice) else (
        req.tool_choice or "auto")
    tools = [t.model_dump(exclude_none=True) for t in req.tools]
    constraint = tool_call_constraint(state.tokenizer.chat_template, tools, choice,
                                      req.parallel_tool_calls is not False, starts_in_reasoning(prompt))
    return params.clone(structured_outputs=constraint)


def tokenize_chat(state: ServerState, req: ChatCompletionRequest) -> tuple[str, list[int]]:
    """Render and tokenize a chat prompt (runs in the tokenizer pool): the prompt's text and token ids.
    Special-token strings in the rendered text are special tokens, except, with
    --content-special-tokens-as-text, those a client wrote in the messages, tools or template kwargs:
    those are tokenized as plain text."""
    rendered = render_prompt(state, req)
    state.check_prompt_chars(len(rendered), "messages")
    tokenizer = state.tokenizer
    try:
        if state.config.content_special_tokens_as_text:
            return tokenizer.unescape(rendered), tokenizer.encode_escaped(rendered, max_tokens=state.max_model_len)
        return rendered, tokenizer.encode(rendered, add_special_tokens=False, max_tokens=state.max_model_len)
    except TooManyTokens as exc:
        state.check_length(exc.num_tokens, None, prompt_field="messages", max_field="max_tokens")
        raise


def render_prompt(state: ServerState, req: ChatCompletionRequest) -> str:
    """The chat template rendered on the request's messages; with --content-special-tokens-as-text, the
    client's strings are escaped first (Tokenizer.escape_special_tokens), so the result holds markers."""
    tokenizer = state.tokenizer
    if tokenizer is None or not tokenizer.chat_template:
        raise APIError("this model has no chat template: use /v1/completions", param="messages")
    messages = req.template_messages()
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.uses_tools else None
    kwargs = req.template_kwargs()
    if state.config.content_special_tokens_as_text:
        messages, tools, kwargs = _escaped((messages, tools, kwargs), tokenizer.escape_special_tokens)
    try:
        prompt = tokenizer.apply_chat_template(
            messages, add_generation_prompt=req.add_generation_prompt, tools=tools, **kwargs)
    except Exception as exc:  # the template's own raise_exception, or a template bug on odd input
        raise APIError(f"the chat template failed on these messages: {exc}", param="messages") from None
    if req.continue_final_message:
        final = messages[-1]["content"]
        end = prompt.rfind(final) if final else -1
        if end < 0:
            raise APIError("continue_final_message: the final message's text was not found in the rendered "
                           "prompt", param="continue_final_message")
        prompt = prompt[: end + len(final)]
    return prompt


def _escaped(value: Any, escape: Callable[[str], str]) -> Any:
    """Every string in a JSON-like value (dict keys included) passed through `escape`."""
    if isinstance(value, str):
        return escape(value)
    if isinstance(value, dict):
        return {_escaped(k, escape): _escaped(v, escape) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_escaped(v, escape) for v in value)
    return value


class _Choice:
    """Streaming state of one choice."""

    def __init__(self, parser: MessageParser):
        self.parser = parser
        self.sent_text = 0
        self.sent_tokens = 0
        self.done = False

    def feed(self, c: CompletionOutput) -> MessageDelta:
        delta = self.parser.feed(c.text[self.sent_text:])
        self.sent_text = len(c.text)
        if c.finish_reason is not None:
            delta.extend(self.parser.finish())
        return delta


class _Run(StreamingRun):
    chunk_object = "chat.completion.chunk"

    def __init__(self, state: ServerState, req: ChatCompletionRequest, request_id: str, in_reasoning: bool,
                 ticket: WaitingTicket):
        self.state, self.req, self.id, self.in_reasoning, self.ticket = state, req, request_id, in_reasoning, ticket
        self.created = now()
        self.choices = [_Choice(self._parser()) for _ in range(req.n)]
        self.final: RequestOutput | None = None

    def _parser(self) -> MessageParser:
        tools = QwenToolParser([t.model_dump() for t in self.req.tools]) if self.req.uses_tools else None
        reasoning = ReasoningParser(self.in_reasoning) if self.state.reasoning_enabled else None
        return MessageParser(tools, reasoning)

    def _finish_reason(self, c: CompletionOutput, choice: _Choice) -> str | None:
        if c.finish_reason == "stop" and choice.parser.num_tool_calls:
            return "tool_calls"
        return c.finish_reason

    def _logprobs(self, c: CompletionOutput, start: int) -> dict[str, Any] | None:
        if not self.req.logprobs:
            return None
        positions = list((c.logprobs or [])[start:len(c.token_ids)])
        content = chat_logprobs(c.token_ids[start:], positions, self.state.token_text, self.req.top_logprobs or 0)
        return {"content": content}

    def _usage(self) -> dict[str, int]:
        out = self.final
        if out is None:
            return usage(0, 0)
        return usage(len(out.prompt_token_ids), sum(len(c.token_ids) for c in out.outputs),
                     getattr(out, "num_cached_tokens", 0))

    # ---- non-streaming -------------------------------------------------------------------------
    async def collect(self, group: RequestGroup) -> dict[str, Any]:
        try:
            async for out in self._outputs(group):
                if out.finished:
                    self.final = out
        except EngineDeadError as exc:
            raise APIError(str(exc), status=500, type="internal_server_error") from None
        choices = []
        for c in sorted(self.final.outputs, key=lambda c: c.index):
            choice = self.choices[c.index]
            delta = choice.feed(c)
            message: dict[str, Any] = {"role": "assistant", "content": delta.content,
                                       "reasoning_content": delta.reasoning or None}
            if delta.tool_calls:
                message["tool_calls"] = _merge_tool_calls(delta.tool_calls, full=True)
                message["content"] = delta.content or None
            choices.append({"index": c.index, "message": message, "logprobs": self._logprobs(c, 0),
                            "finish_reason": self._finish_reason(c, choice), "stop_reason": c.stop_reason})
        body = {"id": self.id, "object": "chat.completion", "created": self.created,
                "model": self.state.config.served_model_name, "choices": choices, "usage": self._usage()}
        if self.req.prompt_logprobs is not None:      # vLLM's extension: the rendered prompt's logprobs
            body["prompt_logprobs"] = prompt_logprobs_json(self.final)
        return body

    # ---- streaming -----------------------------------------------------------------------------
    async def stream(self, group: RequestGroup) -> AsyncIterator[str]:
        include_usage = self.req.stream_options is not None and self.req.stream_options.include_usage
        roles = [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                 for i in range(self.req.n)]
        async for event in self._stream_outputs(group, include_usage, first=roles):
            yield event

    def _on_output(self, out: RequestOutput) -> list[dict[str, Any]]:
        if out.finished:
            self.final = out
        return [ch for ch in (self._delta(c) for c in out.outputs) if ch is not None]

    def _delta(self, c: CompletionOutput) -> dict[str, Any] | None:
        choice = self.choices[c.index]
        if choice.done:
            return None
        start = choice.sent_tokens
        choice.sent_tokens = len(c.token_ids)
        delta = choice.feed(c)
        logprobs = self._logprobs(c, start)
        finish_reason = self._finish_reason(c, choice)
        choice.done = finish_reason is not None
        body: dict[str, Any] = {}
        if delta.reasoning:
            body["reasoning_content"] = delta.reasoning
        if delta.content:
            body["content"] = delta.content
        if delta.tool_calls:
            body["tool_calls"] = _merge_tool_calls(delta.tool_calls, full=False)
        if not body and finish_reason is None and not (logprobs and logprobs["content"]):
            return None
        return {"index": c.index, "delta": body, "logprobs": logprobs, "finish_reason": finish_reason,
                **({"stop_reason": c.stop_reason} if finish_reason is not None else {})}


def _merge_tool_calls(deltas: list[ToolCallDelta], full: bool) -> list[dict[str, Any]]:
    """Tool-call deltas -> OpenAI tool_calls entries, one per call index. `full`: a complete message
    (no `index` field); otherwise stream deltas (id, type and name only in a call's first delta)."""
    calls: dict[int, dict[str, Any]] = {}
    for d in deltas:
        call = calls.get(d.index)
        if call is None:
            call = calls[d.index] = {"index": d.index, "function": {"arguments": ""}}
        if d.id is not None:
            call.update(id=d.id, type="function")
            call["function"]["name"] = d.name
        call["function"]["arguments"] += d.arguments
    out = [calls[i] for i in sorted(calls)]
    if full:
        for call in out:
            del call["index"]
    return out
