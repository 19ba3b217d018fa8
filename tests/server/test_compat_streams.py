"""A failing engine ends live Anthropic Messages and Responses streams with each API's own `error` event
(the scripted lifecycle server: `[[crash]]` makes the next engine step raise)."""

from __future__ import annotations

import json

import httpx

from .live_server import lifecycle_server


def _events(lines) -> list[tuple[str, dict]]:
    out, name = [], None
    for line in lines:
        if line.startswith("event: "):
            name = line[len("event: "):]
        elif line.startswith("data: "):
            out.append((name, json.loads(line[len("data: "):])))
    return out


def _first_delta(lines, kind: str) -> None:
    for line in lines:
        if line.startswith("data: ") and kind in line:
            return
    raise AssertionError(f"the stream ended before a {kind}")


def test_engine_death_ends_both_streams_with_their_error_event(tokenizer_dir, tmp_path):
    server = lifecycle_server(tokenizer_dir, tmp_path / "server.log").start()
    messages = {"model": "scripted", "max_tokens": 400, "stream": True, "thinking": {"type": "disabled"},
                "messages": [{"role": "user", "content": "[[forever]]"}]}
    responses = {"model": "scripted", "input": "[[forever]]", "stream": True, "reasoning": {"effort": "none"},
                 "max_output_tokens": 400}
    try:
        with httpx.Client(base_url=server.base, timeout=30) as c, \
                c.stream("POST", "/v1/messages", json=messages) as m, \
                c.stream("POST", "/v1/responses", json=responses) as r:
            m_lines, r_lines = m.iter_lines(), r.iter_lines()
            _first_delta(m_lines, "text_delta")
            _first_delta(r_lines, "response.output_text.delta")
            crash = httpx.post(f"{server.url}/completions", json={"prompt": "[[crash]]"}, timeout=30)
            m_events, r_events = _events(m_lines), _events(r_lines)
    finally:
        server.stop()
    assert crash.status_code >= 500
    name, data = m_events[-1]
    assert name == "error" and data["type"] == "error" and data["error"]["type"] == "api_error"
    assert "engine" in data["error"]["message"]
    assert "message_stop" not in [n for n, _ in m_events]
    name, data = r_events[-1]
    assert name == "error" and data["type"] == "error" and "engine" in data["message"]
    assert "response.completed" not in [n for n, _ in r_events]
