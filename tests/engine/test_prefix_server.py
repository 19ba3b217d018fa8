"""Prefix caching through the HTTP server (real engine, tiny model with a tokenizer, in process): a second
chat turn resends the first turn's prompt and answer and reports them as cached
(`usage.prompt_tokens_details.cached_tokens`) with the cache-off answer; the Prometheus counters and
`POST /reset_prefix_cache`."""

from __future__ import annotations

import pytest
from starlette.testclient import TestClient

from deltaserve.engine.llm_engine import LLMEngine
from deltaserve.server.api_server import build_app
from deltaserve.server.state import ServerConfig


def _client(path, **kw):
    engine = LLMEngine.from_args(path, device="cpu", max_model_len=512, **kw)
    return engine, TestClient(build_app(engine, ServerConfig("tiny")))


def _chat(client, messages, **kw):
    body = {"model": "tiny", "messages": messages, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
            "logprobs": True, "top_logprobs": 2, **kw}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def _lps(body):
    return [[t["logprob"] for t in pos["top_logprobs"]] for pos in body["choices"][0]["logprobs"]["content"]]


def _recording(engine):
    """Record the token ids of every finished output (the answer the server turned into text)."""
    finals, step = [], engine.step

    def recorded():
        outs = step()
        finals.extend(o for o in outs if o.finished)
        return outs

    engine.step = recorded
    return finals


SYSTEM = {"role": "system", "content": "You are a helpful assistant who answers briefly."}
TURN1 = [SYSTEM, {"role": "user", "content": "Tell me a story about a dragon and a knight."}]


def test_second_chat_turn_hits_the_first_turns_prompt_and_answer(tiny_model_with_tokenizer):
    engine, client = _client(tiny_model_with_tokenizer)
    off_engine, off_client = _client(tiny_model_with_tokenizer, enable_prefix_caching=False)
    finals = _recording(engine)
    tok = engine.tokenizer
    with client, off_client:
        # A random model's answer is random bytes, which seldom tokenize back to the same ids; sample short
        # answers until one does, so that the second turn's prompt really extends the first turn's history.
        for seed in range(60):
            first = _chat(client, TURN1, temperature=1.0, seed=seed, max_tokens=3)
            assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == (0 if seed == 0 else first["usage"]["prompt_tokens"] - 1)
            answer = first["choices"][0]["message"]["content"]
            turn2 = TURN1 + [{"role": "assistant", "content": answer}, {"role": "user", "content": "And then?"}]
            ids2 = tok.encode(tok.apply_chat_template(turn2), add_special_tokens=False)
            history = list(finals[-1].prompt_token_ids) + finals[-1].outputs[0].token_ids
            if ids2[: len(history)] == history:
                break
        else:
            pytest.fail("no first-turn answer tokenizes back to its ids")
        second, reference = _chat(client, turn2), _chat(off_client, turn2)
        assert second["choices"][0]["message"]["content"] == reference["choices"][0]["message"]["content"]
        for a, b in zip(_lps(second), _lps(reference)):
            assert a == pytest.approx(b, abs=1e-5)
        # the first turn's prompt and answer, less the answer's last token (generated, never fed)
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == len(history) - 1
        assert reference["usage"]["prompt_tokens_details"]["cached_tokens"] == 0

        stats = engine.get_stats()
        metrics = client.get("/metrics").text
        assert f"deltaserve_prefix_cache_hits_total {float(stats.prefix_cache_hits_total)}" in metrics
        assert f"deltaserve_prefix_cache_queries_total {float(stats.prefix_cache_queries_total)}" in metrics
        assert stats.prefix_cache_hits_total >= len(history) - 1
        assert "deltaserve_prefix_cache_snapshots_used" in metrics

        assert client.post("/reset_prefix_cache").status_code == 200
        assert engine.get_stats().prefix_cache_snapshots_used == 0
        again = _chat(client, turn2)
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert off_client.post("/reset_prefix_cache").status_code == 400
        engine.cache.check_integrity()
        off_engine.cache.check_integrity()
