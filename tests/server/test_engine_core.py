"""The engine core process split (engine/core_process.py, server/engine_client.py): deltas rebuilt into the
same cumulative outputs, validation refusals before anything streams, aborts, and death of either side
(engine core dies -> /health fails and the server exits 1; server dies -> the core exits)."""

from __future__ import annotations

import asyncio
import functools
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from deltaserve.engine.core_process import DeltaEncoder, pack_ids, unpack_ids
from deltaserve.outputs import CompletionOutput, RequestOutput
from deltaserve.sampling_params import SamplingParams
from deltaserve.server.async_engine import AsyncEngine, EngineDeadError
from deltaserve.server.engine_client import EngineCoreClient, EngineCoreSpec

from .conftest import REPO
from .fake_engine import ScriptedEngine
from .live_server import lifecycle_server, next_event, sse_events


def scripted(model_dir: str, index: int) -> ScriptedEngine:
    return ScriptedEngine(model_dir)


def broken(index: int):
    raise ValueError("no such model")


def _client(tokenizer_dir, dp: int = 1) -> EngineCoreClient:
    return EngineCoreClient(EngineCoreSpec(functools.partial(scripted, str(tokenizer_dir)), str(tokenizer_dir),
                                           dp)).start()


def _out(rid, text, ids, finished=False, reason=None):
    return RequestOutput(rid, None, [1], None, [CompletionOutput(0, text, ids, None, reason)], finished)


def test_ids_pack_and_deltas_carry_only_what_is_new():
    assert unpack_ids(pack_ids([0, 5, 2**31 - 1])) == [0, 5, 2**31 - 1]
    assert unpack_ids(pack_ids([-1, 2**70])) == [-1, 2**70]          # invalid: the engine refuses them
    enc = DeltaEncoder()
    _, _, _, _, [first], _ = enc.encode(_out("r", "He", [7, 8]))
    _, _, _, _, [second], _ = enc.encode(_out("r", "Hello", [7, 8, 9]))
    _, finished, _, _, [last], _ = enc.encode(_out("r", "Hello", [7, 8, 9], True, "stop"))
    assert first[1:4] == ([7, 8], "He", False) and second[1:4] == ([9], "llo", False)
    assert last[1:4] == ([], "", False) and last[5] == "stop" and finished
    _, _, _, _, [fresh], _ = enc.encode(_out("r", "Hello", [7, 8, 9]))   # finished requests are forgotten
    assert fresh[1] == [7, 8, 9]
    _, _, _, _, [replaced], _ = enc.encode(_out("r", "Help", [7, 8, 9, 1]))  # text not extending what was sent
    assert replaced[2:4] == ("Help", True)


def test_outputs_equal_the_in_process_engine_and_both_replicas_serve(tokenizer_dir):
    prompts = ["[[script:think]] a", "[[chunk:1]] b", "hello c", "[[script:json_call]] d", "e", "f"]

    async def run(engine):
        a = AsyncEngine(engine)
        a.start()
        try:
            tok = engine.tokenizer
            groups = []
            for i, p in enumerate(prompts):
                g = a.open_group()
                g.add(f"r{i}", tok.encode(p), SamplingParams(max_tokens=None, n=2))
                await g.accepted()
                groups.append(g)

            async def final(g):
                last = None
                async for out in g:
                    last = out
                return last

            outs = await asyncio.gather(*(final(g) for g in groups))
            return [[(c.text, c.token_ids, c.finish_reason) for c in o.outputs] for o in outs]
        finally:
            a.shutdown()

    reference = asyncio.run(run(ScriptedEngine(str(tokenizer_dir))))
    client = _client(tokenizer_dir, dp=2)
    try:
        assert asyncio.run(run(client)) == reference
        per_core = [c.stats.prompt_tokens_total for c in client._cores]
        assert all(n > 0 for n in per_core), per_core          # both replicas got requests
        assert client.outstanding == [0, 0]
        assert client.get_stats().prompt_tokens_total == sum(per_core)
    finally:
        client.close()


def test_bad_request_is_refused_before_streaming_and_abort_frees_it(tokenizer_dir):
    client = _client(tokenizer_dir)

    async def run():
        a = AsyncEngine(client)
        a.start()
        try:
            g = a.open_group()
            g.add("too-long", list(range(10)) * 100, SamplingParams())
            with pytest.raises(ValueError, match="context limit"):
                await g.accepted()
            g.close()
            g = a.open_group()
            g.add("long", client.tokenizer.encode("[[forever]]"), SamplingParams(max_tokens=None))
            await g.accepted()
            async for out in g:
                assert not out.finished
                break
            assert client.get_stats().num_running == 1
            g.close()
            deadline = time.monotonic() + 5
            while client.get_stats().num_running and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert client.get_stats().num_running == 0 and client.outstanding == [0]
        finally:
            a.shutdown()

    try:
        asyncio.run(run())
    finally:
        client.close()


def test_a_core_that_cannot_build_its_engine_fails_start_with_its_error():
    with pytest.raises(RuntimeError, match="no such model"):
        EngineCoreClient(EngineCoreSpec(broken, None)).start()


def test_core_killed_fails_live_requests_and_health_within_a_second(tokenizer_dir):
    client = _client(tokenizer_dir)

    async def run():
        a = AsyncEngine(client)
        a.start()
        try:
            g = a.open_group()
            g.add("long", client.tokenizer.encode("[[forever]]"), SamplingParams(max_tokens=None))
            await g.accepted()
            it = g.__aiter__()
            await it.__anext__()
            os.kill(client._cores[0].process.pid, signal.SIGKILL)
            killed = time.monotonic()
            with pytest.raises(EngineDeadError, match="engine"):
                while True:
                    await it.__anext__()
            while a.healthy:
                await asyncio.sleep(0.02)
            return time.monotonic() - killed
        finally:
            a.shutdown()

    try:
        seconds = asyncio.run(run())
    finally:
        client.close()
    assert seconds < 1.0, seconds


def _core_pids(server) -> list[int]:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        m = re.search(r"engine core pids: \[([\d, ]+)\]", server.log())
        if m:
            return [int(p) for p in m.group(1).split(",")]
        time.sleep(0.1)
    raise AssertionError(f"no core pids in the log:\n{server.log()}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return not Path(f"/proc/{pid}/stat").read_text().split(") ")[1].startswith("Z")


def test_server_killed_makes_its_cores_exit(tokenizer_dir, tmp_path):
    server = lifecycle_server(tokenizer_dir, tmp_path / "server.log", "--data-parallel-size", "2").start()
    try:
        pids = _core_pids(server)
        with httpx.Client(base_url=server.url, timeout=30) as c, \
                c.stream("POST", "/completions", json={"prompt": "[[forever]]", "stream": True,
                                                       "max_tokens": 400}) as r:
            next_event(r.iter_lines())
            server.proc.kill()
            killed = time.monotonic()
        server.proc.wait(10)
        while any(_alive(p) for p in pids) and time.monotonic() - killed < 10:
            time.sleep(0.05)
        gone = time.monotonic() - killed
    finally:
        server.stop()
    assert not any(_alive(p) for p in pids)
    assert gone < 2.0, gone


def test_core_killed_under_the_server_fails_health_and_exits_1(tokenizer_dir, tmp_path):
    server = lifecycle_server(tokenizer_dir, tmp_path / "server.log").start()
    try:
        [pid] = _core_pids(server)
        with httpx.Client(base_url=server.url, timeout=30) as c, \
                c.stream("POST", "/completions", json={"prompt": "[[forever]]", "stream": True,
                                                       "max_tokens": 400}) as r:
            lines = r.iter_lines()
            next_event(lines)
            os.kill(pid, signal.SIGKILL)
            killed = time.monotonic()
            events = sse_events(lines)
        rc = server.proc.wait(10)
        exited = time.monotonic() - killed
    finally:
        server.stop()
    assert events[-1] == "[DONE]" and "engine core" in events[-2]["error"]["message"]
    assert rc == 1, server.log()
    assert exited < 3.0, exited


def test_in_thread_engine_still_serves(tokenizer_dir, tmp_path):
    server = lifecycle_server(tokenizer_dir, tmp_path / "server.log", "--no-engine-process").start()
    try:
        r = httpx.post(f"{server.url}/completions", json={"prompt": "Hi"}, timeout=30)
    finally:
        server.stop()
    assert r.json()["choices"][0]["text"] == "The answer is 4."
    assert "engine core pids" not in server.log()


def test_serve_refuses_data_parallel_without_engine_processes():
    r = subprocess.run([sys.executable, "-m", "deltaserve", "serve", "--no-engine-process",
                        "--data-parallel-size", "2", "--device", "cpu"], cwd=REPO, capture_output=True, text=True,
                       check=False, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120)
    assert r.returncode != 0 and "--data-parallel-size" in r.stderr + r.stdout
