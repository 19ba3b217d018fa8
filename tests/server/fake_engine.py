"""A scripted stand-in for LLMEngine (same contract), so the server's HTTP/SSE path can be driven with
crafted model output: tool calls, reasoning, tags split across chunks.

The reply is chosen by a marker in the prompt: `[[script:NAME]]` picks SCRIPTS[NAME] (default: a short
plain answer), `[[chunk:K]]` emits K characters per step (default 3), `[[slow]]` sleeps 20 ms per step
and `[[forever]]` never finishes on its own (for disconnect tests); `[[queued:S]]` gives no output for S
seconds (a request waiting to be scheduled). Each step emits one "token" per
choice. Blocks and slots are accounted like a real engine would (2 blocks + 1 slot per running
request), so tests can see them freed.
"""

from __future__ import annotations

import dataclasses
import re
import threading
import time

from deltaserve.outputs import CompletionOutput, Logprob, RequestOutput
from deltaserve.sampling_params import SamplingParams
from deltaserve.tokenizer import Tokenizer

SCRIPTS = {
    "plain": "The answer is 4.",
    "think": "The user wants 2+2. That is 4.\n</think>\n\nThe answer is 4.",
    "json_call": ("I should look up the weather.\n</think>\n\n<tool_call>\n"
                  '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'),
    "xml_in_think": ("Checking the forecast.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
                     "</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n</think>\n\n"),
    "two_calls": ("Two cities.\n</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
                  "</parameter>\n</function>\n</tool_call>\n<tool_call>\n"
                  '{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'),
    "no_think_json": ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'),
    "forever": "tick ",
}


@dataclasses.dataclass
class FakeStats:
    num_running: int
    num_waiting: int
    kv_blocks_total: int
    kv_blocks_used: int
    state_slots_total: int
    state_slots_used: int
    prompt_tokens_total: int
    generation_tokens_total: int


@dataclasses.dataclass
class _Req:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    script: str
    chunk: int
    forever: bool
    slow: bool
    arrival: float
    queued_s: float = 0.0
    steps: int = 0
    first_token_time: float | None = None


class ScriptedEngine:
    BLOCKS_PER_REQUEST = 2

    def __init__(self, model_dir: str, max_model_len: int = 512, num_blocks: int = 64, num_slots: int = 16):
        self.tokenizer = Tokenizer(model_dir)
        self.max_model_len = max_model_len
        self.num_blocks, self.num_slots = num_blocks, num_slots
        self._lock = threading.Lock()
        self._requests: dict[str, _Req] = {}
        self._prompt_tokens = 0
        self._generated = 0
        self.step_calls = 0

    def add_request(self, request_id, prompt, params: SamplingParams, arrival_time=None) -> None:
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise ValueError("prompt is empty")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens; the context limit is {self.max_model_len}")
        bad = [t for t in ids if not 0 <= t < self.tokenizer.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids out of range [0, {self.tokenizer.vocab_size}): {bad[:5]}")
        text = self.tokenizer.decode(ids, skip_special_tokens=False)
        m = re.search(r"\[\[script:(\w+)\]\]", text)
        chunk = re.search(r"\[\[chunk:(\d+)\]\]", text)
        req = _Req(request_id, ids, params, SCRIPTS[m.group(1) if m else "plain"], int(chunk.group(1)) if chunk else 3,
                   "[[forever]]" in text, "[[slow]]" in text, arrival_time or time.monotonic())
        queued = re.search(r"\[\[queued:([\d.]+)\]\]", text)
        req.queued_s = float(queued.group(1)) if queued else 0.0
        with self._lock:
            if request_id in self._requests:
                raise ValueError(f"request id {request_id!r} is already running")
            self._requests[request_id] = req
            self._prompt_tokens += len(ids)

    def abort_request(self, request_ids) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        with self._lock:
            for rid in ids:
                self._requests.pop(rid, None)

    def has_unfinished_requests(self) -> bool:
        with self._lock:
            return bool(self._requests)

    def get_stats(self) -> FakeStats:
        with self._lock:
            running = len(self._requests)
            return FakeStats(running, 0, self.num_blocks, running * self.BLOCKS_PER_REQUEST, self.num_slots, running,
                             self._prompt_tokens, self._generated)

    def step(self) -> list[RequestOutput]:
        self.step_calls += 1
        with self._lock:
            reqs = list(self._requests.values())
        if any(r.slow or r.forever for r in reqs):
            time.sleep(0.02)
        now = time.monotonic()
        held = [r for r in reqs if now < r.arrival + r.queued_s]
        if held:
            time.sleep(0.01)
            reqs = [r for r in reqs if r not in held]
        outputs = []
        for r in reqs:
            r.steps += 1
            r.first_token_time = r.first_token_time or now
            outputs.append(self._output(r, now))
        with self._lock:
            self._generated += sum(r.params.n for r in reqs)
            for out in outputs:
                if out.finished:
                    self._requests.pop(out.request_id, None)
        return outputs

    def _output(self, r: _Req, now: float) -> RequestOutput:
        if r.forever:
            text, done = r.script * r.steps, False
        else:
            total = -(-len(r.script) // r.chunk)
            text, done = r.script[: r.steps * r.chunk], r.steps >= total
        length_cut = r.params.max_tokens is not None and r.steps >= r.params.max_tokens and not done
        finish = "stop" if done else ("length" if length_cut else None)
        token_ids = [(7 * i) % self.tokenizer.vocab_size for i in range(r.steps)]
        outs = []
        for i in range(r.params.n):
            logprobs = None
            if r.params.logprobs is not None:
                logprobs = [{t: Logprob(-0.25, 1), **{(t + k) % self.tokenizer.vocab_size: Logprob(-1.0 - k, k + 1)
                                                       for k in range(1, r.params.logprobs + 1)}}
                            for t in token_ids]
            outs.append(CompletionOutput(i, text, list(token_ids), logprobs, finish))
        metrics = {"arrival_time": r.arrival, "first_token_time": r.first_token_time, "last_token_time": now}
        return RequestOutput(r.request_id, None, r.prompt_ids, None, outs, finish is not None, metrics)
