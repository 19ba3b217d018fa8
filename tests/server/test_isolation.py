"""One request cannot stall the others: a 10 MB prompt posted beside a stream (the real engine on the embedded
model) adds less than 100 ms to that stream's inter-token gaps, both when the prompt-character limit refuses
it before tokenizing (the default) and when the limit is raised so that it is tokenized in the worker pool.

The bound is on what the big prompt adds to the largest gap of the same stream without it: on a quiet
machine a decode step of the embedded model takes ~15 ms, so the gaps stay under 100 ms; on a machine
shared with other jobs a step alone can take longer. Tokenizing on the event loop (or holding the GIL
while tokenizing) stalled streams for seconds.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time

import httpx
import pytest

from .conftest import ServerProcess

pytest.importorskip("deltaserve.engine.llm_engine")

BIG_PROMPT = ("The quick brown fox jumps over the lazy dog. " * 230_000)[:10_000_000]
BIG_BODY = json.dumps({"prompt": BIG_PROMPT, "max_tokens": 4}).encode()   # encoded once, not in the client's loop
MAX_ADDED_GAP_S = 0.1
STREAM_TOKENS = 48


def _server(tmp_path_factory, name: str, *extra: str) -> ServerProcess:
    return ServerProcess(["-m", "deltaserve", "serve", "--device", "cpu", "--compile", "off", "--max-model-len", "512",
                          "--uvicorn-log-level", "warning", *extra],
                         tmp_path_factory.mktemp(name) / "server.log").start()


@pytest.fixture(scope="module")
def default_server(tmp_path_factory):
    proc = _server(tmp_path_factory, "isolation-default")
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def pool_server(tmp_path_factory):
    proc = _server(tmp_path_factory, "isolation-pool", "--max-prompt-chars", "20000000",
                   "--max-request-bytes", str(32 * 2**20))
    yield proc
    proc.stop()


async def _stream_gaps(client: httpx.AsyncClient, started: asyncio.Event | None = None) -> list[float]:
    """Inter-token gaps of one greedy stream (from its second token on: the first includes the prefill)."""
    body = {"prompt": "Once upon a time", "max_tokens": STREAM_TOKENS, "ignore_eos": True, "temperature": 0,
            "stream": True}
    times = []
    async with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                times.append(time.perf_counter())
    assert len(times) >= STREAM_TOKENS
    return [b - a for a, b in itertools.pairwise(times[1:])]


async def _big_beside_stream(base: str, *, wait_for_big: bool):
    """Warm the stream path, then post the 10 MB prompt and stream beside it; returns (the big request's
    response or None if it was still running when the stream ended, the stream's gaps, the warm gaps)."""
    async with httpx.AsyncClient(base_url=base, timeout=120) as client:
        warm = await _stream_gaps(client)
        big = asyncio.ensure_future(client.post("/v1/completions", content=BIG_BODY,
                                                headers={"Content-Type": "application/json"}))
        await asyncio.sleep(0.5)                      # the upload is in and being handled
        still_running = not big.done()
        gaps = await _stream_gaps(client)
        health = await client.get("/health", timeout=5)
        assert health.status_code == 200
        if wait_for_big or big.done():
            return await big, gaps, warm, still_running
        big.cancel()
        return None, gaps, warm, still_running


def _assert_not_stalled(gaps: list[float], warm: list[float]) -> None:
    added = max(gaps) - max(warm)
    assert added < MAX_ADDED_GAP_S, (f"the 10 MB prompt added {added * 1e3:.0f} ms to the largest gap "
                                     f"({max(gaps) * 1e3:.0f} ms beside it, {max(warm) * 1e3:.0f} ms without)")


def test_ten_megabyte_prompt_is_refused_before_tokenizing_and_streams_keep_flowing(default_server):
    response, gaps, warm, _ = asyncio.run(_big_beside_stream(default_server.base, wait_for_big=True))
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "prompt_too_long"
    _assert_not_stalled(gaps, warm)


def test_ten_megabyte_prompt_tokenized_in_the_pool_does_not_stall_a_stream(pool_server):
    """With the limit raised the prompt is tokenized (in the pool: it takes seconds on this CPU) while the
    stream runs; it ends refused for the context length, without its ids ever being built."""
    response, gaps, warm, still_running = asyncio.run(_big_beside_stream(pool_server.base, wait_for_big=False))
    assert still_running, "the 10 MB prompt was handled before the stream started: nothing was measured"
    if response is not None:
        assert response.status_code == 400 and response.json()["error"]["code"] == "context_length_exceeded"
    _assert_not_stalled(gaps, warm)
