"""Request schemas: every SamplingParams field is reachable under its OpenAI (or vLLM) name, and what is
not supported is refused by name."""

from __future__ import annotations

import dataclasses
import json

import pytest

from deltaserve.sampling_params import SamplingParams
from deltaserve.server.protocol import (APIError, ChatCompletionRequest, CompletionRequest, RequestLimits,
                                        parse_request, to_sampling_params)

ALL_FIELDS = {
    "n": 3, "temperature": 0.7, "top_p": 0.9, "top_k": 5, "min_p": 0.05, "seed": 11, "stop": ["END", "##"],
    "presence_penalty": 0.5, "frequency_penalty": -0.5, "repetition_penalty": 1.2, "ignore_eos": True,
    "min_tokens": 2, "stop_token_ids": [7, 9], "include_stop_str_in_output": True, "skip_special_tokens": False,
}


def _request(cls, **fields):
    base = {"prompt": "hi"} if cls is CompletionRequest else {"messages": [{"role": "user", "content": "hi"}]}
    return parse_request(cls, json.dumps({**base, **fields}).encode())


def test_completion_fields_map_to_sampling_params():
    req = _request(CompletionRequest, **ALL_FIELDS, max_tokens=40, logprobs=4)
    req.check(RequestLimits())
    params = to_sampling_params(req, max_tokens=req.max_tokens, logprobs=req.logprobs)
    expected = SamplingParams(**ALL_FIELDS, max_tokens=40, logprobs=4)
    assert dataclasses.asdict(params) == dataclasses.asdict(expected)


def test_chat_fields_map_to_sampling_params():
    req = _request(ChatCompletionRequest, **ALL_FIELDS, max_completion_tokens=33, logprobs=True, top_logprobs=2)
    req.check(RequestLimits())
    assert req.max_output_tokens == 33
    params = to_sampling_params(req, max_tokens=req.max_output_tokens, logprobs=req.top_logprobs)
    assert dataclasses.asdict(params) == dataclasses.asdict(SamplingParams(**ALL_FIELDS, max_tokens=33, logprobs=2))


def test_defaults_follow_openai():
    completion = _request(CompletionRequest)
    assert completion.max_tokens == 16 and completion.n == 1 and not completion.stream
    chat = _request(ChatCompletionRequest)
    assert chat.max_output_tokens is None  # up to the context
    params = to_sampling_params(chat, max_tokens=None)
    assert params.temperature == SamplingParams().temperature and params.top_k == 0


def test_noop_values_of_unimplemented_fields_are_accepted():
    req = _request(CompletionRequest, user="u1", best_of=1, logit_bias={}, suffix=None)
    req.check(RequestLimits())
    chat = _request(ChatCompletionRequest, user="u1", parallel_tool_calls=True, response_format={"type": "text"},
                    tool_choice="none")
    chat.check(RequestLimits())


def test_template_messages_join_text_parts_and_parse_arguments():
    req = _request(ChatCompletionRequest, messages=[
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None, "reasoning_content": "r", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]},
        {"role": "tool", "content": "42", "tool_call_id": "c1"}])
    msgs = req.template_messages()
    assert msgs[0] == {"role": "user", "content": "a\nb"}
    assert msgs[1]["tool_calls"][0]["function"] == {"name": "f", "arguments": {"x": 1}}
    assert msgs[1]["reasoning_content"] == "r" and msgs[2]["tool_call_id"] == "c1"


@pytest.mark.parametrize("body,param", [
    (b'{"prompt": "x", "n": true}', "n"),
    (b'{"prompt": "x", "max_tokens": 1.5}', "max_tokens"),
    (b'{"prompt": "x", "stream_options": {"include_usage": true, "extra": 1}}', "stream_options.extra"),
    (b'{"prompt": "x", "functions": []}', "functions"),
])
def test_parse_errors_name_the_field(body, param):
    with pytest.raises(APIError) as info:
        parse_request(CompletionRequest, body)
    assert info.value.param == param and info.value.status == 400
