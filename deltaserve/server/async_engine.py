"""Runs one LLMEngine in a background thread and hands its outputs to asyncio consumers.

`engine.step()` blocks on compute, so it runs in a thread of its own that sleeps on a condition while
the engine has nothing to do. Requests are added from the event loop (`LLMEngine.add_request` is
thread-safe and validates synchronously, so a bad request fails before anything is streamed). Each
HTTP request owns a `RequestGroup`: one asyncio queue fed by the engine thread through
`loop.call_soon_threadsafe`, covering the engine requests of that HTTP request (one per prompt). Closing
a group that has not finished (client gone, handler cancelled) aborts its requests at once, which frees
their KV blocks and state slots. `fail` ends a group from the event loop with an error its consumer sees
after the outputs already queued (server shutdown, a client that stopped reading): its engine requests are
aborted at once.

The engine is either an LLMEngine stepped by this thread (`--no-engine-process`, tests with scripted
engines) or an EngineCoreClient (engine_client.py), whose `step()` returns what the engine core processes
sent; the routing, metrics and stream rules here are the same for both. Streams: each engine step gives at
most one output per request. With `stream_interval` N > 1 an unfinished request's output is forwarded only
once it has N tokens more than the last one forwarded, and a consumer that fell behind reads only the newest
of the outputs queued for a request (they are cumulative), so a busy server sends fewer, larger chunks; with 1
(the default) every step's output reaches the consumer.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
import weakref
from typing import Any, AsyncIterator, Protocol

from ..outputs import RequestOutput
from ..sampling_params import SamplingParams
from .metrics import ServerMetrics

logger = logging.getLogger(__name__)


class EngineLike(Protocol):
    """What the server needs from an engine (LLMEngine's contract)."""

    tokenizer: Any
    max_model_len: int

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    arrival_time: float | None = None) -> None: ...
    def abort_request(self, request_ids: Any) -> None: ...
    def step(self) -> list[RequestOutput]: ...
    def has_unfinished_requests(self) -> bool: ...
    def get_stats(self) -> Any: ...


class EngineDeadError(RuntimeError):
    """The request cannot complete on the engine (the engine loop failed, or one of the subclasses below);
    the handlers turn it into an error chunk (streams) or an error response."""


class ServerShuttingDownError(EngineDeadError):
    """The server is shutting down and the request did not finish within the shutdown timeout."""


class StreamStalledError(EngineDeadError):
    """The client stopped reading its response for longer than the stream inactivity timeout."""


@dataclasses.dataclass
class _Route:
    """Where the engine thread sends one engine request's outputs."""

    group: "RequestGroup"
    forwarded_tokens: int = -1          # tokens of the last output forwarded (-1: none yet)
    num_tokens: dict[int, int] = dataclasses.field(default_factory=dict)   # per choice index
    last_token_time: dict[int, float] = dataclasses.field(default_factory=dict)
    first_token_seen: bool = False


class AsyncEngine:
    def __init__(self, engine: EngineLike, metrics: ServerMetrics | None = None, stream_interval: int = 1):
        if stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1, got {stream_interval}")
        self.engine = engine
        self.metrics = metrics
        self.stream_interval = stream_interval
        self._cond = threading.Condition()
        self._routes: dict[str, _Route] = {}   # guarded by _cond
        self._stop = False
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None  # set when the engine loop died
        self._groups: weakref.WeakSet[RequestGroup] = weakref.WeakSet()  # open groups (event loop only)

    # ---- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="deltaserve-engine", daemon=True)
            self._thread.start()

    def shutdown(self, timeout: float = 30.0) -> None:
        with self._cond:
            self._stop = True
            ids = list(self._routes)
            self._cond.notify_all()
        if ids:
            self._safe_abort(ids)
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    @property
    def healthy(self) -> bool:
        dead = getattr(self.engine, "dead_reason", None)     # engine core processes: one has exited
        if dead is not None and dead() is not None:
            return False
        return self.error is None and self._thread is not None and self._thread.is_alive()

    # ---- requests ----------------------------------------------------------------------------
    def open_group(self) -> "RequestGroup":
        group = RequestGroup(self, asyncio.get_running_loop())
        self._groups.add(group)
        return group

    @property
    def num_open_groups(self) -> int:
        return sum(1 for g in list(self._groups) if g.active)

    def fail_open_groups(self, make_error: Any) -> int:
        """Event loop only: end every unfinished group with `make_error()` and abort its engine requests.
        Returns how many were ended."""
        groups = [g for g in list(self._groups) if g.active]
        for g in groups:
            g.fail(make_error())
        return len(groups)

    def abort_stalled(self, timeout: float) -> int:
        """Event loop only: fail every unfinished group whose consumer has been away from its queue (blocked
        sending to a client that does not read) for more than `timeout` seconds. Returns how many."""
        now = time.monotonic()
        stalled = [g for g in list(self._groups) if g.stalled_for(now) > timeout]
        for g in stalled:
            logger.warning("aborting %s: its client has not read for over %.0f s", g.request_ids, timeout)
            g.fail(StreamStalledError(f"the client did not read the response for over {timeout:g} s"))
        return len(stalled)

    def _add(self, group: "RequestGroup", request_id: str, prompt: str | list[int], params: SamplingParams,
             priority: int = 0) -> Any:
        """Returns what the engine's add_request returned: None, or (engine core processes) a future that
        completes when the engine accepted the request."""
        if self.error is not None:
            raise EngineDeadError(f"the engine loop has failed: {self.error!r}")
        with self._cond:
            self._routes[request_id] = _Route(group)
            try:
                if priority:     # only then: engines without priority scheduling need not take the keyword
                    accepted = self.engine.add_request(request_id, prompt, params, priority=priority)
                else:
                    accepted = self.engine.add_request(request_id, prompt, params)
            except BaseException:
                del self._routes[request_id]
                raise
            self._cond.notify_all()
        return accepted

    def _abort(self, request_ids: list[str]) -> None:
        with self._cond:
            for rid in request_ids:
                self._routes.pop(rid, None)
        self._safe_abort(request_ids)
        with self._cond:
            self._cond.notify_all()  # the engine may have abort outputs to hand out

    def _safe_abort(self, request_ids: list[str]) -> None:
        try:
            self.engine.abort_request(request_ids)
        except Exception:
            logger.exception("aborting %s failed", request_ids)

    # ---- the engine thread -------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while not self._stop and not self.engine.has_unfinished_requests():
                        self._cond.wait()
                    if self._stop:
                        return
                for out in self.engine.step():
                    self._dispatch(out)
        except BaseException as exc:  # the engine is in an unknown state: fail everyone, stop stepping
            logger.exception("the engine loop failed")
            self.error = exc
            self._fail_all(exc)

    def _dispatch(self, out: RequestOutput) -> None:
        with self._cond:
            route = self._routes.get(out.request_id)
            if route is not None and out.finished:
                del self._routes[out.request_id]
        if route is None:
            return  # aborted by its consumer meanwhile
        if self.metrics is not None:
            self._observe(route, out)
        if self.stream_interval > 1 and not out.finished:
            tokens = max((len(c.token_ids) for c in out.outputs), default=0)
            if route.forwarded_tokens >= 0 and tokens - route.forwarded_tokens < self.stream_interval:
                return      # cumulative outputs: the next one forwarded carries these tokens too
            route.forwarded_tokens = tokens
        route.group._put(out)

    def _observe(self, route: _Route, out: RequestOutput) -> None:
        times = out.metrics or {}
        first, last, arrival = times.get("first_token_time"), times.get("last_token_time"), times.get("arrival_time")
        if not route.first_token_seen and first is not None and arrival is not None:
            route.first_token_seen = True
            self.metrics.time_to_first_token.observe(max(0.0, first - arrival))
        for c in out.outputs:
            seen, now = route.num_tokens.get(c.index, 0), len(c.token_ids)
            prev_time = route.last_token_time.get(c.index)
            if now > seen and prev_time is not None and last is not None and seen > 0:
                gap = max(0.0, last - prev_time) / (now - seen)
                for _ in range(now - seen):
                    self.metrics.inter_token_latency.observe(gap)
            if now > seen and last is not None:
                route.last_token_time[c.index] = last
            route.num_tokens[c.index] = now
        if out.finished:
            self.metrics.requests.labels(outcome=_outcome(out)).inc()
            if arrival is not None and last is not None:
                self.metrics.e2e_latency.observe(max(0.0, last - arrival))

    def _fail_all(self, exc: BaseException) -> None:
        with self._cond:
            routes = list(self._routes.items())
            self._routes.clear()
        for _, route in routes:
            route.group._put(EngineDeadError(f"the engine loop has failed: {exc!r}"))


def _outcome(out: RequestOutput) -> str:
    reasons = {c.finish_reason for c in out.outputs}
    for reason in ("abort", "length", "stop"):
        if reason in reasons:
            return reason
    return "stop"


class RequestGroup:
    """The engine requests of one HTTP request, read as one stream of RequestOutputs."""

    def __init__(self, engine: AsyncEngine, loop: asyncio.AbstractEventLoop):
        self._engine, self._loop = engine, loop
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._pending: set[str] = set()
        self._accepting: list[tuple[str, Any]] = []   # (request id, future) of adds not yet accepted
        self._closed = False
        self._failed = False
        self.aborted = False
        self._reading = False                      # the consumer is waiting on the queue
        self._away_since = time.monotonic()        # when it last left the queue (to send what it got)

    @property
    def request_ids(self) -> list[str]:
        return sorted(self._pending)

    def add(self, request_id: str, prompt: str | list[int], params: SamplingParams, priority: int = 0) -> None:
        """Submit one request; raises ValueError (bad request) before anything runs, here or (engine core
        processes) from `accepted()`."""
        accepted = self._engine._add(self, request_id, prompt, params, priority)
        self._pending.add(request_id)
        if accepted is not None:
            self._accepting.append((request_id, accepted))

    async def accepted(self) -> None:
        """Wait until the engine has accepted every request added; raises the first refusal (ValueError for
        a bad request). Immediate for an in-process engine, whose add_request validates synchronously."""
        waiting, self._accepting = self._accepting, []
        for _, future in waiting:
            try:
                await asyncio.wrap_future(future)
            except ValueError:
                raise
            except Exception as exc:
                raise EngineDeadError(f"the engine could not take the request: {exc}") from None

    def _put(self, item: RequestOutput | BaseException) -> None:  # called from the engine thread
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    @property
    def finished(self) -> bool:
        return not self._pending

    @property
    def active(self) -> bool:
        """Unfinished and not failed: its engine requests may still be running."""
        return bool(self._pending) and not self._failed

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._iterate()

    def stalled_for(self, now: float) -> float:
        """Seconds the consumer has been away from the queue while the group is unfinished (0 while it waits
        on the queue): a stream whose send to the client blocks shows here."""
        if self._reading or not self.active:
            return 0.0
        return now - self._away_since

    async def _iterate(self) -> AsyncIterator[RequestOutput]:
        while self._pending:
            self._reading = True
            try:
                item = await self._queue.get()
            finally:
                self._reading, self._away_since = False, time.monotonic()
            for got in (self._newest(item) if self._engine.stream_interval > 1 else (item,)):
                if isinstance(got, BaseException):
                    self._pending.clear()
                    raise got
                if got.finished:
                    self._pending.discard(got.request_id)
                yield got

    def _newest(self, item: RequestOutput | BaseException) -> list[RequestOutput | BaseException]:
        """`item` and whatever else is queued, keeping only the newest output of each request (outputs are
        cumulative), in the order of those newest outputs; an error ends the list."""
        if self._queue.empty():
            return [item]
        items: dict[Any, RequestOutput | BaseException] = {}
        while True:
            key = item.request_id if isinstance(item, RequestOutput) else object()
            items.pop(key, None)     # re-insert: a newer output replaces and moves behind the others
            items[key] = item
            if isinstance(item, BaseException) or self._queue.empty():
                break
            item = self._queue.get_nowait()
        return list(items.values())

    def fail(self, error: BaseException) -> None:
        """Event loop only: abort the unfinished engine requests now; the consumer gets `error` after the
        outputs already queued (idempotent)."""
        if not self.active:
            return
        self._failed = self.aborted = True
        pending = list(self._pending)
        self._engine._abort(pending)
        if self._engine.metrics is not None:
            self._engine.metrics.requests.labels(outcome="abort").inc(len(pending))
        self._queue.put_nowait(error)

    def close(self) -> None:
        """Abort whatever has not finished (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._engine._groups.discard(self)
        if self._pending and not self._failed:
            self.aborted = True
            pending, self._pending = list(self._pending), set()
            self._engine._abort(pending)
            if self._engine.metrics is not None:
                self._engine.metrics.requests.labels(outcome="abort").inc(len(pending))
