"""The server process's life: the port bound before the model loads, /health 503 until the engine can serve,
SIGTERM / SIGINT draining (live requests finish, what outlives --shutdown-timeout ends with an error chunk and
[DONE], exit 0), engine death (errors to live requests, /health fails, exit 1), a client that stops reading
(aborted, its cache freed); and, in-process, the stall detection those rely on."""

from __future__ import annotations

import asyncio
import errno
import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from deltaserve.sampling_params import SamplingParams
from deltaserve.server.async_engine import AsyncEngine, StreamStalledError
from deltaserve.server.metrics import ServerMetrics

from .conftest import REPO, free_port
from .fake_engine import ScriptedEngine
from .live_server import DONE, lifecycle_server, metrics, next_event, sse_events

SHUTDOWN_TIMEOUT = 3.0
FOREVER = 480   # max_tokens of a `[[forever]]` stream: ~10 s at the scripted engine's 20 ms a step


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1",
            "DELTASERVE_COMPILE": "off"}


def _health(base: str) -> int | str:
    try:
        return httpx.get(f"{base}/health", timeout=5).status_code
    except httpx.TransportError:
        return "refused"


# A `deltaserve serve` whose model load is replaced: GATE=path makes it wait for that file first, REFUSE=1
# makes loading an error (so a test can tell whether the load was reached).
_PATCHED_SERVE = """
import os, sys, time
from deltaserve.engine.llm_engine import LLMEngine
load = LLMEngine.from_args.__func__
def patched(cls, *args, **kwargs):
    if os.environ.get("REFUSE"):
        raise SystemExit("the model load was reached")
    while not os.path.exists(os.environ["GATE"]):
        time.sleep(0.05)
    return load(cls, *args, **kwargs)
LLMEngine.from_args = classmethod(patched)
from deltaserve.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_port_in_use_fails_before_the_model_loads():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        t0 = time.monotonic()
        r = subprocess.run([sys.executable, "-c", _PATCHED_SERVE, "serve", "--device", "cpu", "--port", str(port)],
                           cwd=REPO, env={**_env(), "REFUSE": "1"}, capture_output=True, text=True, timeout=180,
                           check=False)
        elapsed = time.monotonic() - t0
    assert r.returncode != 0
    assert "the model load was reached" not in r.stderr, r.stderr
    assert f"127.0.0.1:{port}" in r.stderr and f"[Errno {errno.EADDRINUSE}]" in r.stderr, r.stderr
    assert os.strerror(errno.EADDRINUSE) in r.stderr
    print(f"second server on a used port exited {r.returncode} after {elapsed:.1f} s (imports included)")


def test_health_is_503_while_the_model_loads_then_200(tmp_path):
    gate, port = tmp_path / "go", free_port()
    base = f"http://127.0.0.1:{port}"
    log = open(tmp_path / "server.log", "w")  # noqa: SIM115 (the server writes to it until the end)
    proc = subprocess.Popen([sys.executable, "-c", _PATCHED_SERVE, "serve", "--device", "cpu", "--port", str(port),
                             "--max-model-len", "128", "--cpu-cache-bytes", str(32 << 20),
                             "--uvicorn-log-level", "warning"],
                            cwd=REPO, env={**_env(), "GATE": str(gate)}, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 180
        while _health(base) == "refused":
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "server.log").read_text()
            time.sleep(0.1)
        loading = httpx.get(f"{base}/health", timeout=5)
        assert loading.status_code == 503 and loading.headers["retry-after"] == "1"
        assert "loading" in loading.json()["error"]["message"]
        refused = httpx.post(f"{base}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=5)
        assert refused.status_code == 503 and "error" in refused.json()

        gate.touch()
        deadline = time.monotonic() + 120
        while _health(base) != 200:
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "server.log").read_text()
            time.sleep(0.1)
        done = httpx.post(f"{base}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
        assert done.status_code == 200 and done.json()["choices"][0]["finish_reason"] == "length"

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()


def _stream(client: httpx.Client, prompt: str, **fields):
    return client.stream("POST", "/completions", json={"prompt": prompt, "stream": True, **fields})


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_lets_live_requests_finish_then_ends_streams_and_exits_0(tokenizer_dir, tmp_path, sig):
    server = lifecycle_server(tokenizer_dir, tmp_path / "server.log",
                              "--shutdown-timeout", str(SHUTDOWN_TIMEOUT)).start()
    try:
        with httpx.Client(base_url=server.url, timeout=30) as a, httpx.Client(base_url=server.url, timeout=30) as b, \
                _stream(a, "[[forever]]", max_tokens=FOREVER) as forever, _stream(b, "[[slow]] [[chunk:1]]") as short:
            forever_lines, short_lines = forever.iter_lines(), short.iter_lines()
            next_event(forever_lines)
            short_events = [next_event(short_lines)]   # both are running
            signalled = time.monotonic()
            server.proc.send_signal(sig)
            after_signal = _health(server.base)
            short_events += sse_events(short_lines)
            tail = []
            for line in forever_lines:
                if line.startswith("data: ") and "error" in line:
                    ended = time.monotonic() - signalled
                tail.append(line)
        rc = server.proc.wait(60)
        exited = time.monotonic() - signalled
    finally:
        server.stop()
    assert after_signal in (503, "refused")   # no request is admitted once the signal arrived
    assert short_events[-1] == DONE and not any("error" in e for e in short_events[:-1])
    assert "".join(c["text"] for e in short_events[:-1] for c in e["choices"]) == "The answer is 4."
    assert short_events[-2]["choices"][0]["finish_reason"] == "stop"
    forever_events = sse_events(tail)
    assert forever_events[-1] == DONE, tail[-3:]
    assert "error" in forever_events[-2], tail[-6:]
    error = forever_events[-2]["error"]
    assert "shutting down" in error["message"] and error["type"]
    assert SHUTDOWN_TIMEOUT - 0.5 <= ended <= SHUTDOWN_TIMEOUT + 5, ended
    assert rc == 0, server.log()
    print(f"stream ended {ended:.2f} s after the signal, process exited after {exited:.2f} s")


def test_engine_death_errors_live_requests_fails_health_and_exits_1(tokenizer_dir, tmp_path):
    server = lifecycle_server(tokenizer_dir, tmp_path / "server.log").start()
    try:
        with httpx.Client(base_url=server.url, timeout=30) as a, \
                _stream(a, "[[forever]]", max_tokens=FOREVER) as forever:
            lines = forever.iter_lines()
            next_event(lines)
            crashed = time.monotonic()
            r = httpx.post(f"{server.url}/completions", json={"prompt": "[[crash]]"}, timeout=30)
            events = sse_events(lines)
        health = []
        while server.proc.poll() is None and time.monotonic() - crashed < 30:
            health.append(_health(server.base))
            time.sleep(0.05)
        rc = server.proc.wait(30)
        exited = time.monotonic() - crashed
    finally:
        server.stop()
    assert r.status_code >= 500 and "engine" in r.json()["error"]["message"]
    assert events[-1] == DONE and "engine" in events[-2]["error"]["message"]
    assert 200 not in health
    assert rc == 1, server.log()
    assert exited < 10, exited
    print(f"process exited {rc} {exited:.2f} s after the engine failed")


def test_client_that_stops_reading_is_aborted_and_its_cache_freed(tokenizer_dir, tmp_path):
    server = lifecycle_server(tokenizer_dir, tmp_path / "server.log", "--stream-inactivity-timeout", "1",
                              "--send-buffer", "8192").start()
    try:
        body = json.dumps({"prompt": "[[forever]]", "stream": True, "n": 32, "max_tokens": FOREVER}).encode()
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)   # fills at once; never read
            s.connect(("127.0.0.1", server.port))
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            deadline, seen_running = time.monotonic() + 30, False
            while True:
                m = metrics(server.base)
                seen_running = seen_running or m["deltaserve_kv_blocks_used"] > 0
                if seen_running and m["deltaserve_kv_blocks_used"] == 0:
                    break
                assert time.monotonic() < deadline, f"still running: {m['deltaserve_kv_blocks_used']} blocks used"
                time.sleep(0.2)
            assert m["deltaserve_state_slots_used"] == 0
            assert m['deltaserve_requests_total{outcome=abort}'] == 1
            ok = httpx.post(f"{server.url}/completions", json={"prompt": "Hi"}, timeout=30)
            assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == "The answer is 4."
    finally:
        server.stop()
    assert "has not read" in server.log()


# ---- in-process: what counts as a stalled consumer ----------------------------------------------------------


def test_consumer_waiting_on_its_queue_is_never_stalled(tokenizer_dir):
    engine = ScriptedEngine(str(tokenizer_dir))

    async def main():
        a = AsyncEngine(engine, ServerMetrics(engine.get_stats))
        waiting, away = a.open_group(), a.open_group()
        # Not started: the engine produces nothing, so `waiting` waits on its queue for as long as it likes.
        waiting.add("w", engine.tokenizer.encode("[[forever]]"), SamplingParams(max_tokens=None))
        away.add("a", engine.tokenizer.encode("[[forever]]"), SamplingParams(max_tokens=None))
        reader = asyncio.ensure_future(waiting.__aiter__().__anext__())
        await asyncio.sleep(0.3)
        assert waiting.stalled_for(time.monotonic()) == 0.0
        assert away.stalled_for(time.monotonic()) >= 0.3   # its consumer never came back to the queue
        assert a.abort_stalled(timeout=0.2) == 1
        assert engine.get_stats().num_running == 1   # only `a` was aborted
        with pytest.raises(StreamStalledError):
            async for _ in away:
                pass
        reader.cancel()
        waiting.close()
        assert engine.get_stats().num_running == 0

    asyncio.run(main())
