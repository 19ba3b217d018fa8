"""The server's request limits, each answered with an OpenAI-style error that names the field: body size
(413, also for a chunked upload before it ends), prompt characters before tokenizing, n / best_of, stop
strings, tools, stop_token_ids against the vocabulary (400), and a full waiting queue (503 + Retry-After)."""

from __future__ import annotations

import socket
import threading
import time

import pytest
from starlette.testclient import TestClient

from deltaserve.server.api_server import build_app
from deltaserve.server.state import ServerConfig

from .conftest import start_scripted_server
from .fake_engine import ScriptedEngine

TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}


def _client(tokenizer_dir, **config) -> TestClient:
    return TestClient(build_app(ScriptedEngine(str(tokenizer_dir)), ServerConfig("scripted", **config)))


def _error(r, status: int) -> dict:
    assert r.status_code == status, r.text
    body = r.json()["error"]
    assert set(body) == {"message", "type", "param", "code"}
    return body


@pytest.mark.parametrize("path, body, field", [
    ("/v1/completions", {"prompt": "hi", "n": 129}, "n"),
    ("/v1/completions", {"prompt": "hi", "n": 2, "best_of": 129}, "best_of"),
    ("/v1/chat/completions", {**CHAT, "n": 0}, "n"),
    ("/v1/completions", {"prompt": "hi", "stop": [f"s{i}" for i in range(65)]}, "stop"),
    ("/v1/chat/completions", {**CHAT, "tools": [
        {"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]}, "tools"),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [1, 10**6]}, "stop_token_ids"),
    ("/v1/chat/completions", {**CHAT, "stop_token_ids": [-1]}, "stop_token_ids"),
])
def test_default_caps_answer_400_naming_the_field(tokenizer_dir, path, body, field):
    with _client(tokenizer_dir) as client:
        error = _error(client.post(path, json=body), 400)
        assert error["param"] == field
        if field == "stop_token_ids":
            assert str(body["stop_token_ids"][-1]) in error["message"]


def test_values_at_the_caps_are_served(tokenizer_dir):
    with _client(tokenizer_dir, max_n=3, max_stop_sequences=2, max_tools=1) as client:
        r = client.post("/v1/completions", json={"prompt": "hi", "n": 3, "stop": ["a", "b"], "max_tokens": 2,
                                                 "stop_token_ids": [0, 379]})
        assert r.status_code == 200 and len(r.json()["choices"]) == 3
        assert client.post("/v1/chat/completions", json={**CHAT, "tools": [TOOL]}).status_code == 200
        assert _error(client.post("/v1/completions", json={"prompt": "hi", "n": 4}), 400)["param"] == "n"
        assert _error(client.post("/v1/chat/completions", json={**CHAT, "tools": [TOOL, TOOL]}), 400)["param"] == \
            "tools"


def test_prompt_characters_are_checked_before_tokenizing(tokenizer_dir, monkeypatch):
    calls = []
    with _client(tokenizer_dir, max_prompt_chars=100) as client:
        tokenizer = client.app.state.server.tokenizer
        encode = tokenizer.encode
        monkeypatch.setattr(tokenizer, "encode", lambda *a, **k: calls.append(a) or encode(*a, **k))
        error = _error(client.post("/v1/completions", json={"prompt": ["ok", "x" * 101]}), 400)
        assert error["param"] == "prompt" and error["code"] == "prompt_too_long" and "101" in error["message"]
        error = _error(client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "x" * 60}, {"role": "assistant", "content": "y" * 41}]}), 400)
        assert error["param"] == "messages"
        assert calls == []                      # refused before anything was tokenized
        assert client.post("/v1/completions", json={"prompt": "x" * 100, "max_tokens": 2}).status_code == 200


def test_default_prompt_character_limit_follows_the_context(tokenizer_dir):
    with _client(tokenizer_dir) as client:
        state = client.app.state.server
        assert state.max_prompt_chars == 32 * state.max_model_len
        error = _error(client.post("/v1/completions", json={"prompt": "a " * (16 * state.max_model_len + 1)}), 400)
        assert error["code"] == "prompt_too_long"


def test_a_prompt_beyond_the_context_is_refused_after_tokenizing(tokenizer_dir):
    with _client(tokenizer_dir) as client:
        error = _error(client.post("/v1/completions", json={"prompt": "hello there " * 400}), 400)
        assert error["param"] == "prompt" and error["code"] == "context_length_exceeded"


def test_body_over_the_limit_gets_413(tokenizer_dir):
    with _client(tokenizer_dir, max_request_bytes=1000) as client:
        error = _error(client.post("/v1/completions", json={"prompt": "x" * 2000}), 413)
        assert error["code"] == "request_too_large" and "1000" in error["message"]
        under = {"prompt": "hi", "max_tokens": 1, "user": "u" * 900}
        assert client.post("/v1/completions", json=under).status_code == 200
        text = client.get("/metrics").text
        assert 'deltaserve_requests_total{outcome="rejected"} 1.0' in text


def _raw_request(port: int, head: bytes, body_parts: list[bytes]) -> bytes:
    """Send a request over a plain socket, never finishing its body, and read what the server answers."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(head)
        for part in body_parts:
            s.sendall(part)
        s.settimeout(10)
        data = b""
        while b"\r\n\r\n" not in data or not data.split(b"\r\n\r\n", 1)[1]:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
        return data


@pytest.fixture(scope="module")
def small_body_server(tokenizer_dir, tmp_path_factory):
    proc = start_scripted_server(tokenizer_dir, tmp_path_factory.mktemp("limits"), "--max-request-bytes", "4096")
    yield proc
    proc.stop()


def test_chunked_upload_is_refused_as_soon_as_it_passes_the_limit(small_body_server):
    """The server answers 413 while the client is still sending (the body is never finished here)."""
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n")
    part = b'{"prompt": "' + b"x" * 3000
    chunk = b"%x\r\n%s\r\n" % (len(part), part)
    answer = _raw_request(small_body_server.port, head, [chunk, chunk])
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert b'"request_too_large"' in answer


def test_declared_length_over_the_limit_is_refused_before_the_body(small_body_server):
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100000\r\n\r\n")
    answer = _raw_request(small_body_server.port, head, [])
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]


def test_full_waiting_queue_answers_503_with_retry_after(tokenizer_dir):
    with _client(tokenizer_dir, max_waiting_requests=1, retry_after_s=3) as client:
        waiting = client.app.state.server.waiting
        first: dict = {}
        held = threading.Thread(target=lambda: first.update(r=client.post("/v1/completions", json={
            "prompt": "[[queued:1.5]] hi", "max_tokens": 2})))
        held.start()
        deadline = time.monotonic() + 10
        while waiting.count == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert waiting.count == 1
        r = client.post("/v1/chat/completions", json=CHAT)
        error = _error(r, 503)
        assert r.headers["retry-after"] == "3" and error["code"] == "server_overloaded"
        assert 'deltaserve_requests_total{outcome="rejected"} 1.0' in client.get("/metrics").text
        held.join(30)
        assert first["r"].status_code == 200
        assert waiting.count == 0               # the first output gave the slot back
        assert client.post("/v1/chat/completions", json=CHAT).status_code == 200
        assert client.post("/v1/completions", json={"prompt": "hi", "stream": True, "max_tokens": 2}).status_code \
            == 200
        assert waiting.count == 0


def test_a_response_dropped_unread_frees_its_waiting_slot_and_requests(tokenizer_dir):
    """The client left before the body (or the collecting task) started: nothing of ours ran."""
    import gc

    from deltaserve.server.streaming import StreamingRun
    from deltaserve.server.state import WaitingRequests

    class Group:
        closed = False

        def close(self):
            self.closed = True

    waiting, group = WaitingRequests(limit=1, retry_after_s=1), Group()
    run = StreamingRun()
    run.ticket = waiting.admit(1)
    run.own(group)
    unread = run._outputs(group)       # never started
    del run, unread
    gc.collect()
    assert group.closed and waiting.count == 0
