"""A bounded soak of `deltaserve serve` on the embedded model: 500 mixed requests at concurrency 16
(completions and chat, streamed and not, n > 1, stop strings, seeds; some streams dropped mid-way, some
requests cancelled, some invalid on purpose). Every answer is complete and well-formed, no request fails
on the server side, every KV block and state slot is free at the end, the RSS grows less than
RSS_GROWTH_LIMIT after the warm-up, and SIGTERM then ends the process with status 0."""

from __future__ import annotations

import asyncio
import json
import random
import signal
import time
from collections import Counter

import httpx
import pytest

from .conftest import ServerProcess
from .live_server import DONE, metrics, rss_bytes

pytest.importorskip("deltaserve.engine.llm_engine")

NUM_REQUESTS = 500
CONCURRENCY = 16
WARM_UP = 64                       # requests before the first RSS reading
RSS_GROWTH_LIMIT = 32 << 20        # bytes the server may grow over the remaining requests
MAX_TOKENS = 8
WORDS = ("the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven", "small", "birds",
         "sing", "about", "rain", "tomorrow", "morning", "we", "will", "read", "old", "stories", "near", "river")
KINDS = ("completion", "completion_stream", "chat", "chat_stream", "dropped_stream", "cancelled", "invalid")
WEIGHTS = (30, 25, 15, 15, 6, 5, 4)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    proc = ServerProcess(["-m", "deltaserve", "serve", "--device", "cpu", "--max-model-len", "256",
                          "--cpu-cache-bytes", str(64 << 20), "--max-num-seqs", str(CONCURRENCY),
                          # the prefix cache keeps blocks, so it touches the pool's untouched (lazy) pages over
                          # the run: RSS growth would measure that, not leaks (prefix caching has its own tests)
                          "--no-enable-prefix-caching",
                          "--uvicorn-log-level", "warning"],
                         tmp_path_factory.mktemp("soak") / "server.log").start()
    yield proc
    proc.stop()


def _request(rng: random.Random, kind: str) -> tuple[str, dict]:
    prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 40)))
    fields = {"max_tokens": rng.randint(1, MAX_TOKENS), "n": rng.choice((1, 1, 2, 3))}
    if rng.random() < 0.5:
        fields.update(temperature=0.8, seed=rng.randint(0, 1 << 20))
    else:
        fields.update(temperature=0.0)
    if rng.random() < 0.2:
        fields["stop"] = [rng.choice(WORDS)]
    if kind.startswith("chat"):
        return "/chat/completions", {"messages": [{"role": "user", "content": prompt}], **fields}
    if kind == "invalid":
        return "/completions", {"prompt": prompt, **fields, "max_tokens": -rng.randint(1, 5)}
    return "/completions", {"prompt": prompt, **fields}


def _check_final(body: dict, n: int, max_tokens: int, chat: bool) -> None:
    assert len(body["choices"]) == n, body
    for choice in body["choices"]:
        assert choice["finish_reason"] in ("stop", "length"), body
        text = choice["message"]["content"] if chat else choice["text"]
        assert isinstance(text, str)
    assert 0 <= body["usage"]["completion_tokens"] <= n * max_tokens, body


async def _stream(client: httpx.AsyncClient, path: str, payload: dict, drop: bool) -> str:
    chat = path.startswith("/chat")
    payload = {**payload, "stream": True, "stream_options": {"include_usage": True}}
    finished: set[int] = set()
    async with client.stream("POST", path, json=payload) as r:
        assert r.status_code == 200, await r.aread()
        events = []
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == DONE:
                events.append(DONE)
                break
            event = json.loads(data)
            assert "error" not in event, event
            events.append(event)
            if drop:
                return "dropped"   # leaving the block closes the connection mid-stream
            for choice in event["choices"]:
                if choice["finish_reason"] is not None:
                    assert choice["finish_reason"] in ("stop", "length"), event
                    finished.add(choice["index"])
    assert events[-1] == DONE
    assert finished == set(range(payload["n"])), events
    usage = events[-2]["usage"]
    assert 0 <= usage["completion_tokens"] <= payload["n"] * payload["max_tokens"]
    return "chat_stream" if chat else "completion_stream"


async def _one(client: httpx.AsyncClient, rng: random.Random, kind: str) -> str:
    path, payload = _request(rng, kind)
    if kind in ("completion_stream", "chat_stream", "dropped_stream"):
        return await _stream(client, path, payload, drop=kind == "dropped_stream")
    if kind == "cancelled":
        payload["max_tokens"] = 64
        try:
            await asyncio.wait_for(client.post(path, json=payload), timeout=rng.uniform(0.01, 0.2))
        except asyncio.TimeoutError:
            return "cancelled"
        return "cancelled (finished first)"
    r = await client.post(path, json=payload)
    if kind == "invalid":
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
        return kind
    assert r.status_code == 200, r.text
    _check_final(r.json(), payload["n"], payload["max_tokens"], chat=kind == "chat")
    return kind


async def _run(server: ServerProcess, kinds: list[str], seed: int) -> Counter:
    rng = random.Random(seed)
    sem = asyncio.Semaphore(CONCURRENCY)
    limits = httpx.Limits(max_connections=CONCURRENCY * 2)

    async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as client:
        async def guarded(kind: str, r: random.Random) -> str:
            async with sem:
                return await _one(client, r, kind)

        results = await asyncio.gather(*[guarded(k, random.Random(rng.random())) for k in kinds])
    return Counter(results)


def _wait_idle(server: ServerProcess, timeout: float = 30.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(server.base)
        idle = m["deltaserve_num_requests_running"] == 0 and m["deltaserve_num_requests_waiting"] == 0
        if idle or time.monotonic() > deadline:
            return m
        time.sleep(0.2)


def test_soak_mixed_requests_leave_nothing_behind(server):
    rng = random.Random(0)
    kinds = rng.choices(KINDS, weights=WEIGHTS, k=NUM_REQUESTS)
    t0 = time.monotonic()
    first = asyncio.run(_run(server, kinds[:WARM_UP], seed=1))
    _wait_idle(server)
    rss_before = rss_bytes(server.proc.pid)
    rest = asyncio.run(_run(server, kinds[WARM_UP:], seed=2))
    elapsed = time.monotonic() - t0
    m = _wait_idle(server)
    rss_after = rss_bytes(server.proc.pid)
    done = first + rest

    assert sum(done.values()) == NUM_REQUESTS
    assert done["dropped"] > 0 and done["cancelled"] > 0 and done["invalid"] > 0, done
    assert m["deltaserve_num_requests_running"] == 0 and m["deltaserve_num_requests_waiting"] == 0, m
    assert m["deltaserve_kv_blocks_used"] == 0 and m["deltaserve_state_slots_used"] == 0, m
    assert m["deltaserve_requests_total{outcome=error}"] == 0, m
    assert m["deltaserve_requests_total{outcome=rejected}"] == done["invalid"], m
    growth = rss_after - rss_before
    print(f"\nsoak: {NUM_REQUESTS} requests in {elapsed:.1f} s ({dict(done)}); RSS {rss_before / 2**20:.0f} -> "
          f"{rss_after / 2**20:.0f} MiB")
    assert growth < RSS_GROWTH_LIMIT, f"RSS grew {growth / 2**20:.1f} MiB"

    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(60) == 0, server.log()
