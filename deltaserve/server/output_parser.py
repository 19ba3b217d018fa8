"""One chat choice's generated text -> assistant message deltas: reasoning, content and tool calls.

Tool calls are taken out first (so a call written inside `<think>` is still a call), then the remaining
text is split into reasoning and content. Whitespace at the edges of each segment (the newlines around
`<think>` / `</think>` and around tool calls) is dropped: leading whitespace at a segment's start, and
trailing whitespace that is never followed by more text of the same segment (with neither parser on,
the text passes through verbatim). The same parser serves
streaming (many feeds) and non-streaming (one feed), so both give the same message.
"""

from __future__ import annotations

import dataclasses

from .reasoning import CONTENT, REASONING, ReasoningParser
from .tool_parsers import QwenToolParser, ToolCallDelta


@dataclasses.dataclass
class MessageDelta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = dataclasses.field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)

    def extend(self, other: "MessageDelta") -> None:
        self.reasoning += other.reasoning
        self.content += other.content
        self.tool_calls.extend(other.tool_calls)


class _Segment:
    """Drops leading whitespace at a segment start and holds trailing whitespace until more text comes."""

    def __init__(self):
        self.at_start, self.pending = True, ""

    def push(self, text: str) -> str:
        if self.at_start:
            text = text.lstrip()
            if not text:
                return ""
            self.at_start = False
        text = self.pending + text
        body = text.rstrip()
        self.pending = text[len(body):]
        return body

    def restart(self) -> None:
        self.at_start, self.pending = True, ""


class MessageParser:
    def __init__(self, tool_parser: QwenToolParser | None, reasoning_parser: ReasoningParser | None):
        self._tools = tool_parser
        self._reasoning = reasoning_parser
        self._kind = REASONING if reasoning_parser is not None and reasoning_parser.in_reasoning else CONTENT
        self._segments = {REASONING: _Segment(), CONTENT: _Segment()}

    @property
    def num_tool_calls(self) -> int:
        return 0 if self._tools is None else self._tools.num_calls

    def feed(self, text: str) -> MessageDelta:
        if self._tools is None and self._reasoning is None:
            return MessageDelta(content=text)  # nothing to parse: the text verbatim
        events = self._tools.feed(text) if self._tools is not None else [text]
        return self._route(events, final=False)

    def finish(self) -> MessageDelta:
        events = self._tools.finish() if self._tools is not None else []
        return self._route(events, final=True)

    def _route(self, events: list, final: bool) -> MessageDelta:
        delta = MessageDelta()
        for event in events:
            if isinstance(event, ToolCallDelta):
                delta.tool_calls.append(event)
            else:
                self._add_text(delta, event)
        if final and self._reasoning is not None:
            self._add_pieces(delta, self._reasoning.finish())
        return delta

    def _add_text(self, delta: MessageDelta, text: str) -> None:
        if self._reasoning is None:
            self._add_pieces(delta, [(CONTENT, text)])
        else:
            self._add_pieces(delta, self._reasoning.feed(text))

    def _add_pieces(self, delta: MessageDelta, pieces: list[tuple[str, str]]) -> None:
        for kind, text in pieces:
            if kind != self._kind:
                self._kind = kind
                self._segments[kind].restart()
            piece = self._segments[kind].push(text)
            if kind == REASONING:
                delta.reasoning += piece
            else:
                delta.content += piece
