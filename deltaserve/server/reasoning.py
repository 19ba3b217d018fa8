"""Reasoning parsing: text between `<think>` and `</think>` is reasoning, the rest is content.

Qwen3 models write `<think>` themselves; Qwen3.5 / 3.6 and the thinking Qwen3 variants have it in the
generation prompt, so their output starts inside the reasoning and only `</think>` appears. Which case
applies is read from the rendered prompt (`starts_in_reasoning`). The parser is a streaming state
machine: `feed(delta)` returns (kind, text) pieces with the tags removed; a tag split across deltas is
held back until it is decided. Every switch of kind yields a piece of the new kind (possibly empty), so
callers see segment boundaries.
"""

from __future__ import annotations

from .tool_parsers import held_prefix_len

THINK_START = "<think>"
THINK_END = "</think>"

REASONING = "reasoning"
CONTENT = "content"


def starts_in_reasoning(prompt: str, start: str = THINK_START, end: str = THINK_END) -> bool:
    """True when the prompt leaves a reasoning block open at its very end (the template opened it)."""
    i = prompt.rfind(start)
    return i >= 0 and i > prompt.rfind(end) and not prompt[i + len(start):].strip()


class ReasoningParser:
    def __init__(self, in_reasoning: bool = False, start: str = THINK_START, end: str = THINK_END):
        self.in_reasoning = in_reasoning
        self._start, self._end = start, end
        self._buf = ""

    def feed(self, text: str) -> list[tuple[str, str]]:
        self._buf += text
        out: list[tuple[str, str]] = []
        while True:
            kind = REASONING if self.in_reasoning else CONTENT
            # Inside reasoning only the end tag matters; outside, a stray end tag is dropped.
            tags = (self._end,) if self.in_reasoning else (self._start, self._end)
            hits = [(self._buf.find(t), t) for t in tags]
            hits = [(i, t) for i, t in hits if i >= 0]
            if not hits:
                hold = held_prefix_len(self._buf, tags)
                _append(out, kind, self._buf[: len(self._buf) - hold])
                self._buf = self._buf[len(self._buf) - hold:]
                return out
            pos, tag = min(hits)
            _append(out, kind, self._buf[:pos])
            self._buf = self._buf[pos + len(tag):]
            if tag == self._start or self.in_reasoning:
                self.in_reasoning = not self.in_reasoning
                out.append((REASONING if self.in_reasoning else CONTENT, ""))

    def finish(self) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        _append(out, REASONING if self.in_reasoning else CONTENT, self._buf)
        self._buf = ""
        return out


def _append(out: list[tuple[str, str]], kind: str, text: str) -> None:
    if not text:
        return
    if out and out[-1][0] == kind:
        out[-1] = (kind, out[-1][1] + text)
    else:
        out.append((kind, text))
