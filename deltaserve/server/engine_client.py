"""The API server's side of the engine core processes (engine/core_process.py): starts N cores (data
parallel replicas, one engine each), and looks to AsyncEngine like one engine: `add_request` picks a core and
sends the request, `step()` waits for whatever the cores sent and returns it as RequestOutputs.

Requests go to the core with the fewest outstanding requests (`pick_core` is the hook for prefix-cache
affinity later). The cores send deltas; this side keeps each live request's accumulated tokens, text and
logprobs and hands out cumulative RequestOutputs, the shape the handlers read from an in-process engine.
Adds are acknowledged by the core after its engine validated them: `add_request` returns a future that
`RequestGroup.accepted()` awaits, so a bad request still fails with 400 before anything streams.

A core that exits, closes its pipe or reports its engine dead makes `step()` raise and `dead_reason()` say
why; AsyncEngine then fails every request and the server exits 1 (lifecycle.py).

The cores are not daemonic processes: a core may start children of its own (the tensor-parallel ranks,
engine/executor.py), which a daemonic process cannot. What the daemon flag gave is kept otherwise: a core
exits when the server goes (its pipe closes, or its parent changes: core_process.py), and the server's exit
stops and joins them (`close`, also registered with atexit, before multiprocessing's join of its children).
"""

from __future__ import annotations

import atexit
import concurrent.futures
import dataclasses
import logging
import multiprocessing
import os
import pickle
import queue
import threading
import time
import types
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import Any

from ..engine.core_process import dumps, pack_ids, run_engine_core
from ..outputs import CompletionOutput, RequestOutput
from ..sampling_params import SamplingParams
from ..tokenizer import Tokenizer
from .async_engine import EngineDeadError

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 600.0     # a core that neither reports ready nor fails in this long is given up
STEP_WAIT_S = 0.1           # step() returns empty-handed after this long, so shutdown is noticed
STOP_WAIT_S = 5.0           # a core asked to stop gets this long before it is killed


class EngineCoreError(EngineDeadError):
    """An engine core process failed to start, died, or reported its engine dead."""


@dataclasses.dataclass(frozen=True)
class EngineCoreSpec:
    """How to build the engine inside each core: `factory(replica_index)` is a picklable callable returning
    an engine (e.g. a functools.partial of a module-level function); `tokenizer_dir` is read by the server for
    tokenizing and chat templates (None: token-id prompts only)."""

    factory: Callable[[int], Any]
    tokenizer_dir: str | None
    data_parallel_size: int = 1


@dataclasses.dataclass
class _Choice:
    token_ids: list[int]
    text: str = ""
    logprobs: list | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclasses.dataclass
class _Live:
    core: int
    prompt_token_ids: list[int]
    choices: dict[int, _Choice] = dataclasses.field(default_factory=dict)
    prompt_logprobs: list | None = None


class _Core:
    """One core process and its pipe; sends go through a thread, so the event loop never blocks on a
    core that is busy in a long step."""

    def __init__(self, index: int, process: multiprocessing.Process, conn: Connection):
        self.index, self.process, self.conn = index, process, conn
        self.outstanding = 0                    # requests sent and not yet finished (event loop + reader)
        self.info: dict[str, Any] = {}
        self.stats: Any = None
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._sender = threading.Thread(target=self._send_loop, name=f"deltaserve-core{index}-send", daemon=True)

    def start_sending(self) -> None:
        self._sender.start()

    def send(self, message: Any) -> None:
        self._outbox.put(dumps(message))

    def _send_loop(self) -> None:
        while (data := self._outbox.get()) is not None:
            try:
                self.conn.send_bytes(data)
            except OSError:   # the core is gone: the reader reports it
                return

    def close(self) -> None:
        self._outbox.put(None)


class EngineCoreClient:
    """EngineLike over N core processes (see the module docstring)."""

    def __init__(self, spec: EngineCoreSpec):
        if spec.data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be >= 1, got {spec.data_parallel_size}")
        self.spec = spec
        self.tokenizer = Tokenizer.from_dir(spec.tokenizer_dir) if spec.tokenizer_dir else None
        self._cores: list[_Core] = []
        self._live: dict[str, _Live] = {}
        self._acks: dict[str, concurrent.futures.Future] = {}
        self._lock = threading.Lock()          # guards _live / _acks / outstanding counts
        self._dead: str | None = None
        self._closing = False
        self.max_model_len = 0
        self.model_config: Any = None

    # ---- lifecycle ---------------------------------------------------------------------------
    def start(self, timeout: float = START_TIMEOUT_S) -> EngineCoreClient:
        """Start every core and wait until each has built its engine; raises EngineCoreError if one fails."""
        ctx = multiprocessing.get_context("spawn")   # no fork of a process holding threads and torch state
        atexit.register(self.close)
        for i in range(self.spec.data_parallel_size):
            ours, theirs = ctx.Pipe(duplex=True)
            process = ctx.Process(target=run_engine_core, args=(self.spec.factory, theirs, os.getpid(), i, _root_log_level()),
                                  name=f"deltaserve-engine-core-{i}", daemon=False)
            process.start()
            theirs.close()
            self._cores.append(_Core(i, process, ours))
        deadline = time.monotonic() + timeout
        try:
            for core in self._cores:
                core.info = self._wait_ready(core, deadline)
                core.stats = core.info.get("stats")
        except BaseException:
            self.close()
            raise
        for core in self._cores:
            core.start_sending()
        info = self._cores[0].info
        self.max_model_len = min(c.info["max_model_len"] for c in self._cores)
        if info.get("vocab_size") is not None:
            self.model_config = types.SimpleNamespace(vocab_size=info["vocab_size"])
        logger.info("%d engine core process(es) ready (pids %s)", len(self._cores),
                    [c.process.pid for c in self._cores])
        return self

    def _wait_ready(self, core: _Core, deadline: float) -> dict[str, Any]:
        while time.monotonic() < deadline:
            if core.conn.poll(0.2):
                try:
                    message = pickle.loads(core.conn.recv_bytes())
                except EOFError:
                    break
                if message[0] == "ready":
                    return message[1]
                raise EngineCoreError(f"engine core {core.index} failed to start: {message[1]}")
            if not core.process.is_alive():
                break
        if core.process.is_alive():
            raise EngineCoreError(f"engine core {core.index} did not start within {deadline:.0f} s")
        raise EngineCoreError(f"engine core {core.index} exited during start-up (status {core.process.exitcode})")

    def close(self) -> None:
        """Ask every core to stop, wait a little, kill what is left (a second call does nothing)."""
        if self._closing:
            return
        self._closing = True
        for core in self._cores:   # through the sender thread: one writer per pipe
            if core._sender.is_alive():
                core.send(("stop",))
            else:
                try:
                    core.conn.send_bytes(dumps(("stop",)))
                except OSError:
                    pass
            core.close()
        deadline = time.monotonic() + STOP_WAIT_S
        for core in self._cores:
            core.process.join(max(0.0, deadline - time.monotonic()))
            if core.process.is_alive():
                core.process.kill()
                core.process.join(1.0)
            core.conn.close()

    def dead_reason(self) -> str | None:
        """Why the engine cannot serve (a core exited or reported failure), or None."""
        if self._dead is None and not self._closing:
            for core in self._cores:
                if not core.process.is_alive():
                    self._dead = f"engine core {core.index} exited (status {core.process.exitcode})"
        return self._dead

    # ---- requests ----------------------------------------------------------------------------
    def pick_core(self, request_id: str, token_ids: list[int]) -> int:
        """The core for a new request: the one with the fewest outstanding requests. The place for
        prefix-cache affinity (send a prompt where its prefix is cached) once the cores report it."""
        return min(self._cores, key=lambda c: c.outstanding).index

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    arrival_time: float | None = None, *, priority: int = 0) -> concurrent.futures.Future:
        """Send a request; the future completes when its core has accepted it (raises what the engine's
        validation raised)."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer: send token ids")
            prompt = self.tokenizer.encode(prompt)
        ids = list(prompt)
        if self._dead is not None:
            raise EngineCoreError(self._dead)
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if request_id in self._live:
                raise ValueError(f"request id {request_id!r} is already in use")
            core = self._cores[self.pick_core(request_id, ids)]
            self._live[request_id] = _Live(core.index, ids)
            self._acks[request_id] = future
            core.outstanding += 1
        core.send(("add", request_id, pack_ids(ids), params,
                   time.monotonic() if arrival_time is None else arrival_time, priority))
        return future

    def abort_request(self, request_ids: Any) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        by_core: dict[int, list[str]] = {}
        with self._lock:   # forgotten now: the abort's own output (if the engine makes one) is not wanted
            for rid in ids:
                live = self._live.pop(rid, None)
                if live is not None:
                    by_core.setdefault(live.core, []).append(rid)
                    self._cores[live.core].outstanding -= 1
        for index, rids in by_core.items():
            self._cores[index].send(("abort", rids))

    def reset_prefix_cache(self) -> bool:
        """Every core drops its cached prefixes (as the engine does: now or as its next step starts); False
        when prefix caching is off."""
        if not all(c.info.get("prefix_caching") for c in self._cores):
            return False
        for core in self._cores:
            core.send(("reset_prefix_cache",))
        return True

    def has_unfinished_requests(self) -> bool:
        """Always True: the stepping thread keeps reading the pipes (step() blocks on them), so stats and a
        core's death arrive while no request runs, and each step's outputs take one thread hop to their
        queues (a reader thread handing over to the stepping thread would add a GIL switch, up to 5 ms)."""
        return True

    def get_stats(self) -> Any:
        """The cores' latest stats (sent with each step's outputs), summed over the replicas."""
        stats = [c.stats for c in self._cores if c.stats is not None]
        if len(stats) <= 1:
            return stats[0] if stats else None
        return _sum_stats(stats)

    @property
    def outstanding(self) -> list[int]:
        return [c.outstanding for c in self._cores]

    # ---- outputs -----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Whatever the cores have sent, waiting up to STEP_WAIT_S for a first message (possibly returning
        nothing); raises EngineCoreError once a core has died."""
        if self._dead is not None:
            raise EngineCoreError(self._dead)
        by_conn = {c.conn: c for c in self._cores}
        outputs: list[RequestOutput] = []
        for conn in wait(list(by_conn), STEP_WAIT_S):
            core = by_conn[conn]
            while True:
                try:
                    message = pickle.loads(conn.recv_bytes())
                except (EOFError, OSError):
                    self._dead = f"engine core {core.index} closed its pipe (exited)"
                    raise EngineCoreError(self._dead) from None
                self._handle(core, message, outputs)
                if not conn.poll(0):
                    break
        if not outputs and self.dead_reason() is not None:
            raise EngineCoreError(self._dead)
        return outputs

    def _handle(self, core: _Core, message: tuple, outputs: list[RequestOutput]) -> None:
        kind = message[0]
        if kind == "out":
            _, deltas, stats = message
            core.stats = stats
            for delta in deltas:
                out = self._apply(core, delta)
                if out is not None:
                    outputs.append(out)
        elif kind == "acks":
            for rid, error in message[1]:
                with self._lock:
                    future = self._acks.pop(rid, None)
                    if error is not None and self._live.pop(rid, None) is not None:
                        core.outstanding -= 1
                if future is not None:
                    future.set_exception(_rebuild(error)) if error is not None else future.set_result(None)
        elif kind == "stats":
            core.stats = message[1]
        elif kind == "dead":
            self._dead = f"engine core {core.index}: the engine loop failed: {message[1]}"
            raise EngineCoreError(self._dead)

    def _apply(self, core: _Core, delta: tuple) -> RequestOutput | None:
        rid, finished, metrics, prompt_logprobs, choices, num_cached = delta
        with self._lock:
            live = self._live.get(rid)
            if live is None:
                return None
            if finished:
                del self._live[rid]
                core.outstanding -= 1
        if prompt_logprobs is not None:
            live.prompt_logprobs = prompt_logprobs
        outs = []
        for index, new_ids, text, replaced, new_lps, finish_reason, stop_reason in choices:
            c = live.choices.get(index)
            if c is None:
                c = live.choices[index] = _Choice([], logprobs=None if new_lps is None else [])
            c.token_ids.extend(new_ids)
            c.text = text if replaced else c.text + text
            if new_lps is not None:
                c.logprobs.extend(new_lps)
            c.finish_reason, c.stop_reason = finish_reason, stop_reason
            outs.append(CompletionOutput(index, c.text, list(c.token_ids),
                                         None if c.logprobs is None else list(c.logprobs), finish_reason,
                                         stop_reason))
        plp = None if live.prompt_logprobs is None else list(live.prompt_logprobs)
        return RequestOutput(rid, None, live.prompt_token_ids, plp, outs, finished, metrics, num_cached)


def _root_log_level() -> int | None:
    """The server's logging level for the cores, when the server has configured logging."""
    root = logging.getLogger()
    return root.level if root.handlers else None


def _rebuild(error: tuple[str, str]) -> BaseException:
    name, message = error
    return ValueError(message) if name in ("ValueError", "NoTokenizerError") else EngineCoreError(f"{name}: {message}")


def _sum_stats(stats: list[Any]) -> Any:
    """Field-wise sum of the replicas' stats dataclasses (dict fields summed per key)."""
    first = stats[0]
    if not dataclasses.is_dataclass(first):
        return first
    values = {}
    for f in dataclasses.fields(first):
        items = [getattr(s, f.name) for s in stats]
        if isinstance(items[0], dict):
            merged: dict = {}
            for d in items:
                for k, v in d.items():
                    merged[k] = merged.get(k, 0) + v
            values[f.name] = merged
        elif isinstance(items[0], (int, float)):
            values[f.name] = sum(items)
        else:
            values[f.name] = items[0]
    return dataclasses.replace(first, **values)
