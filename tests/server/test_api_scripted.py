"""The real app and uvicorn in a subprocess around the scripted engine (fake_engine.py), driven with the
official `openai` client: tool calls and reasoning end to end (streamed and not), every kind of bad
input, API keys, disconnects, and the metrics endpoint."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from .conftest import start_scripted_server

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather forecast for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                                   "unit": {"type": "string"}}, "required": ["city"]}}}]


API_KEY = "sekret"
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def server(tokenizer_dir, tmp_path_factory):
    """One server for the module, with an API key (so every test also checks that a good key passes)."""
    proc = start_scripted_server(tokenizer_dir, tmp_path_factory.mktemp("scripted"), "--api-key", API_KEY)
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url, api_key=API_KEY, max_retries=0, timeout=30)


def _post(url: str, **kw) -> httpx.Response:
    return httpx.post(url, headers={**AUTH, **kw.pop("headers", {})}, timeout=kw.pop("timeout", 30), **kw)


def _get(url: str) -> httpx.Response:
    return httpx.get(url, headers=AUTH, timeout=30)


def _chat(client, script: str, chunk: int = 3, thinking: bool = True, **kw):
    """A chat request whose reply is SCRIPTS[script], `chunk` characters per step. The test template opens
    <think> in the generation prompt unless thinking=False."""
    messages = [{"role": "user", "content": f"Weather please [[script:{script}]] [[chunk:{chunk}]]"}]
    if not thinking:
        kw["extra_body"] = {"chat_template_kwargs": {"enable_thinking": False}}
    return client.chat.completions.create(model="scripted", messages=messages, **kw)


def _collect_stream(stream) -> dict:
    """Aggregate chat chunks the way a client does; checks the chunk protocol on the way."""
    out = {"reasoning": "", "content": "", "calls": {}, "finish": None, "chunks": 0, "usage": None}
    for chunk in stream:
        out["chunks"] += 1
        assert chunk.object == "chat.completion.chunk"
        if not chunk.choices:
            out["usage"] = chunk.usage
            continue
        choice = chunk.choices[0]
        delta = choice.delta
        out["reasoning"] += getattr(delta, "reasoning_content", None) or ""
        out["content"] += delta.content or ""
        for tc in delta.tool_calls or []:
            call = out["calls"].setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
            if tc.id:
                assert call["id"] is None, "id sent twice for one call"
                call.update(id=tc.id, name=tc.function.name)
            call["arguments"] += tc.function.arguments or ""
        if choice.finish_reason:
            assert out["finish"] is None, "two finish chunks"
            out["finish"] = choice.finish_reason
    return out


# ---- reasoning and tool calls ----------------------------------------------------------------------
def test_reasoning_split_from_content(client):
    r = _chat(client, "think")
    msg = r.choices[0].message
    assert msg.reasoning_content == "The user wants 2+2. That is 4."
    assert msg.content == "The answer is 4."
    assert r.choices[0].finish_reason == "stop" and not msg.tool_calls
    s = _collect_stream(_chat(client, "think", chunk=1, stream=True))
    assert (s["reasoning"], s["content"], s["finish"]) == (msg.reasoning_content, msg.content, "stop")


@pytest.mark.parametrize("chunk", [1, 2, 5])
def test_json_tool_call_after_think(client, chunk):
    r = _chat(client, "json_call", chunk=chunk, tools=TOOLS)
    msg, choice = r.choices[0].message, r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert msg.reasoning_content == "I should look up the weather."
    assert msg.content is None
    [call] = msg.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "unit": "celsius"}
    s = _collect_stream(_chat(client, "json_call", chunk=chunk, tools=TOOLS, stream=True))
    assert s["finish"] == "tool_calls" and s["reasoning"] == msg.reasoning_content and s["content"] == ""
    assert [(c["name"], json.loads(c["arguments"])) for c in s["calls"].values()] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"})]


def test_xml_tool_call_inside_think_typed_by_schema(client):
    r = _chat(client, "xml_in_think", tools=TOOLS, tool_choice="auto")
    msg = r.choices[0].message
    assert msg.reasoning_content == "Checking the forecast."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls] == [
        ("get_weather", {"city": "Paris", "days": 3})]
    s = _collect_stream(_chat(client, "xml_in_think", chunk=1, tools=TOOLS, stream=True))
    assert s["reasoning"] == msg.reasoning_content and s["finish"] == "tool_calls"
    assert json.loads(s["calls"][0]["arguments"]) == {"city": "Paris", "days": 3}


def test_two_calls_in_one_message(client):
    s = _collect_stream(_chat(client, "two_calls", chunk=4, tools=TOOLS, stream=True))
    assert [json.loads(c["arguments"]) for c in s["calls"].values()] == [{"city": "Paris"}, {"city": "Rome"}]
    assert len({c["id"] for c in s["calls"].values()}) == 2


def test_enable_thinking_false_closes_the_think_block(client):
    r = _chat(client, "no_think_json", tools=TOOLS, thinking=False)
    msg = r.choices[0].message
    assert msg.reasoning_content is None
    assert json.loads(msg.tool_calls[0].function.arguments) == {"city": "Oslo"}
    # Same output with the template's default (thinking on): the whole text counts as reasoning, but the call
    # is still found.
    r = _chat(client, "no_think_json", tools=TOOLS)
    assert r.choices[0].message.tool_calls and r.choices[0].message.content is None


def test_tool_choice_none_leaves_tags_in_content(client):
    r = _chat(client, "no_think_json", tools=TOOLS, tool_choice="none", thinking=False)
    msg = r.choices[0].message
    assert not msg.tool_calls and msg.content.startswith("<tool_call>")
    assert r.choices[0].finish_reason == "stop"


def test_stream_usage_and_n(client):
    stream = _chat(client, "plain", thinking=False, n=2, stream=True, stream_options={"include_usage": True})
    finishes, texts, usage = {}, {0: "", 1: ""}, None
    for chunk in stream:
        if not chunk.choices:
            usage = chunk.usage
            continue
        assert chunk.usage is None
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
    assert finishes == {0: "stop", 1: "stop"} and texts == {0: "The answer is 4.", 1: "The answer is 4."}
    assert usage.completion_tokens == 2 * 6 and usage.prompt_tokens > 0
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_chat_logprobs(client):
    r = _chat(client, "plain", thinking=False, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 and t.logprob == -0.25 for t in content)
    assert content[0].top_logprobs[0].logprob == -0.25  # the chosen token ranks first here


def test_completions_echo_n_multi_prompt(client):
    r = client.completions.create(model="scripted", prompt=["Hello", "Tell me"], n=2, echo=True, max_tokens=50)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text for c in r.choices] == ["Hello" + "The answer is 4."] * 2 + ["Tell me" + "The answer is 4."] * 2
    s = client.completions.create(model="scripted", prompt="Hello", echo=True, stream=True, max_tokens=50,
                                  logprobs=1, stream_options={"include_usage": True})
    text, logprobs, usage = "", [], None
    for chunk in s:
        if not chunk.choices:
            usage = chunk.usage
            continue
        text += chunk.choices[0].text
        logprobs += chunk.choices[0].logprobs.token_logprobs
    assert text == "Hello" + "The answer is 4."
    # echo lists the prompt tokens too (no logprobs for them from this engine), then the 6 generated ones
    assert logprobs == [None] * usage.prompt_tokens + [-0.25] * 6 and usage.completion_tokens == 6


def test_models_version_health(client, server):
    assert [m.id for m in client.models.list().data] == ["scripted"]
    assert _get(f"{server.base}/version").json()["version"]
    assert _get(f"{server.base}/health").status_code == 200


# ---- bad input: 400 with an OpenAI error body naming the problem -----------------------------------------
BAD_CHAT = [
    ({"model": "nope"}, "model", "does not exist"),
    ({"temperature": -1}, "temperature", "temperature"),
    ({"top_p": 1.5}, "top_p", "top_p"),
    ({"n": 0}, "n", "n"),
    ({"max_tokens": 0}, "max_tokens", "max_tokens"),
    ({"max_tokens": 100000}, "max_tokens", "context"),
    ({"max_tokens": 5, "max_completion_tokens": 5}, "max_tokens", "not both"),
    ({"presence_penalty": 3}, "presence_penalty", "presence_penalty"),
    ({"top_logprobs": 3}, "top_logprobs", "logprobs"),
    ({"logprobs": True, "top_logprobs": 50}, "top_logprobs", "top_logprobs"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "json_schema"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name", "not in tools"),
    ({"logit_bias": {"5": 101}}, "logit_bias", "[-100, 100]"),
    ({"temperature": "hot"}, "temperature", "temperature"),
    ({"frobnicate": True}, "frobnicate", "not a supported field"),
    ({"stream_options": {"include_usage": True}}, "stream_options", "stream"),
    ({"seed": 2**70}, "seed", "seed"),
    ({"top_k": -5}, "top_k", "top_k"),
    ({"min_p": 2}, "min_p", "min_p"),
    ({"repetition_penalty": 0}, "repetition_penalty", "repetition_penalty"),
    ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs", "tools"),
    ({"messages": []}, "messages", "empty"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages.0.content", "content"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "system", "content": "late"}]}, "messages",
     "system message must come first"),
    ({"messages": [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "not json"}}]}]},
     "messages.0.tool_calls.0.function.arguments", "JSON object"),
    ({"messages": [{"role": "user", "content": "x " * 600}]}, "messages", "context"),
]


@pytest.mark.parametrize("change,param,words", BAD_CHAT, ids=[b[1] + "-" + str(i) for i, b in enumerate(BAD_CHAT)])
def test_bad_chat_request_is_a_400_naming_the_field(server, change, param, words):
    body = {"model": "scripted", "messages": [{"role": "user", "content": "hi"}], **change}
    r = _post(f"{server.url}/chat/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words.lower() in error["message"].lower(), error
    assert error["type"] == "invalid_request_error"


BAD_COMPLETION = [
    ({"prompt": []}, "prompt", "empty"),
    ({"prompt": [[]]}, "prompt", "empty"),
    ({"prompt": [1, "a"]}, "prompt", "prompt"),
    ({"prompt": [10**9]}, None, "out of range"),
    ({"prompt": "x " * 600}, "prompt", "context"),
    ({"logprobs": 21}, "logprobs", "logprobs"),
    ({"suffix": "end"}, "suffix", "not supported"),
    ({"n": 3, "best_of": 2}, "best_of", "best_of"),
    ({"echo": "yes"}, "echo", "echo"),
    ({"stop": [""]}, "stop", "stop"),
    ({"min_tokens": 20, "max_tokens": 10}, "min_tokens", "min_tokens"),
]


@pytest.mark.parametrize("change,param,words", BAD_COMPLETION,
                         ids=[str(b[1]) + "-" + str(i) for i, b in enumerate(BAD_COMPLETION)])
def test_bad_completion_request_is_a_400_naming_the_field(server, change, param, words):
    r = _post(f"{server.url}/completions", json={"model": "scripted", "prompt": "hi", **change}, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words.lower() in error["message"].lower(), error


@pytest.mark.parametrize("body", [b"{not json", b"[1, 2]", b"", b'{"prompt": "x", "max_tokens": 5,}'])
def test_malformed_json_is_a_400(server, body):
    r = _post(f"{server.url}/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400
    assert "JSON" in r.json()["error"]["message"]


def test_openai_client_sees_bad_request_errors(client):
    with pytest.raises(openai.BadRequestError, match="does not exist"):
        client.completions.create(model="other-model", prompt="hi")
    with pytest.raises(openai.BadRequestError, match="not a supported field"):
        client.completions.create(model="scripted", prompt="hi", extra_body={"guided_jsn": {}})
    with pytest.raises(openai.BadRequestError, match="temperature"):  # refused before any SSE is sent
        client.chat.completions.create(model="scripted", messages=[{"role": "user", "content": "hi"}], stream=True,
                                       temperature=-3)


def test_unknown_route_is_a_404_error_body(server):
    r = _get(f"{server.url}/nothing-here")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


def test_bad_requests_do_not_hurt_a_concurrent_stream(client, server):
    stream = _chat(client, "think", chunk=1, stream=True)
    first = next(iter(stream))  # the role chunk: the request is in the engine now
    for _ in range(5):
        assert _post(f"{server.url}/chat/completions", content=b"{oops").status_code == 400
    rest = _collect_stream(stream)
    assert first.choices[0].delta.role == "assistant"
    assert rest["content"] == "The answer is 4." and rest["finish"] == "stop"


# ---- disconnects and metrics ---------------------------------------------------------------------------
def _metrics(server) -> dict[str, float]:
    text = _get(f"{server.base}/metrics").text
    values = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            label = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            values[s.name + (f"{{{label}}}" if label else "")] = s.value
    return values


def _wait_idle(server, timeout: float = 10.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = _metrics(server)
        if m["deltaserve_num_requests_running"] == 0 or time.monotonic() > deadline:
            return m
        time.sleep(0.05)


def test_stream_disconnect_aborts_and_frees(client, server):
    before = _wait_idle(server)
    stream = client.completions.create(model="scripted", prompt="go [[forever]]", max_tokens=250, stream=True)
    for i, _ in enumerate(stream):
        if i == 3:
            break
    assert _metrics(server)["deltaserve_num_requests_running"] == 1
    stream.close()
    after = _wait_idle(server)
    assert after["deltaserve_num_requests_running"] == 0
    assert after["deltaserve_kv_blocks_used"] == 0 and after["deltaserve_state_slots_used"] == 0
    assert after["deltaserve_requests_total{outcome=abort}"] == before["deltaserve_requests_total{outcome=abort}"] + 1


def test_non_stream_disconnect_aborts_and_frees(server):
    before = _wait_idle(server)
    with pytest.raises(httpx.ReadTimeout):
        _post(f"{server.url}/completions", json={"prompt": "go [[forever]]", "max_tokens": 200}, timeout=0.5)
    after = _wait_idle(server)
    assert after["deltaserve_num_requests_running"] == 0 and after["deltaserve_kv_blocks_used"] == 0
    assert after["deltaserve_requests_total{outcome=abort}"] == before["deltaserve_requests_total{outcome=abort}"] + 1


def test_metrics_parse_and_count(client, server):
    before = _wait_idle(server)
    client.completions.create(model="scripted", prompt="hello", max_tokens=50)
    _post(f"{server.url}/completions", json={"prompt": "hi", "temperature": -1})
    m = _metrics(server)
    grew = lambda name: m[name] - before[name]  # noqa: E731
    assert grew("deltaserve_requests_total{outcome=stop}") == 1
    assert grew("deltaserve_requests_total{outcome=rejected}") == 1
    assert grew("deltaserve_generation_tokens_total") == 6 and grew("deltaserve_prompt_tokens_total") > 0
    assert grew("deltaserve_time_to_first_token_seconds_count") == 1
    assert grew("deltaserve_inter_token_latency_seconds_count") == 5  # 6 tokens, 5 gaps
    assert grew("deltaserve_e2e_request_latency_seconds_count") == 1
    for name in ("num_requests_waiting", "kv_blocks_total", "state_slots_total", "kv_cache_usage_ratio",
                 "e2e_request_latency_seconds_count"):
        assert f"deltaserve_{name}" in m


# ---- API key ---------------------------------------------------------------------------------------------
def test_api_key(server):
    assert httpx.get(f"{server.base}/health").status_code == 200  # the one open route
    for path in ("/v1/models", "/metrics", "/version"):
        r = httpx.get(f"{server.base}{path}")
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(f"{server.base}{path}", headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert _get(f"{server.base}{path}").status_code == 200
    r = httpx.post(f"{server.url}/completions", json={"prompt": "hi"})
    assert r.status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url, api_key="wrong", max_retries=0).models.list()
