"""Tool-call, reasoning and message parsing on crafted model outputs, fed whole and in every chunking
(so tags split across deltas are covered): streaming must give exactly the non-streaming result."""

from __future__ import annotations

import itertools
import json

from deltaserve.server.output_parser import MessageDelta, MessageParser
from deltaserve.server.reasoning import ReasoningParser, starts_in_reasoning
from deltaserve.server.tool_parsers import QwenToolParser, ToolCallDelta, held_prefix_len

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
    "ratio": {"type": "number"}, "tags": {"type": "array"}, "zip": {"type": "string"}}}}}]


def _parse(text: str, chunk: int, *, tools=True, reasoning: bool | None = None) -> tuple[str, str, list[dict]]:
    """(reasoning, content, calls) from feeding `text` `chunk` characters at a time."""
    ids = itertools.count()
    tool_parser = QwenToolParser(TOOLS, id_factory=lambda: f"call_{next(ids)}") if tools else None
    reasoning_parser = None if reasoning is None else ReasoningParser(in_reasoning=reasoning)
    parser = MessageParser(tool_parser, reasoning_parser)
    total = MessageDelta()
    for i in range(0, len(text), chunk):
        total.extend(parser.feed(text[i:i + chunk]))
    total.extend(parser.finish())
    return total.reasoning, total.content, _calls(total.tool_calls)


def _calls(deltas: list[ToolCallDelta]) -> list[dict]:
    calls: dict[int, dict] = {}
    for d in deltas:
        if d.id is not None:
            assert d.index not in calls, "a call's id and name come once, in its first delta"
            calls[d.index] = {"id": d.id, "name": d.name, "arguments": ""}
        assert d.index in calls, "arguments before the call's first delta"
        calls[d.index]["arguments"] += d.arguments
    assert sorted(calls) == list(range(len(calls)))
    return [calls[i] for i in sorted(calls)]


def _all_chunkings(text: str, **kw) -> tuple[str, str, list[dict]]:
    whole = _parse(text, len(text) + 1, **kw)
    for chunk in (1, 2, 3, 4, 7, 13):
        assert _parse(text, chunk, **kw) == whole, f"chunk size {chunk} differs from whole-text parsing"
    for call in whole[2]:
        json.loads(call["arguments"])  # always valid JSON
    return whole


def test_json_style_call_after_think():
    text = ('Weather needed.\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
            '"nested": {"a": [1, 2, "}"]}}}\n</tool_call>')
    reasoning, content, calls = _all_chunkings(text, reasoning=True)
    assert reasoning == "Weather needed."
    assert content == ""
    assert [c["name"] for c in calls] == ["get_weather"]
    assert json.loads(calls[0]["arguments"]) == {"city": "Paris", "nested": {"a": [1, 2, "}"]}}


def test_json_arguments_stream_before_the_call_closes():
    parser = QwenToolParser(TOOLS)
    events = parser.feed('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par')
    assert [e.name for e in events if isinstance(e, ToolCallDelta) and e.id] == ["get_weather"]
    assert "".join(e.arguments for e in events if isinstance(e, ToolCallDelta)) == '{"city": "Par'
    rest = parser.feed('is"}}\n</tool_call>') + parser.finish()
    assert "".join(e.arguments for e in rest if isinstance(e, ToolCallDelta)) == 'is"}'


def test_xml_style_call_inside_think_with_typed_parameters():
    text = ("Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNew\nYork\n</parameter>\n"
            "<parameter=days>\n3\n</parameter>\n<parameter=metric>\nTrue\n</parameter>\n<parameter=ratio>\n0.5\n"
            "</parameter>\n<parameter=tags>\n[\"a\", 1]\n</parameter>\n<parameter=zip>\n01234\n</parameter>\n"
            "</function>\n</tool_call>\n</think>\n\nDone.")
    reasoning, content, calls = _all_chunkings(text, reasoning=True)
    assert reasoning == "Checking."
    assert content == "Done."
    assert calls[0]["name"] == "get_weather"
    assert json.loads(calls[0]["arguments"]) == {"city": "New\nYork", "days": 3, "metric": True, "ratio": 0.5,
                                                 "tags": ["a", 1], "zip": "01234"}


def test_xml_parameters_stream_one_at_a_time():
    parser = QwenToolParser(TOOLS)
    first = parser.feed("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n")
    assert first[0].name == "get_weather"
    assert "".join(e.arguments for e in first) == '{"city": "Paris"'
    rest = parser.feed("</function>\n</tool_call>") + parser.finish()
    assert "".join(e.arguments for e in rest) == "}"


def test_bare_xml_function_and_missing_closing_tags():
    text = "<function=get_weather>\n<parameter=city>\nOslo\n<parameter=days>\n2\n</function>"
    _, content, calls = _all_chunkings(text)
    assert content == ""
    assert json.loads(calls[0]["arguments"]) == {"city": "Oslo", "days": 2}


def test_value_not_matching_its_type_stays_a_string():
    text = "<tool_call>\n<function=get_weather>\n<parameter=days>\nthree\n</parameter>\n</function>\n</tool_call>"
    _, _, calls = _all_chunkings(text)
    assert json.loads(calls[0]["arguments"]) == {"days": "three"}


def test_several_calls_mixed_styles_and_text_between():
    text = ('Sure.\n\n<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n<tool_call>\n<function=b>\n'
            "</function>\n</tool_call>\nand then <tool_call>{\"name\": \"c\", \"arguments\": \"{\\\"x\\\": 1}\"}"
            "</tool_call>")
    _, content, calls = _all_chunkings(text)
    assert [c["name"] for c in calls] == ["a", "b", "c"]
    assert [json.loads(c["arguments"]) for c in calls] == [{}, {}, {"x": 1}]
    assert content == "Sure.\n\n\n\nand then"  # whitespace between two text pieces is kept as written
    assert len({c["id"] for c in calls}) == 3


def test_unparseable_call_comes_back_as_text():
    text = "Use <tool_call> like this </tool_call> ok"
    _, content, calls = _all_chunkings(text)
    assert calls == [] and content == text


def test_not_a_function_tag_is_text_and_later_calls_still_parse():
    text = 'x <function=not a tag\n y <tool_call>{"name": "f", "arguments": {"k": 1}}</tool_call>'
    _, content, calls = _all_chunkings(text)
    assert content == "x <function=not a tag\n y"
    assert [c["name"] for c in calls] == ["f"]


def test_unclosed_call_at_end_of_output():
    _, _, calls = _all_chunkings('<tool_call>\n{"name": "f", "arguments": {"k": [1, 2]}}')
    assert json.loads(calls[0]["arguments"]) == {"k": [1, 2]}
    _, content, calls = _all_chunkings('<tool_call>\n{"name": "f", "argu')  # cut off before the name was usable
    assert calls == [] and content == '<tool_call>\n{"name": "f", "argu'


def test_partial_tag_at_the_end_is_text():
    assert _all_chunkings("a <tool_ca")[1] == "a <tool_ca"
    assert _all_chunkings("b </thi", reasoning=True) == ("b </thi", "", [])


def test_tools_off_leaves_tags_in_content():
    text = '<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    assert _all_chunkings(text, tools=False) == ("", text, [])


def test_reasoning_when_the_model_opens_think_itself():
    text = "<think>\nstep 1\nstep 2\n</think>\n\nFinal answer."
    assert _all_chunkings(text, tools=False, reasoning=False) == ("step 1\nstep 2", "Final answer.", [])


def test_reasoning_without_end_tag_is_all_reasoning():
    assert _all_chunkings("still thinking about it", tools=False, reasoning=True) == (
        "still thinking about it", "", [])


def test_no_reasoning_parser_keeps_text_verbatim():
    text = "  <think>x</think>\n"
    assert _all_chunkings(text, tools=False) == ("", text, [])


def test_starts_in_reasoning_reads_the_prompt_end():
    assert starts_in_reasoning("<|im_start|>assistant\n<think>\n")
    assert not starts_in_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not starts_in_reasoning("<|im_start|>assistant\n")
    assert not starts_in_reasoning("<think> mentioned by the user <|im_end|>\n<|im_start|>assistant\n")


def test_held_prefix_len():
    tags = ("<think>", "</think>")
    assert held_prefix_len("abc <thi", tags) == 4
    assert held_prefix_len("abc </", tags) == 2
    assert held_prefix_len("abc <think>", tags) == 0
    assert held_prefix_len("abc", tags) == 0
    assert held_prefix_len("<", tags) == 1


def test_reasoning_parser_marks_segment_switches():
    parser = ReasoningParser(in_reasoning=False)
    assert parser.feed("a<thi") == [("content", "a")]
    assert parser.feed("nk>b</think>") == [("reasoning", "b"), ("content", "")]
    assert parser.feed("c") == [("content", "c")]
    assert parser.finish() == []
