"""The engine core process: one engine (scheduler, runner, sampler, detokenizer and stop rules) stepping in a
busy loop of its own process, fed and read by the API server (server/engine_client.py) over a pipe.

The API server keeps HTTP, validation, tokenization, chat templates and SSE; the core never waits on it.
Each loop turn drains whatever the server sent (adds, aborts, stop), answers the adds in one message (the
engine validates them, so a bad request is refused by the same code as in-process), runs one step when it
has work and sends that step's outputs as one message. Outputs go out as deltas (new token ids, new text,
new logprobs per choice), so a message costs what the step produced, not the length of every sequence.

Detokenization and stop strings stay here, beside the stop check: a stop string ends its sequence in the
step whose token completed it (no wasted tokens, no abort round trip), and the text sent never includes a
tail that could still become a stop string, so the server can forward text deltas as they come.

Death of either side ends the other: the server sees the pipe close or the process exit; the core exits
when the pipe closes (the server died or closed it) or its parent changes, checked at least every
`IDLE_POLL_S` seconds. A tensor-parallel engine's core is rank 0 and starts the other ranks as its own
children (engine/executor.py): a rank that dies is seen by the core within IDLE_POLL_S even while idle
(the runner's `dead_reason`), the core reports "dead" and exits 1, and its exit ends the other ranks (the
engine's shutdown; a rank whose parent is gone leaves by itself).

Message layout (pickles of tuples, lists of ints, strings and the request's SamplingParams; no tensors):
  server -> core: ("add", request_id, token_ids: bytes of array('i'), params, arrival_time, priority)
                  | ("abort", [ids])
                  | ("reset_prefix_cache",) | ("stop",)
  core -> server: ("ready", info) | ("failed", message) | ("acks", [(request_id, error | None)])
                  | ("out", [delta], stats) | ("stats", stats) | ("dead", message)
  delta: (request_id, finished, metrics, prompt_logprobs | None, [(index, new_token_ids, text_delta,
          text_replaced, new_logprobs | None, finish_reason, stop_reason)])
"""

from __future__ import annotations

import array
import logging
import os
import pickle
import signal
import sys
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from ..outputs import RequestOutput

logger = logging.getLogger(__name__)

IDLE_POLL_S = 0.1          # while idle, how often the core wakes to check that its server is still there
PROTOCOL = pickle.HIGHEST_PROTOCOL


def dumps(message: Any) -> bytes:
    return pickle.dumps(message, protocol=PROTOCOL)


def pack_ids(ids: list[int]) -> bytes | list:
    """4 bytes a token; ids that do not fit an int32 (invalid anyway) travel as they are, so the engine's
    validation refuses them with its own message."""
    try:
        return array.array("i", ids).tobytes()
    except (OverflowError, TypeError):
        return list(ids)


def unpack_ids(data: bytes | list) -> list[int]:
    if isinstance(data, list):
        return data
    a = array.array("i")
    a.frombytes(data)
    return a.tolist()


class DeltaEncoder:
    """Turns the engine's cumulative RequestOutputs into deltas against what was already sent."""

    def __init__(self) -> None:
        # request id -> (per choice index: [tokens sent, text sent], prompt logprob positions sent)
        self._sent: dict[str, tuple[dict[int, list[Any]], int]] = {}

    def encode(self, out: RequestOutput) -> tuple:
        sent, plp_sent = self._sent.get(out.request_id) or ({}, 0)
        plp = out.prompt_logprobs
        new_plp = None
        if plp is not None and len(plp) != plp_sent:
            new_plp, plp_sent = plp, len(plp)
        choices = []
        for c in out.outputs:
            mark = sent.get(c.index)
            if mark is None:
                mark = sent[c.index] = [0, ""]
            n_sent, text_sent = mark
            replaced = not c.text.startswith(text_sent)
            text = c.text if replaced else c.text[len(text_sent):]
            lps = None if c.logprobs is None else c.logprobs[n_sent:len(c.token_ids)]
            choices.append((c.index, c.token_ids[n_sent:], text, replaced, lps, c.finish_reason, c.stop_reason))
            mark[0], mark[1] = len(c.token_ids), c.text
        if out.finished:
            self._sent.pop(out.request_id, None)
        else:
            self._sent[out.request_id] = (sent, plp_sent)
        return (out.request_id, out.finished, out.metrics, new_plp, choices, out.num_cached_tokens)

    def forget(self, request_id: str) -> None:
        self._sent.pop(request_id, None)


def engine_info(engine: Any) -> dict[str, Any]:
    """What the server needs to know about the engine without holding it."""
    config = getattr(engine, "model_config", None)
    return {"max_model_len": int(engine.max_model_len),
            "vocab_size": getattr(config, "vocab_size", None) if config is not None else None,
            "stats": engine.get_stats(),
            "prefix_caching": bool(getattr(getattr(engine, "cache", None), "prefix_caching", False))}


def run_engine_core(factory: Callable[[int], Any], conn: Connection, parent_pid: int, index: int = 0,
                    log_level: int | None = None) -> None:
    """The core process's main: build the engine with `factory(index)` (index: the data-parallel replica), then serve `conn` until told to stop or
    the server goes away. Exit status 0 after a stop, 1 when the engine failed."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)     # Ctrl-C reaches the whole group: the server decides
    if log_level is not None:                         # a spawned process starts with logging unconfigured
        logging.basicConfig(level=log_level, format=f"%(levelname)s core{index} %(name)s: %(message)s")
    try:
        engine = factory(index)
        conn.send_bytes(dumps(("ready", engine_info(engine))))
    except BaseException as exc:
        logger.exception("the engine core failed to start")
        _send_quietly(conn, ("failed", f"{type(exc).__name__}: {exc}"))
        sys.exit(1)
    try:
        status = _Core(engine, conn, parent_pid).run()
    except BaseException as exc:
        logger.exception("the engine core failed")
        _send_quietly(conn, ("dead", f"{type(exc).__name__}: {exc}"))
        status = 1
    finally:
        shutdown = getattr(engine, "shutdown", None)     # a tensor-parallel engine's ranks
        if shutdown is not None:
            shutdown()
    sys.exit(status)


class RankDied(RuntimeError):
    """A tensor-parallel rank of the core's engine exited."""


def _send_quietly(conn: Connection, message: Any) -> None:
    try:
        conn.send_bytes(dumps(message))
    except OSError:
        pass


class _Core:
    def __init__(self, engine: Any, conn: Connection, parent_pid: int):
        self.engine, self.conn, self.parent_pid = engine, conn, parent_pid
        self.deltas = DeltaEncoder()
        # a tensor-parallel runner knows when one of its ranks exited (engine/executor.py)
        self.ranks_dead: Callable[[], str | None] | None = getattr(getattr(engine, "runner", None), "dead_reason",
                                                                   None)

    def run(self) -> int:
        engine, conn = self.engine, self.conn
        while True:
            busy = engine.has_unfinished_requests()
            if conn.poll(0 if busy else IDLE_POLL_S):
                if not self._read_inbox():
                    return 0
            elif not busy and os.getppid() != self.parent_pid:
                return 0        # the server died without closing the pipe (its children are left to us)
            if self.ranks_dead is not None and (dead := self.ranks_dead()) is not None:
                raise RankDied(dead)
            if busy or engine.has_unfinished_requests():
                outputs = engine.step()
                if outputs:
                    conn.send_bytes(dumps(("out", [self.deltas.encode(o) for o in outputs], engine.get_stats())))

    def _read_inbox(self) -> bool:
        """Apply every message waiting; False when the server asked to stop or has gone."""
        acks, aborted = [], False
        try:
            while True:
                message = pickle.loads(self.conn.recv_bytes())
                kind = message[0]
                if kind == "add":
                    _, rid, ids, params, arrival, priority = message
                    try:
                        extra = {"priority": priority} if priority else {}   # engines without the policy
                        self.engine.add_request(rid, unpack_ids(ids), params, arrival, **extra)
                        acks.append((rid, None))
                    except Exception as exc:   # the engine's validation: the server answers 400
                        acks.append((rid, (type(exc).__name__, str(exc))))
                elif kind == "abort":
                    self.engine.abort_request(message[1])
                    aborted = True
                elif kind == "reset_prefix_cache":
                    self.engine.reset_prefix_cache()
                elif kind == "stop":
                    return False
                if not self.conn.poll(0):
                    break
        except EOFError:
            return False
        finally:
            if acks:
                _send_quietly(self.conn, ("acks", acks))
            if aborted and not self.engine.has_unfinished_requests():   # no step follows to carry the stats
                _send_quietly(self.conn, ("stats", self.engine.get_stats()))
        return True
