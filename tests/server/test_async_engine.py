"""AsyncEngine (the engine thread <-> asyncio bridge) in-process, on the scripted engine."""

from __future__ import annotations

import asyncio
import time

import pytest

from deltaserve.sampling_params import SamplingParams
from deltaserve.server.async_engine import AsyncEngine, EngineDeadError
from deltaserve.server.metrics import ServerMetrics

from .fake_engine import ScriptedEngine


@pytest.fixture
def engine(tokenizer_dir):
    return ScriptedEngine(str(tokenizer_dir))


def _ids(engine, text: str) -> list[int]:
    return engine.tokenizer.encode(text)


async def _drain(group) -> list:
    outs = [out async for out in group]
    group.close()
    return outs


def test_concurrent_groups_get_their_own_outputs(engine):
    async def main():
        a = AsyncEngine(engine, ServerMetrics(engine.get_stats))
        a.start()
        try:
            g1, g2 = a.open_group(), a.open_group()
            g1.add("r1", _ids(engine, "[[script:think]]"), SamplingParams(max_tokens=None))
            g2.add("r2a", _ids(engine, "[[script:plain]] [[chunk:1]]"), SamplingParams(max_tokens=None))
            g2.add("r2b", _ids(engine, "[[script:plain]] [[chunk:5]]"), SamplingParams(max_tokens=None, n=2))
            o1, o2 = await asyncio.gather(_drain(g1), _drain(g2))
        finally:
            a.shutdown()
        return o1, o2

    o1, o2 = asyncio.run(main())
    assert {o.request_id for o in o1} == {"r1"} and {o.request_id for o in o2} == {"r2a", "r2b"}
    finals = {o.request_id: o for o in o1 + o2 if o.finished}
    assert finals["r1"].outputs[0].text.endswith("The answer is 4.")
    assert [c.text for c in finals["r2b"].outputs] == ["The answer is 4."] * 2
    texts = [o.outputs[0].text for o in o2 if o.request_id == "r2a"]
    assert texts == [texts[-1][:i] for i in range(1, len(texts[-1]) + 1)]  # every step, in order


def test_close_before_finish_aborts_and_frees(engine):
    metrics = ServerMetrics(engine.get_stats)

    async def main():
        a = AsyncEngine(engine, metrics)
        a.start()
        try:
            g = a.open_group()
            g.add("long", _ids(engine, "[[forever]]"), SamplingParams(max_tokens=None))
            async for _ in g:
                break
            assert engine.get_stats().num_running == 1
            g.close()
            assert engine.get_stats().num_running == 0  # aborted synchronously, not at the next step
            assert g.aborted
        finally:
            a.shutdown()

    asyncio.run(main())
    assert metrics.requests.labels(outcome="abort")._value.get() == 1


def test_engine_thread_sleeps_when_idle(engine):
    async def main():
        a = AsyncEngine(engine)
        a.start()
        try:
            await asyncio.sleep(0.2)
            assert engine.step_calls == 0
            g = a.open_group()
            g.add("r", _ids(engine, "hi"), SamplingParams(max_tokens=None))
            await _drain(g)
            calls = engine.step_calls
            await asyncio.sleep(0.3)
            assert engine.step_calls == calls  # no stepping (and no busy spinning) without work
        finally:
            a.shutdown()

    asyncio.run(main())


def test_invalid_request_raises_before_anything_runs(engine):
    async def main():
        a = AsyncEngine(engine)
        a.start()
        try:
            g = a.open_group()
            with pytest.raises(ValueError, match="context limit"):
                g.add("too-long", list(range(10)) * 100, SamplingParams())
            assert g.finished and not engine.has_unfinished_requests()
        finally:
            a.shutdown()

    asyncio.run(main())


def test_engine_failure_reaches_every_consumer(engine):
    def broken_step():
        time.sleep(0.01)
        raise RuntimeError("device lost")

    async def main():
        a = AsyncEngine(engine)
        a.start()
        try:
            g = a.open_group()
            engine.step = broken_step
            g.add("r", _ids(engine, "hi"), SamplingParams(max_tokens=None))
            with pytest.raises(EngineDeadError, match="device lost"):
                await _drain(g)
            assert not a.healthy
            with pytest.raises(EngineDeadError):
                a.open_group().add("r2", _ids(engine, "hi"), SamplingParams())
        finally:
            a.shutdown()

    asyncio.run(main())


def test_engine_failure_over_http(engine):
    """A dead engine loop: the request in flight gets a 500 error body, /health turns 503, new requests 503."""
    from starlette.testclient import TestClient

    from deltaserve.server.api_server import build_app
    from deltaserve.server.state import ServerConfig

    def broken_step():
        raise RuntimeError("device lost")

    engine.step = broken_step
    with TestClient(build_app(engine, ServerConfig("m"))) as client:
        assert client.get("/health").status_code == 200
        r = client.post("/v1/completions", json={"prompt": "hi"})
        assert r.status_code == 500 and "device lost" in r.json()["error"]["message"]
        assert client.get("/health").status_code == 503
        assert client.post("/v1/completions", json={"prompt": "hi"}).status_code == 503
        text = client.get("/metrics").text
        assert 'deltaserve_requests_total{outcome="error"} 2.0' in text
