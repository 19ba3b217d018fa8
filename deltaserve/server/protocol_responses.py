"""OpenAI Responses request schema (POST /v1/responses), validated strictly like protocol.py, and mapped
onto a `ChatCompletionRequest` (same template, tools, limits and sampling checks as chat completions).

Nothing is stored: `store` is accepted (either value) and `previous_response_id` is refused by name, so a
conversation is sent whole as `input` items: messages, function_call / function_call_output and reasoning
items (whose text becomes the next assistant turn's reasoning). `reasoning.effort` sets the template's
thinking switch as chat's `reasoning_effort` does.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, Union

from pydantic import Discriminator, Field, Tag

from .protocol import APIError, ChatCompletionRequest, _Strict, parse_request

Effort = Literal["none", "minimal", "low", "medium", "high"]


class InputText(_Strict):
    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class MessageItem(_Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Union[str, list[InputText]]
    id: str | None = None
    status: str | None = None


class FunctionCallItem(_Strict):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(_Strict):
    type: Literal["function_call_output"]
    call_id: str
    output: str
    id: str | None = None
    status: str | None = None


class ReasoningText(_Strict):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(_Strict):
    type: Literal["reasoning"]
    id: str | None = None
    summary: list[ReasoningText] = Field(default_factory=list)
    content: list[ReasoningText] | None = None
    status: str | None = None


def _item_type(value: Any) -> str | None:
    """An input item's kind: its `type`, "message" when it has none (an easy input message)."""
    if isinstance(value, dict):
        return value.get("type", "message")
    return getattr(value, "type", None)


InputItem = Annotated[Union[Annotated[MessageItem, Tag("message")], Annotated[FunctionCallItem, Tag("function_call")],
                            Annotated[FunctionCallOutputItem, Tag("function_call_output")],
                            Annotated[ReasoningItem, Tag("reasoning")]], Discriminator(_item_type)]


class FunctionTool(_Strict):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunctionChoice(_Strict):
    type: Literal["function"]
    name: str


class ReasoningConfig(_Strict):
    effort: Effort | None = None
    summary: None = None            # only null: the reasoning text is returned whole, never summarized


class TextFormat(_Strict):
    type: Literal["text"]


class TextConfig(_Strict):
    format: TextFormat | None = None   # only text (structured output is a separate feature)
    verbosity: None = None


class ResponsesRequest(_Strict):
    model: str | None = None
    input: Union[str, list[InputItem]]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Union[Literal["auto", "none", "required"], NamedFunctionChoice, None] = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    reasoning: ReasoningConfig | None = None
    text: TextConfig | None = None
    # accepted, not used
    store: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    service_tier: str | None = None
    truncation: Literal["disabled"] | None = None   # "auto" would drop input: not implemented
    # refused by name when set
    previous_response_id: str | None = None
    background: bool | None = None

    def to_chat(self) -> ChatCompletionRequest:
        if self.previous_response_id is not None:
            raise APIError("previous_response_id is not supported: this server stores no responses; send the "
                           "whole conversation as input items", param="previous_response_id")
        if self.background:
            raise APIError("background responses are not supported", param="background")
        if self.max_output_tokens is not None and self.max_output_tokens < 1:
            raise APIError(f"max_output_tokens must be at least 1, got {self.max_output_tokens}",
                           param="max_output_tokens")
        body: dict[str, Any] = {"model": self.model, "messages": self._messages()}
        for key in ("temperature", "top_p", "parallel_tool_calls"):
            if getattr(self, key) is not None:
                body[key] = getattr(self, key)
        if self.max_output_tokens is not None:
            body["max_completion_tokens"] = self.max_output_tokens
        if self.tools:
            body["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                             for t in self.tools]
        choice = self.tool_choice
        if isinstance(choice, NamedFunctionChoice):
            body["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        elif choice is not None:
            body["tool_choice"] = choice
        elif self.tools:
            body["tool_choice"] = "auto"
        if self.reasoning is not None and self.reasoning.effort is not None:
            body["reasoning_effort"] = self.reasoning.effort
        return parse_request(ChatCompletionRequest, json.dumps(body).encode())

    def _messages(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if self.instructions is not None:
            out.append({"role": "system", "content": self.instructions})
        if isinstance(self.input, str):
            return [*out, {"role": "user", "content": self.input}]
        if not self.input:
            raise APIError("input must not be empty", param="input")
        reasoning: list[str] = []   # waiting for the assistant turn it belongs to

        def assistant() -> dict[str, Any]:
            if not (out and out[-1]["role"] == "assistant" and not reasoning):
                out.append({"role": "assistant", "content": ""})
            if reasoning:
                out[-1]["reasoning_content"] = "\n".join(reasoning)
                reasoning.clear()
            return out[-1]

        for item in self.input:
            if isinstance(item, ReasoningItem):
                reasoning.extend(p.text for p in item.content or item.summary)
            elif isinstance(item, FunctionCallItem):
                assistant().setdefault("tool_calls", []).append(
                    {"id": item.call_id, "type": "function",
                     "function": {"name": item.name, "arguments": item.arguments}})
            elif isinstance(item, FunctionCallOutputItem):
                out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
            else:
                text = item.content if isinstance(item.content, str) else "\n".join(p.text for p in item.content)
                if item.role == "assistant":
                    message = assistant()
                    message["content"] = "\n".join(filter(None, (message["content"], text)))
                else:
                    out.append({"role": item.role, "content": text})
        if reasoning:
            raise APIError("a reasoning item must be followed by the assistant message or function call it "
                           "belongs to", param="input")
        return out
