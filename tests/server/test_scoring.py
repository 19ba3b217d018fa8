"""Scoring on the real server (tiny random Qwen3-Next, CPU): the request lm-evaluation-harness's
`local-completions` model sends for loglikelihood, OpenAI's legacy `echo` + `max_tokens: 0` + `logprobs`,
and vLLM's `prompt_logprobs`, each compared with `LLM.generate`'s prompt logprobs."""

from __future__ import annotations

import math
from operator import itemgetter

import httpx
import openai
import pytest

from .conftest import start_tiny_server

pytest.importorskip("deltaserve.engine.llm_engine")

MAX_MODEL_LEN = 256
TOL = 1e-4          # same weights, same fp32 CPU ops; only the batch packing differs


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    proc = start_tiny_server(tiny_model_dir, tmp_path_factory.mktemp("scoring-server"), max_model_len=MAX_MODEL_LEN)
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    from deltaserve import LLM

    return LLM(str(tiny_model_dir), device="cpu", max_model_len=MAX_MODEL_LEN, enable_prefix_caching=False)


def reference_prompt_logprobs(llm, token_lists: list[list[int]], top: int = 1):
    """Per prompt: the logprob of every prompt token after the first, from LLM.generate."""
    from deltaserve import SamplingParams

    outs = llm.generate([{"prompt_token_ids": t} for t in token_lists],
                        SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=top), use_tqdm=False)
    result = []
    for toks, out in zip(token_lists, outs):
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(toks)
        result.append([pos[t].logprob for t, pos in zip(toks[1:], out.prompt_logprobs[1:])])
    return result


def lm_eval_parse_logprobs(out: dict, ctxlens: list[int]) -> list[tuple[float, bool]]:
    """lm_eval 0.4.13 `LocalCompletionsAPI.parse_logprobs` (lm_eval/models/openai_completions.py), verbatim
    in behaviour: the continuation's summed logprobs and whether each of its tokens was the greedy one."""
    res = []
    for choice, ctxlen in zip(sorted(out["choices"], key=itemgetter("index")), ctxlens):
        assert ctxlen > 0
        logprobs = sum(choice["logprobs"]["token_logprobs"][ctxlen:-1])
        tokens_logprobs = choice["logprobs"]["token_logprobs"][ctxlen:-1]
        top_logprobs = choice["logprobs"]["top_logprobs"][ctxlen:-1]
        is_greedy = all(tok == max(top.values()) for tok, top in zip(tokens_logprobs, top_logprobs))
        res.append((logprobs, is_greedy))
    return res


def test_lm_eval_local_completions_loglikelihood_request(server, llm):
    """The payload of lm_eval 0.4.13 `LocalCompletionsAPI._create_payload(generate=False)` with
    tokenized requests (the default): a batch of context + continuation token lists."""
    requests = [([5, 17, 33, 2, 90], [41, 7]), ([100, 3], [9, 9, 12]), ([61, 62, 63, 64, 65, 66], [1])]
    prompts = [ctx + cont for ctx, cont in requests]
    payload = {"model": "tiny", "prompt": prompts, "temperature": 0, "max_tokens": 1, "logprobs": 1,
               "seed": 1234, "echo": True}
    r = httpx.post(f"{server.url}/completions", json=payload, timeout=120)
    assert r.status_code == 200, r.text
    body = r.json()
    for choice, prompt in zip(sorted(body["choices"], key=itemgetter("index")), prompts):
        lp = choice["logprobs"]
        assert len(lp["token_logprobs"]) == len(prompt) + 1        # the prompt, then the one generated token
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    got = lm_eval_parse_logprobs(body, [len(ctx) for ctx, _ in requests])
    ref = reference_prompt_logprobs(llm, prompts)
    for (ctx, cont), (total, greedy), lps in zip(requests, got, ref):
        cont_lps = lps[len(ctx) - 1:]                              # logprobs of the continuation's tokens
        assert math.isclose(total, sum(cont_lps), abs_tol=TOL)
        assert isinstance(greedy, bool)


def test_openai_echo_max_tokens_0_returns_prompt_logprobs_only(client, llm):
    prompt = "The quick brown fox"
    tokens = llm.tokenizer.encode(prompt)
    out = client.completions.create(model="tiny", prompt=prompt, echo=True, max_tokens=0, logprobs=2)
    choice = out.choices[0]
    assert choice.text == prompt and choice.finish_reason == "length"
    assert out.usage.completion_tokens == 0 and out.usage.prompt_tokens == len(tokens)
    lp = choice.logprobs
    assert len(lp.tokens) == len(tokens) and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    ref = reference_prompt_logprobs(llm, [tokens], top=2)[0]
    assert all(math.isclose(a, b, abs_tol=TOL) for a, b in zip(lp.token_logprobs[1:], ref))
    assert all(1 <= len(top) <= 3 for top in lp.top_logprobs[1:])   # top-2 plus the prompt token
    assert "".join(lp.tokens) == prompt


def test_echo_max_tokens_0_token_batch_and_stream(server, client, llm):
    prompts = [[5, 6, 7, 8], [90, 91]]
    out = client.completions.create(model="tiny", prompt=prompts, echo=True, max_tokens=0, logprobs=0)
    ref = reference_prompt_logprobs(llm, prompts, top=0)
    for choice, r in zip(sorted(out.choices, key=lambda c: c.index), ref):
        assert all(math.isclose(a, b, abs_tol=TOL) for a, b in zip(choice.logprobs.token_logprobs[1:], r))
    chunks = list(client.completions.create(model="tiny", prompt=prompts[0], echo=True, max_tokens=0, logprobs=0,
                                            stream=True))
    lps = [x for c in chunks for ch in c.choices if ch.logprobs for x in ch.logprobs.token_logprobs]
    assert lps[0] is None and all(math.isclose(a, b, abs_tol=TOL) for a, b in zip(lps[1:], ref[0]))
    assert chunks[-1].choices[0].finish_reason == "length"
    # echo without logprobs: the prompt text back, nothing generated
    plain = client.completions.create(model="tiny", prompt="Hello there", echo=True, max_tokens=0)
    assert plain.choices[0].text == "Hello there" and plain.choices[0].logprobs is None
    assert plain.usage.completion_tokens == 0


def test_prompt_logprobs_field_on_completions_and_chat(server, llm):
    tokens = [11, 22, 33, 44, 55]
    r = httpx.post(f"{server.url}/completions", json={"model": "tiny", "prompt": tokens, "max_tokens": 2,
                                                       "temperature": 0, "prompt_logprobs": 1}, timeout=120)
    assert r.status_code == 200, r.text
    plp = r.json()["choices"][0]["prompt_logprobs"]
    ref = reference_prompt_logprobs(llm, [tokens])[0]
    assert plp[0] is None and len(plp) == len(tokens)
    for t, pos, want in zip(tokens[1:], plp[1:], ref):
        assert math.isclose(pos[str(t)]["logprob"], want, abs_tol=TOL) and pos[str(t)]["rank"] >= 1
    # scoring without echo: max_tokens 0 with prompt_logprobs
    r = httpx.post(f"{server.url}/completions", json={"model": "tiny", "prompt": tokens, "max_tokens": 0,
                                                       "prompt_logprobs": 0}, timeout=120)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == ""
    r = httpx.post(f"{server.url}/chat/completions", json={
        "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "prompt_logprobs": 0},
        timeout=120)
    assert r.status_code == 200, r.text
    chat_plp = r.json()["prompt_logprobs"]
    assert chat_plp[0] is None and len(chat_plp) == r.json()["usage"]["prompt_tokens"]


@pytest.mark.parametrize("body, param", [
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),                       # nothing to return (vLLM: 400)
    ({"prompt": "x", "max_tokens": -1}, "max_tokens"),
    ({"prompt": "x", "prompt_logprobs": -1}, "prompt_logprobs"),
    ({"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt": "x", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ({"prompt": "x", "echo": True, "logprobs": 1, "prompt_logprobs": 2}, "prompt_logprobs"),
    ({"prompt": "x", "prompt_logprobs": "1"}, "prompt_logprobs"),
])
def test_bad_scoring_values_are_400_naming_the_field(server, body, param):
    r = httpx.post(f"{server.url}/completions", json={"model": "tiny", **body}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_chat_max_tokens_0_without_prompt_logprobs_is_400(server):
    r = httpx.post(f"{server.url}/chat/completions", json={
        "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def test_priority_on_an_fcfs_server_is_400_like_vllm(server):
    """This server runs the default policy (fcfs): a non-zero priority is refused by name; 0 is fine."""
    for path, extra in (("completions", {"prompt": "x"}), ("chat/completions",
                                                           {"messages": [{"role": "user", "content": "x"}]})):
        r = httpx.post(f"{server.url}/{path}", json={"model": "tiny", "max_tokens": 1, "priority": 2, **extra},
                       timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "priority", r.text
        assert "scheduling_policy" in r.json()["error"]["message"]
        r = httpx.post(f"{server.url}/{path}", json={"model": "tiny", "max_tokens": 1, "priority": 0, **extra},
                       timeout=60)
        assert r.status_code == 200
