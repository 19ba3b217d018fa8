"""`--stream-interval N`: an unfinished stream's output is forwarded once it has N tokens more than the last
one forwarded (the final one always), and a reader that fell behind gets the newest queued output per request."""

from __future__ import annotations

import asyncio
import itertools

import httpx
import pytest

from deltaserve.outputs import CompletionOutput, RequestOutput
from deltaserve.sampling_params import SamplingParams
from deltaserve.server.async_engine import AsyncEngine

from .fake_engine import ScriptedEngine
from .live_server import lifecycle_server, sse_events

ANSWER = "The answer is 4."     # the scripted engine's plain reply; [[chunk:1]]: one character a step


def _outputs(tokenizer_dir, interval: int) -> list[RequestOutput]:
    engine = ScriptedEngine(str(tokenizer_dir))

    async def main():
        a = AsyncEngine(engine, stream_interval=interval)
        a.start()
        try:
            g = a.open_group()
            g.add("r", engine.tokenizer.encode("[[chunk:1]] [[slow]]"), SamplingParams(max_tokens=None))
            return [out async for out in g]
        finally:
            a.shutdown()

    return asyncio.run(main())


@pytest.mark.parametrize("interval", [1, 4])
def test_unfinished_outputs_are_forwarded_every_interval_tokens(tokenizer_dir, interval):
    outs = _outputs(tokenizer_dir, interval)
    counts = [len(o.outputs[0].token_ids) for o in outs]
    assert outs[-1].finished and outs[-1].outputs[0].text == ANSWER
    assert not any(o.finished for o in outs[:-1])
    assert counts[0] >= 1 and all(b - a >= interval for a, b in itertools.pairwise(counts[:-1])), counts
    assert len(outs) <= len(ANSWER) // interval + 2, counts
    if interval == 1:
        assert len(outs) > len(ANSWER) // 2, counts    # a reader keeping up sees (nearly) every step


def test_a_reader_behind_gets_only_the_newest_output_of_each_request(tokenizer_dir):
    engine = ScriptedEngine(str(tokenizer_dir))

    def out(rid, text, finished=False):
        ids = list(range(len(text)))
        return RequestOutput(rid, None, [1], None, [CompletionOutput(0, text, ids, None, "stop" if finished else None)],
                             finished)

    async def main():
        g = AsyncEngine(engine, stream_interval=2).open_group()
        g._pending.update({"a", "b"})
        for item in (out("a", "x"), out("b", "y"), out("a", "xx"), out("a", "xxx", True), out("b", "yy", True)):
            g._queue.put_nowait(item)
        return [(o.request_id, o.outputs[0].text, o.finished) async for o in g]

    assert asyncio.run(main()) == [("a", "xxx", True), ("b", "yy", True)]


def test_server_stream_interval_coalesces_chunks(tokenizer_dir, tmp_path):
    server = lifecycle_server(tokenizer_dir, tmp_path / "server.log", "--stream-interval", "4").start()
    try:
        with httpx.Client(base_url=server.url, timeout=30) as c, \
                c.stream("POST", "/completions", json={"prompt": "[[chunk:1]] [[slow]]", "stream": True}) as r:
            events = sse_events(r.iter_lines())
    finally:
        server.stop()
    chunks = [e["choices"][0] for e in events[:-1]]
    assert events[-1] == "[DONE]" and "".join(ch["text"] for ch in chunks) == ANSWER
    assert chunks[-1]["finish_reason"] == "stop"
    assert 2 <= len(chunks) <= len(ANSWER) // 4 + 2, [ch["text"] for ch in chunks]
    assert all(len(ch["text"]) >= 4 for ch in chunks[1:-1]), [ch["text"] for ch in chunks]
