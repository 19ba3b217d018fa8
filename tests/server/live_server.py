"""Helpers for tests that drive a server subprocess over loopback: SSE parsing, /metrics gauges, RSS,
and the scripted lifecycle server."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable

import httpx
from prometheus_client.parser import text_string_to_metric_families

from .conftest import HERE, ServerProcess

DONE = "[DONE]"


def sse_events(lines: Iterable[str]) -> list[Any]:
    """The `data:` payloads of an SSE body, JSON-decoded (DONE stays the string "[DONE]")."""
    events = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: "):]
            events.append(data if data == DONE else json.loads(data))
    return events


def next_event(lines) -> Any:
    """The next `data:` payload from an iterator of SSE lines."""
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: "):]
            return data if data == DONE else json.loads(data)
    raise AssertionError("the stream ended without another event")


def metrics(base: str) -> dict[str, float]:
    """Unlabelled samples by name, labelled ones as name{k=v,...}."""
    out = {}
    for family in text_string_to_metric_families(httpx.get(f"{base}/metrics", timeout=10).text):
        for s in family.samples:
            label = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[s.name + (f"{{{label}}}" if label else "")] = s.value
    return out


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/PID/status")


def lifecycle_server(tokenizer_dir: Path, log_path: Path, *extra: str) -> ServerProcess:
    """The scripted engine behind the real app and run_server (prompt markers: see fake_engine.py;
    `[[crash]]` kills the engine loop)."""
    return ServerProcess([str(HERE / "lifecycle_server.py"), "--model", str(tokenizer_dir), *extra], log_path)
