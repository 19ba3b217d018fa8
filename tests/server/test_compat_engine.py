"""The Anthropic Messages, Responses and tokenize routes on `deltaserve serve` itself (real LLMEngine, the
embedded model, CPU), driven with the official clients: greedy replies equal the chat endpoint's for the
same conversation, streamed equals non-streamed, and token counts agree with /tokenize."""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest

from .conftest import ServerProcess

pytest.importorskip("deltaserve.engine.llm_engine")

SERVED = "embedded"
API_KEY = "k"
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    proc = ServerProcess(["-m", "deltaserve", "serve", "--device", "cpu", "--max-model-len", "256",
                          "--cpu-cache-bytes", str(32 << 20), "--served-model-name", SERVED, "--api-key", API_KEY,
                          "--uvicorn-log-level", "warning"],
                         tmp_path_factory.mktemp("compat-engine") / "server.log").start()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def chat_reply(server):
    client = openai.OpenAI(base_url=server.url, api_key=API_KEY, max_retries=0, timeout=120)
    return client.chat.completions.create(model=SERVED, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0.0,
                                          reasoning_effort="none")


def test_anthropic_messages_match_chat(server, chat_reply):
    client = anthropic.Anthropic(base_url=server.base, api_key=API_KEY, max_retries=0, timeout=120)
    kw = dict(model=SERVED, max_tokens=MAX_TOKENS, messages=MESSAGES, thinking={"type": "disabled"},
              extra_body={"temperature": 0.0})
    msg = client.messages.create(**kw)
    text = "".join(b.text for b in msg.content if b.type == "text")
    assert text == chat_reply.choices[0].message.content
    assert msg.usage.input_tokens == chat_reply.usage.prompt_tokens
    assert msg.usage.output_tokens == chat_reply.usage.completion_tokens
    assert msg.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[chat_reply.choices[0].finish_reason]
    with client.messages.stream(**kw) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == text and final.usage.output_tokens == msg.usage.output_tokens
    count = client.messages.count_tokens(model=SERVED, messages=MESSAGES, thinking={"type": "disabled"})
    assert count.input_tokens == msg.usage.input_tokens


def test_responses_match_chat(server, chat_reply):
    client = openai.OpenAI(base_url=server.url, api_key=API_KEY, max_retries=0, timeout=120)
    kw = dict(model=SERVED, input=MESSAGES, max_output_tokens=MAX_TOKENS, temperature=0.0,
              reasoning={"effort": "none"})
    r = client.responses.create(**kw)
    assert r.output_text == chat_reply.choices[0].message.content
    assert r.usage.input_tokens == chat_reply.usage.prompt_tokens
    events = list(client.responses.create(**kw, stream=True))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == r.output_text
    assert events[-1].response.output_text == r.output_text


def test_tokenize_counts_the_chat_prompt(server, chat_reply):
    r = httpx.post(f"{server.base}/tokenize", json={"messages": MESSAGES, "reasoning_effort": "none"},
                   headers={"x-api-key": API_KEY}, timeout=60).json()
    assert r["count"] == chat_reply.usage.prompt_tokens and r["max_model_len"] == 256


def test_anthropic_stop_sequence(server, chat_reply):
    content = chat_reply.choices[0].message.content
    words = content.split()
    if len(words) < 2:
        pytest.skip(f"the greedy reply {content!r} has no second word to stop at")
    stop = words[1]
    client = anthropic.Anthropic(base_url=server.base, api_key=API_KEY, max_retries=0, timeout=120)
    msg = client.messages.create(model=SERVED, max_tokens=MAX_TOKENS, messages=MESSAGES, stop_sequences=[stop],
                                 thinking={"type": "disabled"}, extra_body={"temperature": 0.0})
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == stop
    text = "".join(b.text for b in msg.content if b.type == "text")
    assert text == content[:content.find(stop)].rstrip()
