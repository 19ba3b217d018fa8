"""`deltaserve serve` itself (real LLMEngine, tiny random Qwen3-Next on CPU) in a subprocess, driven with
the official `openai` client: completions and chat, streamed and not, 32 concurrent greedy requests ==
offline LLM.generate, logprobs, stop strings, context limits, a disconnect freeing its blocks and slot,
and the Prometheus endpoint."""

from __future__ import annotations

import asyncio
import sys
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from .conftest import start_tiny_server

pytest.importorskip("deltaserve.engine.llm_engine")

MAX_MODEL_LEN = 256
PROMPTS = [f"{w} {i}" for i, w in enumerate(
    ("The quick brown fox", "Tell me a story", "What is the weather", "Hello! How can I help",
     "Numbers 1 2 3", "The answer is", "a dragon and a knight", "sunny and warm") * 4)]


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    proc = start_tiny_server(tiny_model_dir, tmp_path_factory.mktemp("engine-server"), max_model_len=MAX_MODEL_LEN)
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    from deltaserve import LLM

    return LLM(str(tiny_model_dir), device="cpu", max_model_len=MAX_MODEL_LEN)


def _generate(llm, prompts, params):
    """LLM.generate on one thread, like the server process (OMP_NUM_THREADS=1): the tiny model gains
    nothing from two, and OpenMP spin-waiting on a busy 2-core machine can make it many times slower."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return llm.generate(prompts, params, use_tqdm=False)
    finally:
        torch.set_num_threads(threads)


def _metrics(server) -> dict[str, float]:
    out = {}
    for family in text_string_to_metric_families(httpx.get(f"{server.base}/metrics").text):
        for s in family.samples:
            label = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[s.name + (f"{{{label}}}" if label else "")] = s.value
    return out


def test_concurrent_greedy_requests_match_llm_generate(server, llm):
    from deltaserve import SamplingParams

    expected = [o.outputs[0].text for o in _generate(llm, PROMPTS, SamplingParams(temperature=0, max_tokens=8))]

    async def main():
        aclient = openai.AsyncOpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=120)
        rs = await asyncio.gather(*[aclient.completions.create(model="tiny", prompt=p, max_tokens=8, temperature=0)
                                    for p in PROMPTS])
        await aclient.close()
        return [r.choices[0].text for r in rs]

    assert len(PROMPTS) == 32
    assert asyncio.run(main()) == expected


def test_completion_stream_equals_non_stream(client):
    kw = dict(model="tiny", prompt="Tell me a story", max_tokens=12, temperature=0, logprobs=1,
              extra_body={"ignore_eos": True})
    full = client.completions.create(**kw)
    text, tokens, finish = "", [], None
    for chunk in client.completions.create(**kw, stream=True):
        text += chunk.choices[0].text
        tokens += chunk.choices[0].logprobs.tokens
        finish = chunk.choices[0].finish_reason or finish
    assert text == full.choices[0].text and finish == full.choices[0].finish_reason == "length"
    assert tokens == full.choices[0].logprobs.tokens and len(tokens) == 12


def test_logprobs_and_echo_match_llm(client, llm):
    from deltaserve import SamplingParams

    ref = _generate(llm, ["Hello there"], SamplingParams(temperature=0, max_tokens=4, logprobs=3,
                                                         prompt_logprobs=3))[0]
    r = client.completions.create(model="tiny", prompt="Hello there", max_tokens=4, temperature=0, logprobs=3,
                                  echo=True).choices[0]
    n_prompt = len(ref.prompt_token_ids)
    assert r.text == "Hello there" + ref.outputs[0].text
    assert r.logprobs.token_logprobs[0] is None  # the first prompt token has no logprob
    got = r.logprobs.token_logprobs[1:]
    want = [ref.prompt_logprobs[i][t].logprob for i, t in enumerate(ref.prompt_token_ids) if i > 0]
    want += [lp[t].logprob for lp, t in zip(ref.outputs[0].logprobs, ref.outputs[0].token_ids)]
    assert len(got) == n_prompt - 1 + 4
    assert got == pytest.approx(want, abs=1e-4)
    for chosen, top in zip(r.logprobs.token_logprobs[n_prompt:], r.logprobs.top_logprobs[n_prompt:]):
        assert max(top.values()) >= chosen - 1e-6  # (token texts may collide as keys: byte-level pieces)


def test_chat_stream_equals_non_stream(client):
    kw = dict(model="tiny", messages=[{"role": "user", "content": "What is the weather?"}], max_tokens=10,
              temperature=0)
    full = client.chat.completions.create(**kw).choices[0]
    reasoning, content = "", ""
    for chunk in client.chat.completions.create(**kw, stream=True):
        if chunk.choices:
            delta = chunk.choices[0].delta
            reasoning += getattr(delta, "reasoning_content", None) or ""
            content += delta.content or ""
    assert (reasoning or None, content) == (full.message.reasoning_content, full.message.content)
    assert full.finish_reason == "length"


def test_stop_string_and_n_with_seed(client):
    base = client.completions.create(model="tiny", prompt="The quick brown fox", max_tokens=12, temperature=0)
    text = base.choices[0].text
    stop = text[4:7]
    assert stop.strip(), "pick a visible stop string"
    cut = client.completions.create(model="tiny", prompt="The quick brown fox", max_tokens=12, temperature=0,
                                    stop=[stop]).choices[0]
    assert cut.text == text[: text.index(stop)] and cut.finish_reason == "stop"
    kw = dict(model="tiny", prompt="Tell me a story", max_tokens=8, temperature=1.0, seed=5, n=2)
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # seeded: reproducible


def test_context_limit_is_a_400(client):
    with pytest.raises(openai.BadRequestError, match="context"):
        client.completions.create(model="tiny", prompt=list(range(5, 5 + MAX_MODEL_LEN)), max_tokens=1)
    with pytest.raises(openai.BadRequestError, match="context"):
        client.completions.create(model="tiny", prompt="hello", max_tokens=MAX_MODEL_LEN)


def test_stop_token_ids_outside_the_vocabulary_are_refused(client, llm):
    from deltaserve import SamplingParams

    vocab = llm.engine.model_config.vocab_size
    with pytest.raises(openai.BadRequestError, match=f"token id {vocab} is outside the vocabulary") as exc:
        client.completions.create(model="tiny", prompt="hello", max_tokens=1, extra_body={"stop_token_ids": [vocab]})
    assert exc.value.body["param"] == "stop_token_ids"
    with pytest.raises(ValueError, match=f"stop_token_ids: token id {vocab} is outside"):   # offline too
        llm.generate(["hello"], SamplingParams(max_tokens=1, stop_token_ids=[1, vocab]), use_tqdm=False)
    ok = client.completions.create(model="tiny", prompt="hello", max_tokens=1,
                                   extra_body={"stop_token_ids": [vocab - 1]})
    assert ok.choices[0].finish_reason in ("stop", "length")


def test_disconnect_frees_blocks_and_slot(client, server):
    before = _metrics(server)
    stream = client.completions.create(model="tiny", prompt="Numbers 1 2 3", max_tokens=200, temperature=0,
                                       extra_body={"ignore_eos": True}, stream=True)
    for i, _ in enumerate(stream):
        if i == 2:
            assert _metrics(server)["deltaserve_kv_blocks_used"] > 0
            break
    stream.close()
    deadline = time.monotonic() + 30
    while True:
        m = _metrics(server)
        if m["deltaserve_kv_blocks_used"] == 0 and m["deltaserve_state_slots_used"] == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert m["deltaserve_num_requests_running"] == 0
    assert m["deltaserve_kv_blocks_used"] == 0 and m["deltaserve_state_slots_used"] == 0
    assert m["deltaserve_requests_total{outcome=abort}"] == before["deltaserve_requests_total{outcome=abort}"] + 1
    assert m["deltaserve_generation_tokens_total"] - before["deltaserve_generation_tokens_total"] < 200


def test_metrics_and_models(client, server):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    m = _metrics(server)
    assert m["deltaserve_prompt_tokens_total"] > 0 and m["deltaserve_generation_tokens_total"] > 0
    assert m["deltaserve_time_to_first_token_seconds_count"] > 0
    assert m["deltaserve_inter_token_latency_seconds_count"] > 0
    assert m["deltaserve_kv_blocks_total"] > 0 and m["deltaserve_state_slots_total"] > 0
    assert m["deltaserve_requests_total{outcome=length}"] > 0


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
