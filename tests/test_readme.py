"""The README's snippets run as written.

Each fenced block is run according to the `<!-- readme-test: KIND -->` comment above it:
  (none, python)  executed in a fresh interpreter;
  run             each line run by bash, `deltaserve` being this checkout's CLI; each must exit 0 and print;
  ci              an install command: .ci/run must contain it verbatim (CI runs it; here it would download);
  server          a `deltaserve serve` command: started on a free loopback port, and the python block after it
                  is executed against that server (its port 8000 replaced by the one in use);
  skip: REASON    not run (needs a checkpoint or a GPU), and says why.
A bash block without a comment fails the test, so no command is left untested without a stated reason.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
BLOCK = re.compile(r"(?:<!-- readme-test: (?P<kind>[^>]*?) -->\n)?```(?P<lang>\w*)\n(?P<body>.*?)```", re.DOTALL)
TIMEOUT = 600


@dataclasses.dataclass(frozen=True)
class Block:
    kind: str            # python | run | ci | server | skip
    lang: str
    body: str
    line: int


def blocks() -> list[Block]:
    text = README.read_text()
    out = []
    for m in BLOCK.finditer(text):
        kind = (m["kind"] or ("python" if m["lang"] == "python" else "")).split(":")[0].strip()
        out.append(Block(kind, m["lang"], m["body"], text[: m.start("body")].count("\n") + 1))
    return out


def env() -> dict[str, str]:
    e = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
             TOKENIZERS_PARALLELISM="false", DELTASERVE_LOG_LEVEL="WARNING")
    e.pop("DELTASERVE_COMPILE", None)          # the defaults, as a user gets them
    return e


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True,
                          timeout=TIMEOUT, env=env(), cwd=ROOT)


def test_every_bash_block_says_how_it_is_tested():
    unmarked = [b.line for b in blocks() if b.lang != "python" and b.kind not in ("run", "ci", "server", "skip")]
    assert not unmarked, f"README blocks without a readme-test comment at lines {unmarked}"


def python_blocks() -> list[Block]:
    bs = blocks()
    after_server = {bs[i + 1].line for i, b in enumerate(bs[:-1]) if b.kind == "server"}
    return [b for b in bs if b.kind == "python" and b.line not in after_server]


@pytest.mark.parametrize("block", python_blocks(), ids=lambda b: f"line{b.line}")
def test_python_snippet_runs(block):
    res = run_python(block.body)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.strip(), "the snippet printed nothing"


def command_lines() -> list[tuple[int, str]]:
    return [(b.line + i, line) for b in blocks() if b.kind == "run"
            for i, line in enumerate(b.body.splitlines()) if line.strip()]


@pytest.mark.parametrize("line, command", command_lines(), ids=lambda x: str(x) if isinstance(x, int) else None)
def test_cli_command_runs(line, command):
    assert command.startswith("deltaserve "), f"README line {line}: {command!r} is not a deltaserve command"
    script = f'deltaserve() {{ {shlex.quote(sys.executable)} -m deltaserve "$@"; }}\n{command}\n'
    res = subprocess.run(["bash", "-c", script], check=False, capture_output=True, text=True, timeout=TIMEOUT,
                         env=env(), cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.strip()


def test_install_commands_are_the_ones_ci_runs():
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    commands = [b.body.strip() for b in blocks() if b.kind == "ci"]
    assert len(commands) == 2                  # the quick start and the test command
    for command in commands:
        assert command in ci, f"{command!r} is not a line of .ci/run"
    assert commands[0].split()[3] != commands[1].split()[3], "both commands build the same venv"


def _wait_healthy(proc: subprocess.Popen, port: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the server exited with {proc.returncode}: {proc.stderr.read()[-3000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise AssertionError("the server did not become healthy")


@pytest.mark.slow
def test_serve_snippet_runs_against_a_real_server():
    bs = blocks()
    i = next(i for i, b in enumerate(bs) if b.kind == "server")
    command, client = bs[i].body.strip(), bs[i + 1]
    assert client.lang == "python" and "8000" in command and "8000" in client.body
    port = free_port()
    argv = shlex.split(command.replace("8000", str(port)))
    assert argv[:2] == ["deltaserve", "serve"] and "--host" not in argv    # the default host: loopback
    proc = subprocess.Popen([sys.executable, "-m", "deltaserve", *argv[1:]], env=env(), cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        _wait_healthy(proc, port, timeout=300)
        res = run_python(client.body.replace("8000", str(port)))
        assert res.returncode == 0, res.stderr[-3000:]
        assert res.stdout.strip()
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
