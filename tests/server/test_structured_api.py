"""Structured output on the server (real engine, tiny random Qwen3.5 on CPU, the openai client):
response_format json_schema / json_object, vLLM's guided_* and structured_outputs, logit_bias, bad_words,
forced tool calls in both Qwen styles (they parse as tool calls), and a 400 naming each bad field."""

from __future__ import annotations

import json
import re
import shutil

import jsonschema
import openai
import pytest

from .conftest import ServerProcess

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Rome"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 9},
        "unit": {"type": "object", "properties": {"c": {"type": "boolean"}}, "required": ["c"],
                 "additionalProperties": False},
    },
    "required": ["city", "days", "unit"],
    "additionalProperties": False,
}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}},
         {"type": "function", "function": {"name": "noop", "parameters": {"type": "object", "properties": {}}}}]
FLAT = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["city", "days"], "additionalProperties": False}
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}


def _serve(model_dir, log_dir) -> ServerProcess:
    return ServerProcess(["-m", "deltaserve", "serve", "--model", str(model_dir), "--device", "cpu",
                          "--max-model-len", "1024", "--served-model-name", "tiny", "--tool-call-parser", "qwen",
                          "--uvicorn-log-level", "warning"], log_dir / "server.log").start()


@pytest.fixture(scope="module")
def client(tiny_model_dir, tmp_path_factory):
    proc = _serve(tiny_model_dir, tmp_path_factory.mktemp("structured-server"))
    yield openai.OpenAI(base_url=proc.url, api_key="unused", max_retries=0, timeout=120)
    proc.stop()


@pytest.fixture(scope="module")
def xml_client(tiny_model_dir, tmp_path_factory):
    """The same model with a template that teaches the Qwen3.5 XML call format."""
    path = tmp_path_factory.mktemp("xml-model")
    for f in tiny_model_dir.iterdir():
        shutil.copy(f, path / f.name)
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    cfg["chat_template"] = cfg["chat_template"].replace(
        'Answer a call with <tool_call>{"name": ..., "arguments": ...}</tool_call>.',
        "Answer a call with <tool_call>\\n<function=NAME>\\n<parameter=ARG>\\nVALUE\\n</parameter>\\n</function>"
        "\\n</tool_call>.")
    assert "<function=" in cfg["chat_template"]
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    proc = _serve(path, tmp_path_factory.mktemp("structured-xml-server"))
    yield openai.OpenAI(base_url=proc.url, api_key="unused", max_retries=0, timeout=120)
    proc.stop()


def _chat(client, **kw):
    return client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "weather?"}], **kw)


def test_json_schema_50_samples_validate(client):
    r = _chat(client, n=50, seed=3, temperature=0.6, max_tokens=300,
              response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA, "strict": True}},
              extra_body=NO_THINK)
    assert len(r.choices) == 50
    for c in r.choices:
        assert c.finish_reason == "stop", c.message.content
        jsonschema.validate(json.loads(c.message.content), SCHEMA)


def test_json_object_and_guided_fields(client):
    r = _chat(client, n=2, seed=1, max_tokens=200, response_format={"type": "json_object"}, extra_body=NO_THINK)
    for c in r.choices:
        if c.finish_reason == "stop":
            assert isinstance(json.loads(c.message.content), dict)
    r = _chat(client, n=4, seed=1, max_tokens=20, extra_body={**NO_THINK, "guided_choice": ["sunny", "rain"]})
    assert all(c.message.content in ("sunny", "rain") for c in r.choices)
    r = _chat(client, n=4, seed=2, max_tokens=20, extra_body={**NO_THINK, "guided_regex": "[0-9]{2}C"})
    assert all(re.fullmatch("[0-9]{2}C", c.message.content) for c in r.choices)
    r = client.completions.create(model="tiny", prompt="The", n=3, seed=4, max_tokens=100,
                                  extra_body={"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}})
    for c in r.choices:
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.text), SCHEMA)
    r = client.completions.create(model="tiny", prompt="The", max_tokens=10, extra_body={"guided_grammar":
                                                                                         'root ::= "a"+ "b"'})
    assert re.fullmatch("a+b?", r.choices[0].text)


def test_logit_bias_and_bad_words(client):
    kw = {"model": "tiny", "prompt": "The", "temperature": 0, "max_tokens": 6, "logprobs": 0}
    r = client.completions.create(logit_bias={"40": 100}, extra_body={"ignore_eos": True}, **kw)
    tokens = r.choices[0].logprobs.tokens
    assert len(set(tokens)) == 1                      # the biased token every time
    word = tokens[0]
    assert word.strip() and word.isascii()
    r = client.completions.create(logit_bias={"40": 100}, extra_body={"ignore_eos": True, "bad_words": [word]}, **kw)
    assert word not in r.choices[0].logprobs.tokens   # banned despite the bias


def _call(c):
    assert c.finish_reason == "tool_calls", c.message
    assert len(c.message.tool_calls) == 1
    return c.message.tool_calls[0].function


@pytest.mark.parametrize("style", ["json", "xml"])
def test_forced_tool_calls_parse(style, client, xml_client):
    cl, schema = (client, SCHEMA) if style == "json" else (xml_client, FLAT)   # XML: flat parameters
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": schema}}, TOOLS[1]]
    r = _chat(cl, n=4, seed=5, max_tokens=400, tools=tools, parallel_tool_calls=False,
              tool_choice={"type": "function", "function": {"name": "get_weather"}}, extra_body=NO_THINK)
    for c in r.choices:
        fn = _call(c)
        assert fn.name == "get_weather"
        args = json.loads(fn.arguments)
        if style == "xml":   # XML values may carry whitespace around them (the grammar allows it)
            args["city"] = args["city"].strip()
        jsonschema.validate(args, schema)
    r = _chat(cl, n=3, seed=6, max_tokens=400, tools=tools, tool_choice="required", parallel_tool_calls=False,
              extra_body=NO_THINK)
    for c in r.choices:
        assert _call(c).name in ("get_weather", "noop")


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     None),
    ({"response_format": {"type": "json_object", "json_schema": {"name": "x"}}}, "response_format"),
    ({"guided_regex": "([a-"}, None),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {"jsn": {}}}, "structured_outputs.jsn"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"99999": 1}}, "logit_bias"),
    ({"bad_words": [" "]}, "bad_words"),
    ({"bad_words": "word"}, "bad_words"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "missing"}}},
     "tool_choice.function.name"),
    ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "a"}, "tool_choice"),
    ({"min_tokens": 2, "guided_regex": "a+"}, "min_tokens"),
    ({"tools": TOOLS, "parallel_tool_calls": False, "response_format": {"type": "json_object"}},
     "parallel_tool_calls"),
    ({"tools": TOOLS, "tool_choice": "required", "min_tokens": 2}, "min_tokens"),
])
def test_bad_values_are_400s_naming_the_field(client, body, param):
    with pytest.raises(openai.BadRequestError) as err:
        _chat(client, max_tokens=4, extra_body=body)
    error = err.value.body
    assert err.value.status_code == 400
    if param is not None:
        assert error["param"] == param, error
    else:
        assert "cannot be compiled" in error["message"], error
