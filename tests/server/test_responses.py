"""POST /v1/responses on the real app around the scripted engine (fake_engine.py), driven with the openai
client's `responses.create`: reasoning, message and function_call items, streamed (the documented event
order, sequence numbers) and not, input items (function calls and their outputs, reasoning), and the
refusals (previous_response_id, bad fields)."""

from __future__ import annotations

import httpx
import openai
import pytest

from .conftest import start_scripted_server

TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather forecast for a city.",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                                         "unit": {"type": "string"}}, "required": ["city"]}}]


@pytest.fixture(scope="module")
def server(tokenizer_dir, tmp_path_factory):
    proc = start_scripted_server(tokenizer_dir, tmp_path_factory.mktemp("responses"), "--max-model-len", "4096")
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=30)


def _input(script: str, chunk: int = 3) -> str:
    return f"Weather please [[script:{script}]] [[chunk:{chunk}]]"


def test_reasoning_and_message_items(client):
    r = client.responses.create(model="scripted", input=_input("think"), instructions="Be brief.", store=False)
    assert [item.type for item in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == "The user wants 2+2. That is 4."
    assert r.output_text == "The answer is 4."
    assert r.status == "completed" and r.id.startswith("resp_") and r.object == "response"
    assert r.usage.input_tokens > 0 and r.usage.output_tokens > 0
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens


def test_function_call_items(client):
    r = client.responses.create(model="scripted", input=_input("two_calls"), tools=TOOLS)
    calls = [item for item in r.output if item.type == "function_call"]
    assert [c.name for c in calls] == ["get_weather", "get_weather"]
    assert [c.arguments for c in calls] == ['{"city": "Paris"}', '{"city": "Rome"}']
    assert calls[0].call_id != calls[1].call_id


def test_max_output_tokens_is_incomplete(client):
    r = client.responses.create(model="scripted", input=_input("plain", 1), max_output_tokens=2,
                                reasoning={"effort": "none"})
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"


def test_stream_event_order(client):
    events = list(client.responses.create(model="scripted", input=_input("json_call", 2), tools=TOOLS, stream=True))
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"] and types[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    reasoning = [t for t in types if "reasoning" in t or t.startswith("response.output_item")][:2]
    assert reasoning == ["response.output_item.added", "response.reasoning_text.delta"]
    # the call's item: added, argument deltas, arguments done, item done
    call_events = [t for t in types if "function_call" in t or t.startswith("response.output_item")][2:]
    assert call_events[0] == "response.output_item.added" and call_events[-2:] == [
        "response.function_call_arguments.done", "response.output_item.done"]
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert deltas == done.arguments == '{"city": "Paris", "unit": "celsius"}'
    final = events[-1].response
    assert [i.type for i in final.output] == ["reasoning", "function_call"] and final.usage.output_tokens > 0


def test_stream_text_events(client):
    events = list(client.responses.create(model="scripted", input=_input("plain", 2), stream=True,
                                          reasoning={"effort": "minimal"}))
    types = [e.type for e in events]
    assert types == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * (len(types) - 8),
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.completed"]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == "The answer is 4." == events[-1].response.output_text


def test_input_items_round_trip(client):
    items = [{"role": "user", "content": _input("plain")},
             {"type": "reasoning", "id": "rs_1", "summary": [],
              "content": [{"type": "reasoning_text", "text": "Need the weather."}]},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
             {"role": "user", "content": [{"type": "input_text", "text": "Thanks"}]}]
    r = client.responses.create(model="scripted", input=items, tools=TOOLS, metadata={"k": "v"},
                                parallel_tool_calls=True, temperature=0.0, top_p=1.0)
    assert r.status == "completed" and r.output


@pytest.mark.parametrize("body, field", [
    ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": "hi", "frobnicate": 1}, "frobnicate"),
    ({"input": []}, "input"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "hi", "text": {"format": {"type": "json_object"}}}, "text.format"),
    ({"input": "hi", "truncation": "auto"}, "truncation"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools"),
    ({"input": [{"type": "reasoning", "summary": [{"type": "summary_text", "text": "x"}]}]}, "input"),
])
def test_bad_requests_name_the_field(server, body, field):
    r = httpx.post(f"{server.url}/responses", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert field in r.json()["error"]["message"] or r.json()["error"]["param"] == field
