"""`deltaserve serve --data-parallel-size 2` on the tiny model without a tokenizer: both engine core replicas
take requests, greedy outputs equal the offline engine's (so DP=1's: test_api_engine checks the server against
it), and streamed completions of token-id prompts carry their token ids in every chunk."""

from __future__ import annotations

import asyncio
import re
import shutil
from pathlib import Path

import httpx
import pytest

from .conftest import ServerProcess
from .live_server import sse_events

pytest.importorskip("deltaserve.engine.llm_engine")

MAX_MODEL_LEN = 128
PROMPTS = [[(7 * i + j) % 200 + 5 for j in range(3 + i % 5)] for i in range(12)]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def model_without_tokenizer(tiny_model_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-no-tokenizer")
    for f in tiny_model_dir.iterdir():
        if f.is_file() and not f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, path / f.name)
    return path


@pytest.fixture(scope="module")
def server(model_without_tokenizer, tmp_path_factory):
    proc = ServerProcess(["-m", "deltaserve", "serve", str(model_without_tokenizer), "--device", "cpu",
                          "--max-model-len", str(MAX_MODEL_LEN), "--served-model-name", "tiny",
                          "--data-parallel-size", "2", "--uvicorn-log-level", "warning"],
                         tmp_path_factory.mktemp("dp-server") / "server.log").start()
    yield proc
    proc.stop()


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / 100.0


def _core_pids(server) -> list[int]:
    m = re.search(r"engine core process\(es\) ready \(pids \[([\d, ]+)\]\)", server.log())
    assert m, server.log()
    return [int(p) for p in m.group(1).split(",")]


async def _stream_all(url: str) -> list[list[dict]]:
    async with httpx.AsyncClient(base_url=url, timeout=120) as c:
        async def one(ids):
            body = {"model": "tiny", "prompt": ids, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True,
                    "ignore_eos": True}
            async with c.stream("POST", "/completions", json=body) as r:
                assert r.status_code == 200
                return sse_events([line async for line in r.aiter_lines()])
        return await asyncio.gather(*(one(p) for p in PROMPTS))


def test_both_replicas_serve_greedy_outputs_equal_offline_and_chunks_carry_token_ids(server,
                                                                                  model_without_tokenizer):
    from deltaserve import LLM, SamplingParams

    pids = _core_pids(server)
    assert len(pids) == 2
    before = [_cpu_seconds(p) for p in pids]
    streams = asyncio.run(_stream_all(server.url))
    after = [_cpu_seconds(p) for p in pids]
    served = []
    for events in streams:
        assert events[-1] == "[DONE]"
        chunks = [e["choices"][0] for e in events[:-1]]
        assert all("token_ids" in ch for ch in chunks), chunks[:2]
        assert all(ch["text"] == "" for ch in chunks)
        served.append([t for ch in chunks for t in ch["token_ids"]])
        assert chunks[-1]["finish_reason"] == "length"
        assert sum(1 for ch in chunks if ch["token_ids"]) > 1      # streamed, not only at the end
    llm = LLM(str(model_without_tokenizer), device="cpu", max_model_len=MAX_MODEL_LEN)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    offline = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params,
                                                            use_tqdm=False)]
    assert served == offline
    assert all(len(ids) == MAX_TOKENS for ids in served)
    used = [a - b for a, b in zip(after, before)]
    assert all(u > 0 for u in used), used                            # both replicas ran steps
    r = httpx.post(f"{server.url}/completions", json={"prompt": PROMPTS[0], "max_tokens": 3, "temperature": 0,
                                                        "ignore_eos": True}, timeout=60)
    assert r.json()["choices"][0]["token_ids"] == offline[0][:3]      # non-streamed: the ids too


def test_offline_llm_refuses_data_parallel_by_name():
    from deltaserve import LLM

    with pytest.raises(TypeError, match="data_parallel_size"):
        LLM(data_parallel_size=2)


def test_cached_tokens_cross_the_engine_core_pipe(server):
    """A resent prompt's usage reports the prefix-cache hit the core measured (num_cached_tokens travels in
    the deltas)."""
    ids = [(11 * j) % 200 + 5 for j in range(40)]
    body = {"model": "tiny", "prompt": ids, "max_tokens": 2, "temperature": 0, "ignore_eos": True}
    with httpx.Client(base_url=server.url, timeout=120) as c:
        cached = []
        for _ in range(3):   # replicas are picked by load: every replica has seen the prompt by the third send
            r = c.post("/completions", json=body)
            assert r.status_code == 200, r.text
            cached.append(((r.json()["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0))
    assert cached[0] == 0 and max(cached) == len(ids) - 1, cached
