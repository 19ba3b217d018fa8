"""Start `deltaserve serve` on a free loopback port for the serving benchmark, wait for /health, stop it."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def launched_server(model: str, server_args: list[str], timeout: float = 900.0,
                    log_path: str | None = None) -> Iterator[str]:
    """Yields the server's base URL (without /v1); the server's output goes to log_path (a temp file by
    default; its tail is in the error when the server exits or never becomes healthy)."""
    port = free_port()
    cmd = [sys.executable, "-m", "deltaserve", "serve", "--model", model, "--host", "127.0.0.1",
           "--port", str(port), "--uvicorn-log-level", "warning", *server_args]
    # closed in the finally below (the server writes to it for the whole benchmark)
    log_file = (open(log_path, "w") if log_path  # noqa: SIM115
                else tempfile.NamedTemporaryFile("w", suffix=".log", delete=False))  # noqa: SIM115
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    print(f"launching: {' '.join(cmd)} (log: {log_file.name})", file=sys.stderr)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log_file, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"

    def tail() -> str:
        log_file.flush()
        return Path(log_file.name).read_text()[-4000:]

    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with {proc.returncode}:\n{tail()}")
            try:
                if httpx.get(f"{base}/health", timeout=2.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the server was not healthy within {timeout} s:\n{tail()}")
            time.sleep(0.5)
        yield base
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log_file.close()
