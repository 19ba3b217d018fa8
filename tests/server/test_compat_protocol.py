"""Unit tests (no server) of the Anthropic and Responses request mappings onto chat requests, and of
`BlockAssembler`, which cuts a parsed message into the blocks both APIs stream."""

from __future__ import annotations

import json

import pytest

from deltaserve.server.chat_blocks import BlockAssembler
from deltaserve.server.output_parser import MessageDelta
from deltaserve.server.protocol import RequestLimits, parse_request
from deltaserve.server.protocol_anthropic import MessagesRequest
from deltaserve.server.protocol_responses import ResponsesRequest
from deltaserve.server.tool_parsers import ToolCallDelta


def _anthropic(**body):
    return parse_request(MessagesRequest, json.dumps({"model": "m", "max_tokens": 8, **body}).encode()).to_chat()


def _responses(**body):
    return parse_request(ResponsesRequest, json.dumps(body).encode()).to_chat()


def test_anthropic_turns_map_onto_template_messages():
    chat = _anthropic(system="sys", messages=[
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "hmm"}, {"type": "text", "text": "ok"},
                                          {"type": "tool_use", "id": "t1", "name": "f", "input": {"x": 1}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "42"},
                                     {"type": "tool_result", "tool_use_id": "t2", "is_error": True,
                                      "content": [{"type": "text", "text": "boom"}]},
                                     {"type": "text", "text": "next"}]}],
        tools=[{"name": "f", "input_schema": {"type": "object"}}], stop_sequences=["END"], top_k=3)
    assert chat.template_messages() == [
        {"role": "system", "content": "sys"}, {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "ok", "reasoning_content": "hmm",
         "tool_calls": [{"id": "t1", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}]},
        {"role": "tool", "content": "42", "tool_call_id": "t1"},
        {"role": "tool", "content": "Error: boom", "tool_call_id": "t2"},
        {"role": "user", "content": "next"}]
    assert chat.stop == ["END"] and chat.top_k == 3 and chat.max_tokens == 8 and chat.tool_choice == "auto"


@pytest.mark.parametrize("thinking, enabled", [({"type": "disabled"}, False),
                                               ({"type": "enabled", "budget_tokens": 4}, True),
                                               ({"type": "adaptive"}, True), (None, None)])
def test_anthropic_thinking_sets_the_switch(thinking, enabled):
    chat = _anthropic(messages=[{"role": "user", "content": "hi"}], **({"thinking": thinking} if thinking else {}))
    assert (chat.chat_template_kwargs or {}).get("enable_thinking") == enabled


def test_anthropic_forced_tool_choices_map_onto_the_chat_forced_calls():
    tools = [{"name": "f", "input_schema": {"type": "object"}}]
    expect = {"any": "required", "tool": {"type": "function", "function": {"name": "f"}}}
    for choice in ({"type": "any"}, {"type": "tool", "name": "f"}):
        chat = _anthropic(messages=[{"role": "user", "content": "hi"}], tools=tools, tool_choice=choice)
        chat.check(RequestLimits())
        got = chat.tool_choice.model_dump(exclude_none=True) if hasattr(chat.tool_choice, "model_dump") \
            else chat.tool_choice
        assert got == expect[choice["type"]]


def test_responses_items_map_onto_template_messages():
    chat = _responses(instructions="be nice", input=[
        {"role": "user", "content": "hi"},
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "think"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{\"a\": 1}"},
        {"type": "function_call", "call_id": "c2", "name": "f", "arguments": "{\"a\": 2}"},
        {"type": "function_call_output", "call_id": "c1", "output": "one"},
        {"type": "function_call_output", "call_id": "c2", "output": "two"},
        {"role": "assistant", "content": [{"type": "output_text", "text": "done"}]}],
        max_output_tokens=5, reasoning={"effort": "low"})
    msgs = chat.template_messages()
    assert msgs[:2] == [{"role": "system", "content": "be nice"}, {"role": "user", "content": "hi"}]
    assert msgs[2]["reasoning_content"] == "think" and [c["id"] for c in msgs[2]["tool_calls"]] == ["c1", "c2"]
    assert [m["role"] for m in msgs[3:]] == ["tool", "tool", "assistant"] and msgs[-1]["content"] == "done"
    assert chat.max_completion_tokens == 5 and chat.template_kwargs() == {"enable_thinking": True}


def test_block_assembler_opens_and_closes_blocks_in_order():
    a = BlockAssembler()
    events = a.feed(MessageDelta(reasoning="r1"))
    events += a.feed(MessageDelta(reasoning="r2", content="c1"))
    calls = [ToolCallDelta(0, "id0", "f", '{"a"'), ToolCallDelta(0, None, None, ": 1}"), ToolCallDelta(1, "id1", "g", "{}")]
    events += a.feed(MessageDelta(tool_calls=calls))
    events += a.close()
    shown = [(e.type, e.block.index, e.delta) for e in events]
    assert shown == [("start", 0, ""), ("delta", 0, "r1"), ("delta", 0, "r2"), ("stop", 0, ""),
                     ("start", 1, ""), ("delta", 1, "c1"), ("stop", 1, ""),
                     ("start", 2, ""), ("delta", 2, '{"a"'), ("delta", 2, ": 1}"), ("stop", 2, ""),
                     ("start", 3, ""), ("delta", 3, "{}"), ("stop", 3, "")]
    assert [b.kind for b in a.blocks] == ["thinking", "text", "tool_call", "tool_call"]
    assert a.blocks[2].arguments() == {"a": 1} and a.num_tool_calls == 2 and a.close() == []
