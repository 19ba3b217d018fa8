"""What the Anthropic Messages and the Responses endpoints share: one chat generation started from a
`ChatCompletionRequest` built by their protocol modules (same template, tokenizer, limits and sampling
mapping as /v1/chat/completions), and the assistant message cut into typed blocks (thinking / text /
tool call), which is how both APIs present output, streamed or not.

`BlockAssembler` turns the `MessageDelta`s of one choice into `BlockEvent`s: a block starts when the kind
of output changes (or a new tool call begins), gets deltas, and stops before the next one starts; so a
stream is a flat sequence of start / delta... / stop per block, the order both APIs document.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from typing import Any, AsyncIterator, Callable, Literal

from .async_engine import EngineDeadError, RequestGroup
from .output_parser import MessageDelta, MessageParser
from .protocol import APIError, ChatCompletionRequest, to_sampling_params
from .reasoning import ReasoningParser, starts_in_reasoning
from .serving_chat import tokenize_chat
from .state import ServerState, WaitingTicket, now
from .streaming import StreamingRun
from .tool_parsers import QwenToolParser, new_tool_call_id

BlockKind = Literal["thinking", "text", "tool_call"]


@dataclasses.dataclass
class Block:
    kind: BlockKind
    index: int
    text: str = ""                 # thinking / text; a tool call's arguments JSON text
    call_id: str | None = None     # tool calls only
    name: str | None = None

    def arguments(self) -> dict[str, Any]:
        """A tool call's arguments as an object (the parser emits a JSON object's text)."""
        try:
            value = json.loads(self.text or "{}")
        except json.JSONDecodeError:
            return {}
        return value if isinstance(value, dict) else {}


@dataclasses.dataclass
class BlockEvent:
    type: Literal["start", "delta", "stop"]
    block: Block
    delta: str = ""


class BlockAssembler:
    def __init__(self) -> None:
        self.blocks: list[Block] = []
        self._open: Block | None = None
        self._calls: dict[int, Block] = {}   # parser call index -> block

    @property
    def num_tool_calls(self) -> int:
        return len(self._calls)

    def feed(self, delta: MessageDelta) -> list[BlockEvent]:
        events: list[BlockEvent] = []
        if delta.reasoning:
            self._text(events, "thinking", delta.reasoning)
        if delta.content:
            self._text(events, "text", delta.content)
        for d in delta.tool_calls:
            if d.id is not None:
                self._switch(events, Block("tool_call", len(self.blocks), call_id=d.id, name=d.name))
                self._calls[d.index] = self._open
            block = self._calls[d.index]
            if d.arguments:   # the parser finishes one call before it starts the next
                block.text += d.arguments
                events.append(BlockEvent("delta", block, d.arguments))
        return events

    def close(self) -> list[BlockEvent]:
        events: list[BlockEvent] = []
        if self._open is not None:
            events.append(BlockEvent("stop", self._open))
            self._open = None
        return events

    def _text(self, events: list[BlockEvent], kind: BlockKind, text: str) -> None:
        if self._open is None or self._open.kind != kind:
            self._switch(events, Block(kind, len(self.blocks)))
        self._open.text += text
        events.append(BlockEvent("delta", self._open, text))

    def _switch(self, events: list[BlockEvent], block: Block) -> None:
        events.extend(self.close())
        self.blocks.append(block)
        events.append(BlockEvent("start", block))
        self._open = block


@dataclasses.dataclass
class ChatGeneration:
    """One started chat request: its group (read it through `outputs`), prompt size and parser."""

    request_id: str
    group: RequestGroup
    ticket: WaitingTicket
    num_prompt_tokens: int
    parser: MessageParser


async def render_and_count(state: ServerState, req: ChatCompletionRequest) -> tuple[str, list[int]]:
    """The checks of /v1/chat/completions, then the rendered prompt and its token ids."""
    req.check(state.limits)
    state.check_model(req.model)
    if req.uses_tools and not state.tools_enabled:
        raise APIError("tool calling is not enabled on this server (start it with --tool-call-parser qwen)",
                       param="tools")
    state.check_prompt_chars(req.text_chars(), "messages")
    return await state.in_pool(tokenize_chat, state, req)


async def start_generation(state: ServerState, req: ChatCompletionRequest, id_prefix: str, max_field: str,
                           call_id: Callable[[], str] = new_tool_call_id) -> ChatGeneration:
    """Validate, render, tokenize and add one chat request (n == 1) to the engine."""
    params = to_sampling_params(req, max_tokens=req.max_output_tokens)
    prompt, token_ids = await render_and_count(state, req)
    state.check_length(len(token_ids), req.max_output_tokens, prompt_field="messages", max_field=max_field)
    ticket = state.waiting.admit(1)
    group = state.engine.open_group()
    request_id = f"{id_prefix}{uuid.uuid4().hex}"
    try:
        state.log_request(request_id, [(prompt, token_ids)], params)
        try:
            group.add(request_id, token_ids, params)
            await group.accepted()
        except ValueError as exc:  # the engine's own validation
            raise APIError(str(exc)) from None
    except BaseException:
        group.close()
        ticket.release()
        raise
    tools = QwenToolParser([t.model_dump() for t in req.tools], id_factory=call_id) if req.uses_tools else None
    reasoning = ReasoningParser(starts_in_reasoning(prompt)) if state.reasoning_enabled else None
    return ChatGeneration(request_id, group, ticket, len(token_ids), MessageParser(tools, reasoning))


def thinking_switch(enabled: bool | None, kwargs: dict[str, Any] | None, param: str) -> dict[str, Any] | None:
    """chat_template_kwargs with Qwen's `enable_thinking` set (None: the template's default)."""
    if enabled is None:
        return kwargs
    kwargs = dict(kwargs or {})
    if kwargs.get("enable_thinking", enabled) != enabled:
        raise APIError(f"{param} contradicts chat_template_kwargs.enable_thinking", param=param)
    kwargs["enable_thinking"] = enabled
    return kwargs


class BlockRun(StreamingRun):
    """Reads one generation's outputs as block events; remembers the finish and the token counts."""

    def __init__(self, state: ServerState, gen: ChatGeneration):
        self.state, self.gen, self.id, self.ticket = state, gen, gen.request_id, gen.ticket
        self.created = now()
        self.assembler = BlockAssembler()
        self.output_tokens = 0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self._sent = 0
        self.own(gen.group)

    async def events(self) -> AsyncIterator[list[BlockEvent]]:
        """Block events as the text arrives (EngineDeadError passes through)."""
        async for out in self._outputs(self.gen.group):
            c = out.outputs[0]
            delta = self.gen.parser.feed(c.text[self._sent:])
            self._sent = len(c.text)
            self.output_tokens = len(c.token_ids)
            if c.finish_reason is not None:
                delta.extend(self.gen.parser.finish())
                self.finish_reason, self.stop_reason = c.finish_reason, c.stop_reason
            events = self.assembler.feed(delta)
            if c.finish_reason is not None:
                events += self.assembler.close()
            if events:
                yield events

    async def collect(self) -> list[Block]:
        """All blocks once the generation ended; an engine failure is a 500."""
        try:
            async for _ in self.events():
                pass
        except EngineDeadError as exc:
            raise APIError(str(exc), status=500, type="internal_server_error") from None
        return self.assembler.blocks
