"""best_of, truncate_prompt_tokens and priority on the real server (tiny random Qwen3-Next, CPU, started with
--scheduling-policy priority), checked against LLM.generate; bad values are 400s naming the field."""

from __future__ import annotations

import httpx
import openai
import pytest

from .conftest import start_tiny_server

pytest.importorskip("deltaserve.engine.llm_engine")

MAX_MODEL_LEN = 256


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    proc = start_tiny_server(tiny_model_dir, tmp_path_factory.mktemp("extras-server"),
                             "--scheduling-policy", "priority", max_model_len=MAX_MODEL_LEN)
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    from deltaserve import LLM

    return LLM(str(tiny_model_dir), device="cpu", max_model_len=MAX_MODEL_LEN)


def test_best_of_returns_the_n_likeliest_candidates_and_bills_all(client, llm):
    from deltaserve import SamplingParams

    prompt = "Tell me a story"
    out = client.completions.create(model="tiny", prompt=prompt, n=2, best_of=5, seed=7, max_tokens=6,
                                    temperature=1.0, extra_body={"ignore_eos": True})
    ref = llm.generate(prompt, SamplingParams(n=5, seed=7, max_tokens=6, temperature=1.0, ignore_eos=True,
                                              logprobs=0), use_tqdm=False)[0]
    ranked = sorted(ref.outputs, key=lambda c: -sum(p[t].logprob for t, p in zip(c.token_ids, c.logprobs)))
    assert [c.index for c in out.choices] == [0, 1]
    assert [c.text for c in out.choices] == [c.text for c in ranked[:2]]
    assert all(c.logprobs is None for c in out.choices)              # not asked for: not shown
    assert out.usage.completion_tokens == 5 * 6                       # every candidate is billed


def test_best_of_equal_to_n_is_plain_sampling(client):
    out = client.completions.create(model="tiny", prompt="Hello", n=2, best_of=2, seed=3, max_tokens=3)
    assert len(out.choices) == 2


def test_truncate_prompt_tokens_keeps_the_last_tokens(server, llm):
    from deltaserve import SamplingParams

    tokens = [5, 17, 33, 2, 90, 41, 7, 100, 3, 9]
    r = httpx.post(f"{server.url}/completions", json={
        "model": "tiny", "prompt": tokens, "truncate_prompt_tokens": 4, "max_tokens": 5, "temperature": 0,
        "echo": True}, timeout=120)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["prompt_tokens"] == 4
    want = llm.generate({"prompt_token_ids": tokens[-4:]}, SamplingParams(temperature=0, max_tokens=5),
                        use_tqdm=False)[0]
    assert body["choices"][0]["text"] == llm.tokenizer.decode(tokens[-4:], skip_special_tokens=False) + \
        want.outputs[0].text
    # -1 = the context length: a short prompt is unchanged; the engine applies it too (LLM.generate)
    r = httpx.post(f"{server.url}/completions", json={"model": "tiny", "prompt": tokens, "max_tokens": 1,
                                                       "truncate_prompt_tokens": -1}, timeout=120)
    assert r.json()["usage"]["prompt_tokens"] == len(tokens)
    cut = llm.generate({"prompt_token_ids": tokens}, SamplingParams(temperature=0, max_tokens=5,
                                                                    truncate_prompt_tokens=4), use_tqdm=False)[0]
    assert cut.prompt_token_ids == tokens[-4:] and cut.outputs[0].token_ids == want.outputs[0].token_ids


def test_priority_is_accepted_with_the_priority_policy(server):
    for prio in (-5, 0, 9):
        r = httpx.post(f"{server.url}/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 2,
                                                           "priority": prio}, timeout=120)
        assert r.status_code == 200, r.text
    r = httpx.post(f"{server.url}/chat/completions", json={
        "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "priority": 1},
        timeout=120)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("body, param", [
    ({"n": 3, "best_of": 2}, "best_of"),
    ({"best_of": 0}, "best_of"),
    ({"best_of": 200}, "best_of"),
    ({"best_of": 3, "stream": True}, "best_of"),
    ({"best_of": 3, "temperature": 0}, "best_of"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
    ({"truncate_prompt_tokens": MAX_MODEL_LEN + 1}, "truncate_prompt_tokens"),
    ({"truncate_prompt_tokens": "4"}, "truncate_prompt_tokens"),
    ({"priority": 1.5}, "priority"),
    ({"priority": "high"}, "priority"),
])
def test_bad_extras_are_400_naming_the_field(server, body, param):
    r = httpx.post(f"{server.url}/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2, **body},
                   timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
