"""Compatibility routes and fields on the real app around the scripted engine: GET /v1/models/{id}
(openai's models.retrieve, 404 in OpenAI's shape), /tokenize and /detokenize in vLLM's shapes, the fields
standard clients send that change nothing (accepted), the ones that would (refused by name),
`reasoning_effort` onto the template's thinking switch, and /openapi.json describing every request body."""

from __future__ import annotations

import httpx
import openai
import pytest

from .conftest import start_scripted_server

MESSAGES = [{"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def server(tokenizer_dir, tmp_path_factory):
    proc = start_scripted_server(tokenizer_dir, tmp_path_factory.mktemp("compat"))
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=30)


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.base}{path}", json=body, timeout=30)


def test_models_retrieve(client):
    card = client.models.retrieve("scripted")
    assert card.id == "scripted" and card.object == "model"
    with pytest.raises(openai.NotFoundError) as exc:
        client.models.retrieve("nope")
    assert exc.value.body["code"] == "model_not_found" and "'nope'" in exc.value.body["message"]


def test_tokenize_prompt_and_detokenize_round_trip(server):
    r = _post(server, "/tokenize", {"prompt": "Hello world", "return_token_strs": True}).json()
    assert r["count"] == len(r["tokens"]) == len(r["token_strs"]) > 0 and r["max_model_len"] == 512
    assert _post(server, "/detokenize", {"tokens": r["tokens"]}).json() == {"prompt": "Hello world"}
    plain = _post(server, "/tokenize", {"prompt": "Hello world", "add_special_tokens": False}).json()
    assert plain["token_strs"] is None and plain["count"] <= r["count"]


def test_tokenize_messages_matches_the_chat_prompt(server, client):
    r = _post(server, "/tokenize", {"messages": MESSAGES}).json()
    text = _post(server, "/detokenize", {"tokens": r["tokens"]}).json()["prompt"]
    assert text.endswith("<|im_start|>assistant\n<think>\n") and "Hello there" in text
    chat = client.chat.completions.create(model="scripted", messages=MESSAGES, max_tokens=2)
    assert chat.usage.prompt_tokens == r["count"]


@pytest.mark.parametrize("effort, thinking", [("none", False), ("minimal", False), ("low", True),
                                              ("medium", True), ("high", True)])
def test_reasoning_effort_sets_the_thinking_switch(server, effort, thinking):
    ids = _post(server, "/tokenize", {"messages": MESSAGES, "reasoning_effort": effort}).json()["tokens"]
    text = _post(server, "/detokenize", {"tokens": ids}).json()["prompt"]
    assert text.endswith("<think>\n\n</think>\n\n") != thinking


def test_reasoning_effort_on_chat(client):
    out = client.chat.completions.create(model="scripted", max_tokens=50, reasoning_effort="none", messages=[
        {"role": "user", "content": "[[script:plain]]"}])
    assert out.choices[0].message.content == "The answer is 4."   # not taken as reasoning
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model="scripted", max_tokens=5, reasoning_effort="high", messages=MESSAGES,
                                       extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert exc.value.body["param"] == "reasoning_effort"


def test_accepted_and_ignored_fields(client):
    out = client.chat.completions.create(model="scripted", messages=MESSAGES, max_tokens=4, metadata={"a": "b"},
                                         store=True, service_tier="auto", user="u", parallel_tool_calls=True)
    assert out.choices[0].message.reasoning_content
    out = client.completions.create(model="scripted", prompt="hi", max_tokens=2, user="u",
                                    extra_body={"metadata": {"a": "b"}, "store": False})
    assert out.choices[0].text is not None


@pytest.mark.parametrize("path, body, field", [
    ("/v1/chat/completions", {"messages": MESSAGES, "prediction": {"type": "content", "content": "x"}}, "prediction"),
    ("/v1/chat/completions", {"messages": MESSAGES, "reasoning_effort": "extreme"}, "reasoning_effort"),
    ("/v1/chat/completions", {"messages": MESSAGES, "stream_options": {"include_usage": True}}, "stream_options"),
    ("/v1/chat/completions", {"messages": MESSAGES, "metadata": {"a": 1}}, "metadata"),
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": "a", "messages": MESSAGES}, "prompt"),
    ("/tokenize", {"prompt": "a", "reasoning_effort": "high"}, "reasoning_effort"),
    ("/tokenize", {"prompt": "a", "model": "other"}, "model"),
    ("/detokenize", {"tokens": [-1]}, "tokens"),
    ("/detokenize", {"tokens": [10**9]}, "tokens"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
])
def test_refusals_name_the_field(server, path, body, field):
    r = _post(server, path, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field or field in r.json()["error"]["message"]


def test_openapi_describes_every_request_body(server):
    doc = httpx.get(f"{server.base}/openapi.json", timeout=30).json()
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/messages", "/v1/messages/count_tokens",
                 "/v1/responses", "/tokenize", "/detokenize"):
        op = doc["paths"][path]["post"]
        ref = op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        schema = doc["components"]["schemas"][ref.rsplit("/", 1)[1]]
        assert schema["properties"] and "additionalProperties" in schema
        assert "application/json" in op["responses"]["200"]["content"] and "4XX" in op["responses"]
    assert "/v1/models/{model_id}" in doc["paths"]
