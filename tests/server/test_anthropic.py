"""POST /v1/messages and /v1/messages/count_tokens on the real app around the scripted engine
(fake_engine.py), driven with the official `anthropic` client: thinking, text and tool_use blocks,
streamed (the documented event order) and not, stop reasons, multi-turn tool results, x-api-key auth and
errors in Anthropic's body shape. Stop sequences run on the real engine (test_compat_engine.py)."""

from __future__ import annotations

import json

import httpx
import pytest

from .conftest import start_scripted_server

anthropic = pytest.importorskip("anthropic")

API_KEY = "sekret"
TOOLS = [{"name": "get_weather", "description": "Weather forecast for a city.",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                                           "unit": {"type": "string"}}, "required": ["city"]}}]


@pytest.fixture(scope="module")
def server(tokenizer_dir, tmp_path_factory):
    proc = start_scripted_server(tokenizer_dir, tmp_path_factory.mktemp("anthropic"), "--api-key", API_KEY,
                                 "--max-model-len", "4096")
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.base, api_key=API_KEY, max_retries=0, timeout=30)


def _user(script: str, chunk: int = 3) -> list[dict]:
    return [{"role": "user", "content": f"Weather please [[script:{script}]] [[chunk:{chunk}]]"}]


def test_thinking_and_text_blocks(client):
    msg = client.messages.create(model="scripted", max_tokens=100, messages=_user("think"))
    assert [b.type for b in msg.content] == ["thinking", "text"]
    assert msg.content[0].thinking == "The user wants 2+2. That is 4."
    assert msg.content[1].text == "The answer is 4."
    assert msg.stop_reason == "end_turn" and msg.stop_sequence is None
    assert msg.role == "assistant" and msg.id.startswith("msg_") and msg.model == "scripted"
    assert msg.usage.input_tokens > 0 and msg.usage.output_tokens > 0


def test_tool_use_block(client):
    msg = client.messages.create(model="scripted", max_tokens=100, messages=_user("json_call"), tools=TOOLS)
    assert [b.type for b in msg.content] == ["thinking", "tool_use"]
    call = msg.content[1]
    assert call.name == "get_weather" and call.input == {"city": "Paris", "unit": "celsius"}
    assert call.id.startswith("toolu_") and msg.stop_reason == "tool_use"


def test_stream_event_order_matches_the_message(client):
    with client.messages.stream(model="scripted", max_tokens=100, messages=_user("two_calls", 2),
                                tools=TOOLS) as stream:
        events = list(stream)
        final = stream.get_final_message()
    types = [e.type for e in events if not e.type.startswith(("text", "thinking", "input_json"))]
    assert types[0] == "message_start" and types[-2:] == ["message_delta", "message_stop"]
    blocks = [e for e in events if e.type.startswith("content_block")]
    open_index = None
    for e in blocks:   # start, deltas, stop per block; indices in order; no delta outside its block
        if e.type == "content_block_start":
            assert open_index is None
            open_index = e.index
        elif e.type == "content_block_delta":
            assert e.index == open_index
        else:
            assert e.index == open_index
            open_index = None
    assert open_index is None
    assert [b.type for b in final.content] == ["thinking", "tool_use", "tool_use"]
    assert [b.input for b in final.content[1:]] == [{"city": "Paris"}, {"city": "Rome"}]
    assert final.stop_reason == "tool_use" and final.usage.output_tokens > 0


def test_raw_stream_has_ping_and_deltas_of_each_kind(server):
    body = {"model": "scripted", "max_tokens": 100, "stream": True, "messages": _user("json_call", 4),
            "tools": TOOLS}
    with httpx.stream("POST", f"{server.base}/v1/messages", json=body, headers={"x-api-key": API_KEY},
                      timeout=30) as r:
        lines = list(r.iter_lines())
    names = [line[len("event: "):] for line in lines if line.startswith("event: ")]
    data = [json.loads(line[len("data: "):]) for line in lines if line.startswith("data: ")]
    assert names[:2] == ["message_start", "ping"] and names[-1] == "message_stop"
    assert [d["type"] for d in data] == names
    kinds = {d["delta"]["type"] for d in data if d["type"] == "content_block_delta"}
    assert kinds == {"thinking_delta", "input_json_delta"}
    partial = "".join(d["delta"]["partial_json"] for d in data
                      if d["type"] == "content_block_delta" and d["delta"]["type"] == "input_json_delta")
    assert json.loads(partial) == {"city": "Paris", "unit": "celsius"}
    final = next(d for d in data if d["type"] == "message_delta")
    assert final["delta"]["stop_reason"] == "tool_use" and final["usage"]["output_tokens"] > 0


def test_multi_turn_tool_result_and_system(client):
    messages = [*_user("plain"),
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "Need the weather.", "signature": ""},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny, 21 C"},
                    {"type": "text", "text": "And tomorrow?"}]}]
    msg = client.messages.create(model="scripted", max_tokens=100, messages=messages, tools=TOOLS,
                                 system=[{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
                                 metadata={"user_id": "u1"}, thinking={"type": "disabled"},
                                 extra_body={"temperature": 0.0, "top_p": 1.0, "top_k": 5})
    assert [b.type for b in msg.content] == ["text"]   # thinking disabled: the template closes <think>
    count = client.messages.count_tokens(model="scripted", messages=messages, tools=TOOLS, system="Be brief.")
    assert count.input_tokens > 0
    shorter = client.messages.count_tokens(model="scripted", messages=messages[:1])
    assert shorter.input_tokens < count.input_tokens


def test_max_tokens_stop_reason(client):
    msg = client.messages.create(model="scripted", max_tokens=2, messages=_user("plain", 1))
    assert msg.stop_reason == "max_tokens"


@pytest.mark.parametrize("body, field", [
    ({"max_tokens": 10}, "messages"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
    ({"max_tokens": 0, "messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
    ({"max_tokens": 10, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages"),
    ({"max_tokens": 10, "messages": [{"role": "user", "content": "hi"}], "frobnicate": 1}, "frobnicate"),
    ({"max_tokens": 10, "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS,
      "tool_choice": {"type": "tool"}}, "tool_choice"),
    ({"max_tokens": 10, "messages": [{"role": "user", "content": "hi"}],
      "thinking": {"type": "enabled", "budget_tokens": 50}}, "budget_tokens"),
    ({"max_tokens": 10, "messages": [{"role": "assistant", "content": [
        {"type": "tool_result", "tool_use_id": "x", "content": "y"}]}]}, "tool_result"),
])
def test_bad_requests_are_anthropic_errors_naming_the_field(server, body, field):
    r = httpx.post(f"{server.base}/v1/messages", json={"model": "scripted", **body},
                   headers={"x-api-key": API_KEY}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
    assert field in err["error"]["message"]


def test_client_errors_and_auth(server, client):
    with pytest.raises(anthropic.BadRequestError) as exc:
        client.messages.create(model="other", max_tokens=10, messages=_user("plain"))
    assert exc.value.body["error"]["type"] == "invalid_request_error"
    assert "'other' does not exist" in exc.value.body["error"]["message"]
    bad = anthropic.Anthropic(base_url=server.base, api_key="wrong", max_retries=0, timeout=30)
    with pytest.raises(anthropic.AuthenticationError) as exc:
        bad.messages.create(model="scripted", max_tokens=10, messages=_user("plain"))
    assert exc.value.body["type"] == "error" and exc.value.body["error"]["type"] == "authentication_error"


def test_middleware_errors_have_the_anthropic_shape_on_its_routes(tokenizer_dir):
    from starlette.testclient import TestClient

    from deltaserve.server.api_server import build_app
    from deltaserve.server.state import ServerConfig

    from .fake_engine import ScriptedEngine

    app = build_app(ScriptedEngine(str(tokenizer_dir)), ServerConfig("scripted", api_key=API_KEY,
                                                                      max_request_bytes=1000))
    body = {"model": "scripted", "messages": [{"role": "user", "content": "hi"}]}
    with TestClient(app) as c:
        big = c.post("/v1/messages", json={**body, "max_tokens": 5, "system": "x" * 2000},
                     headers={"x-api-key": API_KEY})
        assert big.status_code == 413 and big.json()["error"]["type"] == "request_too_large"
        assert c.post("/v1/messages/count_tokens", json=body).json()["error"]["type"] == "authentication_error"
        ok = c.post("/v1/messages/count_tokens", json=body, headers={"Authorization": f"Bearer {API_KEY}"})
        assert ok.status_code == 200 and ok.json()["input_tokens"] > 0
        openai_shape = c.post("/v1/chat/completions", json=body)   # other routes keep OpenAI's shape
        assert openai_shape.status_code == 401 and openai_shape.json()["error"]["code"] == "invalid_api_key"
