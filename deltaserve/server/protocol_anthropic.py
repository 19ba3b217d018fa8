"""Anthropic Messages request schemas (POST /v1/messages, /v1/messages/count_tokens), validated as strictly
as the OpenAI ones (protocol.py): an unknown field or block type is a 400 naming it.

A request is mapped onto a `ChatCompletionRequest`, so it meets the same chat template, tool rendering,
limits and sampling checks as /v1/chat/completions: `system` becomes the system message, `tool_use` blocks
the assistant's tool calls, `tool_result` blocks tool messages, `thinking` blocks the assistant's
reasoning; `thinking: {type: enabled|disabled}` sets the Qwen template's `enable_thinking`.
`cache_control` is accepted and changes nothing (the engine's prefix cache is automatic).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, Union

from pydantic import Field

from .protocol import APIError, ChatCompletionRequest, _Strict, parse_request


class CacheControl(_Strict):
    type: Literal["ephemeral"]
    ttl: str | None = None


class TextBlock(_Strict):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None
    citations: list[Any] | None = None


class ToolUseBlock(_Strict):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolResultBlock(_Strict):
    type: Literal["tool_result"]
    tool_use_id: str
    content: Union[str, list[TextBlock]] = ""
    is_error: bool = False
    cache_control: CacheControl | None = None


class ThinkingBlock(_Strict):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


ContentBlock = Annotated[Union[TextBlock, ToolUseBlock, ToolResultBlock, ThinkingBlock], Field(discriminator="type")]


class AnthropicMessage(_Strict):
    role: Literal["user", "assistant"]
    content: Union[str, list[ContentBlock]]


class AnthropicTool(_Strict):
    name: str
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: CacheControl | None = None


class AnthropicToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class ThinkingConfig(_Strict):
    """enabled / adaptive: the template's thinking on (the budget is not enforced apart from max_tokens)."""

    type: Literal["enabled", "adaptive", "disabled"]
    budget_tokens: int | None = None
    display: Literal["summarized"] | None = None   # thinking is returned whole; "omitted" is not offered


class Metadata(_Strict):
    user_id: str | None = None


class CountTokensRequest(_Strict):
    model: str
    messages: list[AnthropicMessage]
    system: Union[str, list[TextBlock], None] = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: ThinkingConfig | None = None

    def to_chat(self, **sampling: Any) -> ChatCompletionRequest:
        """The equivalent chat-completions request (validated by its own model: same limits, same 400s)."""
        self._check_thinking()
        body: dict[str, Any] = {"model": self.model, "messages": self._messages(), **sampling}
        if self.tools:
            body["tools"] = [{"type": "function", "function": {
                "name": t.name, "parameters": t.input_schema,
                **({"description": t.description} if t.description is not None else {})}} for t in self.tools]
        body.update(self._tool_choice())
        if self.thinking is not None:
            body["chat_template_kwargs"] = {"enable_thinking": self.thinking.type != "disabled"}
        return parse_request(ChatCompletionRequest, json.dumps(body).encode())

    def _check_thinking(self) -> None:
        t = self.thinking
        if t is not None and t.type == "enabled" and (t.budget_tokens is None or t.budget_tokens < 1):
            raise APIError("thinking.budget_tokens must be a positive integer", param="thinking.budget_tokens")

    def _tool_choice(self) -> dict[str, Any]:
        """OpenAI's form of tool_choice. `any` / `tool` map onto 'required' / a named choice, which the chat
        path refuses by name until forced calls are available there; then they work here unchanged."""
        choice = self.tool_choice
        if choice is None:
            return {"tool_choice": "auto"} if self.tools else {}
        if choice.name is not None and choice.type != "tool":
            raise APIError("tool_choice.name is only allowed with type 'tool'", param="tool_choice.name")
        out: dict[str, Any] = {}
        if choice.type == "tool":
            if choice.name is None:
                raise APIError("tool_choice type 'tool' needs a name", param="tool_choice.name")
            out["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        else:
            out["tool_choice"] = {"any": "required"}.get(choice.type, choice.type)
        if choice.disable_parallel_tool_use:
            out["parallel_tool_calls"] = False
        return out

    def _messages(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if self.system is not None:
            out.append({"role": "system", "content": _text(self.system)})
        for i, m in enumerate(self.messages):
            if isinstance(m.content, str):
                out.append({"role": m.role, "content": m.content})
            elif m.role == "user":
                out.extend(_user_messages(m.content, i))
            else:
                out.append(_assistant_message(m.content, i))
        return out


class MessagesRequest(CountTokensRequest):
    max_tokens: int
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    metadata: Metadata | None = None     # accepted, not used
    cache_control: CacheControl | None = None   # accepted, not used (prefix caching is automatic)
    service_tier: Literal["auto", "standard_only"] | None = None   # accepted, not used

    def to_chat(self) -> ChatCompletionRequest:
        if self.max_tokens < 1:
            raise APIError(f"max_tokens must be at least 1, got {self.max_tokens}", param="max_tokens")
        t = self.thinking
        if t is not None and t.type == "enabled" and t.budget_tokens is not None and t.budget_tokens >= self.max_tokens:
            raise APIError("thinking.budget_tokens must be less than max_tokens", param="thinking.budget_tokens")
        sampling = {"max_tokens": self.max_tokens, "stop": self.stop_sequences, "temperature": self.temperature,
                    "top_p": self.top_p, "top_k": self.top_k}
        return super().to_chat(**{k: v for k, v in sampling.items() if v is not None})


def _text(content: str | list[TextBlock]) -> str:
    return content if isinstance(content, str) else "\n".join(b.text for b in content)


def _user_messages(blocks: list, i: int) -> list[dict[str, Any]]:
    """A user turn: tool results become tool messages, in order with the text around them."""
    out: list[dict[str, Any]] = []
    text: list[str] = []
    for j, b in enumerate(blocks):
        if isinstance(b, TextBlock):
            text.append(b.text)
        elif isinstance(b, ToolResultBlock):
            if text:
                out.append({"role": "user", "content": "\n".join(text)})
                text = []
            content = _text(b.content)
            out.append({"role": "tool", "tool_call_id": b.tool_use_id,
                        "content": f"Error: {content}" if b.is_error else content})
        else:
            raise APIError(f"a user message cannot hold a {b.type} block", param=f"messages.{i}.content.{j}")
    if text or not out:
        out.append({"role": "user", "content": "\n".join(text)})
    return out


def _assistant_message(blocks: list, i: int) -> dict[str, Any]:
    text, reasoning, calls = [], [], []
    for j, b in enumerate(blocks):
        if isinstance(b, TextBlock):
            text.append(b.text)
        elif isinstance(b, ThinkingBlock):
            reasoning.append(b.thinking)
        elif isinstance(b, ToolUseBlock):
            calls.append({"id": b.id, "type": "function",
                          "function": {"name": b.name, "arguments": json.dumps(b.input)}})
        else:
            raise APIError(f"an assistant message cannot hold a {b.type} block", param=f"messages.{i}.content.{j}")
    message: dict[str, Any] = {"role": "assistant", "content": "\n".join(text)}
    if reasoning:
        message["reasoning_content"] = "\n".join(reasoning)
    if calls:
        message["tool_calls"] = calls
    return message
