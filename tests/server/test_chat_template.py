"""Chat prompts as the server renders them (tools, enable_thinking, add_generation_prompt,
continue_final_message), and the `serve` subcommand's registration in the CLI."""

from __future__ import annotations

import json

import pytest

from deltaserve.cli import build_parser
from deltaserve.server.async_engine import AsyncEngine
from deltaserve.server.cli_args import DEFAULT_SERVED_NAME, cmd_serve, served_model_name
from deltaserve.server.metrics import ServerMetrics
from deltaserve.server.protocol import APIError, ChatCompletionRequest, parse_request
from deltaserve.server.reasoning import starts_in_reasoning
from deltaserve.server.serving_chat import render_prompt
from deltaserve.server.state import ServerConfig, ServerState

from .fake_engine import ScriptedEngine

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def state(tokenizer_dir):
    return ServerState(AsyncEngine(ScriptedEngine(str(tokenizer_dir))), ServerConfig("m"), ServerMetrics())


def _render(state, **body) -> str:
    body.setdefault("messages", [{"role": "user", "content": "Hi"}])
    return render_prompt(state, parse_request(ChatCompletionRequest, json.dumps(body).encode()))


def test_parsers_switch_on_from_the_tokenizer(state):
    assert state.tools_enabled and state.reasoning_enabled


def test_generation_prompt_and_enable_thinking(state):
    prompt = _render(state)
    assert prompt.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n")
    assert starts_in_reasoning(prompt)
    closed = _render(state, chat_template_kwargs={"enable_thinking": False})
    assert closed.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n") and not starts_in_reasoning(closed)
    assert _render(state, add_generation_prompt=False).endswith("Hi<|im_end|>\n")


def test_tools_are_rendered_unless_tool_choice_is_none(state):
    with_tools = _render(state, tools=TOOLS)
    assert "<tools>" in with_tools and '"name": "get_weather"' in with_tools
    assert "<tools>" not in _render(state, tools=TOOLS, tool_choice="none")


def test_history_with_tool_calls_and_results(state):
    prompt = _render(state, tools=TOOLS, messages=[
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}])
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
    assert "<tool_response>\nsunny\n</tool_response>" in prompt


def test_continue_final_message(state):
    prompt = _render(state, add_generation_prompt=False, continue_final_message=True, messages=[
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Once upon a"}])
    assert prompt.endswith("<|im_start|>assistant\nOnce upon a")


def test_template_errors_are_400s(state):
    with pytest.raises(APIError, match="system message must come first") as info:
        _render(state, messages=[{"role": "user", "content": "a"}, {"role": "system", "content": "b"}])
    assert info.value.status == 400 and info.value.param == "messages"


def test_serve_subcommand_is_registered():
    args = build_parser().parse_args(["serve", "--model", "/models/Qwen3-Next-80B", "--port", "9001",
                                      "--api-key", "k", "--served-model-name", "qn", "--device", "cpu"])
    assert args.func is cmd_serve and (args.port, args.api_key, args.device) == (9001, "k", "cpu")
    assert served_model_name(args) == "qn"
    args = build_parser().parse_args(["serve", "--model", "/models/Qwen3-Next-80B/"])
    assert served_model_name(args) == "Qwen3-Next-80B" and args.host == "127.0.0.1" and args.port == 8000
    assert served_model_name(build_parser().parse_args(["serve"])) == DEFAULT_SERVED_NAME
    # the startup warm-up: the device's default unless asked either way
    assert [build_parser().parse_args(["serve", *flag]).warm_up for flag in ([], ["--warm-up"], ["--no-warm-up"])] \
        == [None, True, False]


# Jinja constructs published Qwen templates rely on (namespace, reversed slices, string methods, `items`,
# `is mapping`, tojson with arguments, loop controls), to check our renderer against transformers' own.
CONSTRUCTS_TEMPLATE = r"""
{%- set ns = namespace(last_user=-1) %}
{%- for m in messages[::-1] %}{%- if ns.last_user < 0 and m.role == 'user' %}
{%- set ns.last_user = (messages|length - 1) - loop.index0 %}{%- endif %}{%- endfor %}
{%- for m in messages %}
{%- if m.role == 'skip' %}{% continue %}{% endif %}
{{- '<|im_start|>' + m.role + '\n' }}
{%- if m.content is string and m.content.startswith('<think>') %}
{{- m.content.split('</think>')[-1].lstrip('\n') }}{%- else %}{{- m.content | string }}{%- endif %}
{%- for tc in m.tool_calls or [] %}{%- set tc = tc.function if tc.function is defined else tc %}
{{- '\n<tool_call>\n<function=' + tc.name + '>' }}
{%- for k, v in tc.arguments|items %}{{- '\n<parameter=' + k + '>\n' }}
{{- (v | tojson(indent=None, ensure_ascii=False)) if v is mapping or v is sequence and v is not string else v }}
{{- '\n</parameter>' }}{%- endfor %}{{- '\n</function>\n</tool_call>' }}{%- endfor %}
{{- '<|im_end|>\n' }}{%- if loop.index0 == ns.last_user %}{{- '' }}{%- endif %}
{%- endfor %}
{%- if tools %}{{- tools | tojson(indent=2) }}{%- endif %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
"""


@pytest.mark.parametrize("template", ["test-template", CONSTRUCTS_TEMPLATE])
def test_rendering_matches_transformers(state, template):
    from transformers.utils.chat_template_utils import render_jinja_template

    template = state.tokenizer.chat_template if template == "test-template" else template
    conversation = [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "<think>\nhm\n</think>\n\nChecking.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": {"city": "Paris", "opts": {"d": [1, 2]}}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny, 20°C"}]
    for tools in (None, TOOLS):
        for kwargs in ({}, {"enable_thinking": False}):
            ours = state.tokenizer.__class__.apply_chat_template(
                _with_template(state.tokenizer, template), conversation, add_generation_prompt=True, tools=tools,
                **kwargs)
            theirs = render_jinja_template([conversation], chat_template=template, tools=tools,
                                           add_generation_prompt=True, bos_token="", eos_token="<|im_end|>",
                                           **kwargs)[0][0]
            assert ours == theirs


def _with_template(tokenizer, template: str):
    import copy

    clone = copy.copy(tokenizer)
    clone.chat_template = template
    return clone
