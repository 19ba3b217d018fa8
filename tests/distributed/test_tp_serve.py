"""`deltaserve serve -tp 2` through the engine core process (gloo, CPU): the core is rank 0 and starts rank 1
as its own child; streamed greedy tokens equal the TP = 1 engine's, and a killed rank makes /health fail
within a second and the server exit 1 (the core reports the rank's death and ends the other ranks)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import time
from pathlib import Path

import httpx
import pytest

from deltaserve import LLM, SamplingParams
from tests.server.conftest import ServerProcess
from tests.server.live_server import sse_events
from tests.server.tiny_model import build_model_dir

PROMPTS = [[5, 17, 33, 2, 90], list(range(40, 75)), [301, 7]]
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """The server tests' tiny model without its tokenizer: streamed chunks then carry token ids."""
    full = build_model_dir(tmp_path_factory.mktemp("tiny-tp-serve"))
    path = tmp_path_factory.mktemp("tiny-tp-serve-ids")
    for f in full.iterdir():
        if f.is_file() and not f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, path / f.name)
    return path


def _core_pid(server: ServerProcess) -> int:
    m = re.search(r"engine core process\(es\) ready \(pids \[(\d+)\]\)", server.log())
    assert m, server.log()
    return int(m.group(1))


def _children(pid: int) -> list[int]:
    """Processes whose parent is `pid` and that multiprocessing spawned (not its resource tracker)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(") ", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes()
        except OSError:
            continue
        if int(fields[1]) == pid and b"spawn_main" in cmdline:
            out.append(int(stat.parent.name))
    return out


def _alive(pid: int) -> bool:
    try:
        return not Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].startswith("Z")
    except OSError:
        return False


def _stream(url: str, ids: list[int]) -> list[int]:
    body = {"model": "tiny", "prompt": ids, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with httpx.Client(base_url=url, timeout=120) as c, c.stream("POST", "/completions", json=body) as r:
        assert r.status_code == 200, r.read()
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]"
    return [t for e in events[:-1] for t in e["choices"][0]["token_ids"]]


def test_serve_tp2_through_the_core_process_streams_tp1_tokens_and_a_killed_rank_ends_it(model_dir, tmp_path):
    ref = LLM(model_dir, device="cpu", dtype="float32", max_model_len=256)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in ref.generate([{"prompt_token_ids": p} for p in PROMPTS], params,
                                                         use_tqdm=False)]
    server = ServerProcess(["-m", "deltaserve", "serve", "--model", str(model_dir), "--device", "cpu",
                            "--dtype", "float32", "--max-model-len", "256", "--served-model-name", "tiny",
                            "-tp", "2", "--uvicorn-log-level", "warning"], tmp_path / "server.log").start()
    try:
        core = _core_pid(server)
        [rank1] = _children(core)
        got = [_stream(server.url, p) for p in PROMPTS]
        assert got == want
        os.kill(rank1, signal.SIGKILL)
        killed = time.monotonic()
        while time.monotonic() - killed < 5:
            try:
                if httpx.get(f"{server.base}/health", timeout=1.0).status_code != 200:
                    break
            except httpx.HTTPError:
                break
            time.sleep(0.05)
        unhealthy = time.monotonic() - killed
        rc = server.proc.wait(15)
        exited = time.monotonic() - killed
        core_gone = not _alive(core)
    finally:
        server.stop()
    assert unhealthy < 1.0, (unhealthy, server.log())
    assert rc != 0 and core_gone, server.log()
    assert exited < 5.0, exited
    assert "tensor-parallel worker rank 1" in server.log(), server.log()


def _start(model_dir: Path, log: Path) -> ServerProcess:
    return ServerProcess(["-m", "deltaserve", "serve", "--model", str(model_dir), "--device", "cpu",
                          "--max-model-len", "128", "-tp", "2", "--uvicorn-log-level", "warning"], log).start()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["stopped", "killed"])
def test_the_servers_end_ends_the_core_and_its_ranks(model_dir, tmp_path, sig):
    """The core is not a daemon process any more (it starts the ranks): a stopped server still joins it and
    exits 0, and a killed one leaves no core or rank behind (the core sees its pipe close, the rank its parent
    go)."""
    server = _start(model_dir, tmp_path / "server.log")
    try:
        core = _core_pid(server)
        pids = [core, *_children(core)]
        assert len(pids) == 2
        server.proc.send_signal(sig)
        rc = server.proc.wait(20)
        stopped = time.monotonic()
        while any(_alive(p) for p in pids) and time.monotonic() - stopped < 10:
            time.sleep(0.05)
        gone = time.monotonic() - stopped
    finally:
        server.stop()
    assert not any(_alive(p) for p in pids), server.log()
    assert gone < 3.0, gone
    if sig == signal.SIGTERM:
        assert rc == 0, server.log()
