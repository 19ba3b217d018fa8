"""Server test fixtures: a tiny model directory, and real server processes on loopback ports."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from .tiny_model import build_model_dir, build_tokenizer

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A server subprocess; `url` is its /v1 base URL once `start()` returned."""

    def __init__(self, args: list[str], log_path: Path, verify: Any = None):
        """verify: an ssl.SSLContext trusting the server's certificate, for a server started with TLS."""
        self.port = free_port()
        self.args = [*args, "--port", str(self.port)]
        self.log_path = log_path
        self.verify = verify
        self.base = f"{'https' if verify is not None else 'http'}://127.0.0.1:{self.port}"
        self.url = f"{self.base}/v1"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 120.0) -> "ServerProcess":
        env = {**os.environ, "PYTHONPATH": str(REPO), "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen([sys.executable, *self.args], cwd=REPO, env=env, stdout=self._log,
                                     stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.base}/health", timeout=1.0, verify=self.verify or True).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"server did not become healthy in {timeout} s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text()[-4000:] if self.log_path.exists() else ""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc is not None:
            self._log.close()


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> Path:
    """Tokenizer files only (enough for the scripted engine)."""
    path = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer(path)
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return build_model_dir(tmp_path_factory.mktemp("tiny-qwen3-next"))


def start_tiny_server(model_dir: Path, log_dir: Path, *extra: str, max_model_len: int = 256) -> ServerProcess:
    """`deltaserve serve` on a tiny real model (CPU, fp32), served as "tiny"."""
    return ServerProcess(["-m", "deltaserve", "serve", "--model", str(model_dir), "--device", "cpu",
                          "--max-model-len", str(max_model_len), "--served-model-name", "tiny",
                          "--uvicorn-log-level", "warning", *extra], log_dir / "server.log").start()


def start_scripted_server(tokenizer_dir: Path, log_dir: Path, *extra: str) -> ServerProcess:
    return ServerProcess([str(HERE / "scripted_server.py"), "--model", str(tokenizer_dir), *extra],
                         log_dir / "scripted.log").start()
