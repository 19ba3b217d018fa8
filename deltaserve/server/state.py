"""What every endpoint handler needs (the engine, the served name, limits, parsers on / off) and the small
helpers they share: model-name, prompt-size and context-length checks, the tokenizer pool, the
waiting-request count, request logging, SSE framing, usage, disconnect watching.

CPU-heavy tokenizer work (tokenizing, rendering chat templates, decoding long texts) runs in `WorkerPool`,
never on the event loop: a 10 MB prompt must not stall every other stream. The tokenizer releases the GIL
while it encodes (tokenizer.py), so the loop keeps running beside it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import json
import logging
import os
import queue
import threading
import time
from typing import Any, Awaitable, Callable, TypeVar

from starlette.requests import Request

from ..tokenizer import TooManyTokens
from .async_engine import AsyncEngine
from .lifecycle import DEFAULT_STREAM_INACTIVITY_TIMEOUT
from .logprobs import TokenText
from .metrics import ServerMetrics
from .protocol import APIError, RequestLimits

request_logger = logging.getLogger("deltaserve.requests")

T = TypeVar("T")

DEFAULT_MAX_REQUEST_BYTES = 16 * 2**20
# --max-prompt-chars defaults to max_model_len * this: a text this long is beyond the context for any
# real tokenizer (English averages ~4 characters a token), so it is refused before it is tokenized
PROMPT_CHARS_PER_TOKEN = 32


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    served_model_name: str
    model_path: str | None = None
    api_key: str | None = None
    max_logprobs: int = 20
    tool_call_parser: str = "auto"    # auto | qwen | none
    reasoning_parser: str = "auto"    # auto | qwen3 | none
    # limits
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    max_prompt_chars: int | None = None          # None: max_model_len * PROMPT_CHARS_PER_TOKEN
    max_n: int = 128
    max_stop_sequences: int = 64
    max_tools: int = 128
    max_waiting_requests: int | None = None      # None: no limit
    retry_after_s: int = 1
    tokenizer_workers: int = 2
    # security
    allowed_origins: tuple[str, ...] = ()        # CORS; empty: no CORS headers
    enable_log_requests: bool = False
    max_log_len: int | None = None
    content_special_tokens_as_text: bool = False
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    stream_inactivity_timeout: float | None = DEFAULT_STREAM_INACTIVITY_TIMEOUT  # s a response may sit unread
    stream_interval: int = 1                     # tokens between a stream's chunks (--stream-interval)


class WorkerPool(concurrent.futures.Executor):
    """A fixed number of daemon threads for tokenizer work. Daemon threads: a tokenization still running
    when the server exits is abandoned (it has no side effects) instead of holding the exit up, as
    ThreadPoolExecutor's workers would. A job whose caller was cancelled before it started is skipped.
    On Linux the workers run at a lower CPU priority (`nice`): on a busy CPU a long tokenization yields to
    the engine thread and the event loop, whose delays every stream sees."""

    NICE = 10

    def __init__(self, workers: int, name: str = "deltaserve-tokenizer"):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False
        self._threads = [threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True)
                         for i in range(workers)]
        for t in self._threads:
            t.start()

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> concurrent.futures.Future:
        if self._closed:
            raise RuntimeError("the tokenizer pool is shut down")
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._jobs.put((future, fn, args, kwargs))
        return future

    def _work(self) -> None:
        try:  # Linux: a thread id is a scheduling entity of its own
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self.NICE)
        except (AttributeError, OSError):
            pass
        while (job := self._jobs.get()) is not None:
            future, fn, args, kwargs = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as exc:
                future.set_exception(exc)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        if self._closed:
            return
        self._closed = True
        for _ in self._threads:
            self._jobs.put(None)
        if wait:
            for t in self._threads:
                t.join()


class WaitingRequests:
    """Engine requests accepted but without any output yet (being tokenized, queued, or in their first
    prefill). With a limit, a request that would exceed it is refused with 503 + Retry-After instead of
    queueing without bound. Used from the event loop only."""

    def __init__(self, limit: int | None, retry_after_s: int):
        self.limit, self.retry_after_s = limit, retry_after_s
        self.count = 0

    def admit(self, num_requests: int) -> "WaitingTicket":
        if self.limit is not None and self.count + num_requests > self.limit:
            raise APIError(f"the server is overloaded: {self.count} requests are waiting (limit "
                           f"{self.limit}); retry later", status=503, type="server_error", code="server_overloaded",
                           headers={"Retry-After": str(self.retry_after_s)})
        self.count += num_requests
        return WaitingTicket(self, num_requests)


class WaitingTicket:
    """The waiting slots of one HTTP request; each engine request gives its slot back on its first output."""

    def __init__(self, owner: WaitingRequests, num_requests: int):
        self._owner, self._left = owner, num_requests
        self._started: set[str] = set()

    def started(self, request_id: str) -> None:
        if self._left and request_id not in self._started:
            self._started.add(request_id)
            self._left -= 1
            self._owner.count -= 1

    def release(self) -> None:
        self._owner.count -= self._left
        self._left = 0


class ServerState:
    def __init__(self, engine: AsyncEngine, config: ServerConfig, metrics: ServerMetrics):
        self.engine, self.config, self.metrics = engine, config, metrics
        self.tokenizer = engine.engine.tokenizer
        self.max_model_len = int(engine.engine.max_model_len)
        self.vocab_size = _vocab_size(engine.engine)
        self.max_prompt_chars = config.max_prompt_chars or self.max_model_len * PROMPT_CHARS_PER_TOKEN
        self.limits = RequestLimits(max_logprobs=config.max_logprobs, max_n=config.max_n,
                                    max_stop_sequences=config.max_stop_sequences, max_tools=config.max_tools,
                                    vocab_size=self.vocab_size)
        self.waiting = WaitingRequests(config.max_waiting_requests, config.retry_after_s)
        self.pool = WorkerPool(config.tokenizer_workers)
        self.token_text = TokenText(self.tokenizer)
        self.tools_enabled = _enabled(config.tool_call_parser, "qwen", self._knows("<tool_call>", "<function="))
        self.reasoning_enabled = _enabled(config.reasoning_parser, "qwen3", self._knows("<think>", "</think>"))

    def _knows(self, *markers: str) -> bool:
        """The tokenizer has these tags as tokens, or its chat template mentions them."""
        if self.tokenizer is None:
            return False
        template = self.tokenizer.chat_template or ""
        return any(self.tokenizer.token_to_id(m) is not None or m in template for m in markers)

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.config.served_model_name:
            raise APIError(f"model {model!r} does not exist; this server serves "
                           f"{self.config.served_model_name!r}", param="model", code="model_not_found")

    def check_length(self, num_prompt_tokens: int, max_tokens: int | None, *, prompt_field: str,
                     max_field: str) -> None:
        limit = self.max_model_len
        if num_prompt_tokens >= limit:
            raise _context_error(num_prompt_tokens, limit, prompt_field)
        if max_tokens is not None and num_prompt_tokens + max_tokens > limit:
            raise APIError(f"{max_field}={max_tokens} plus the prompt's {num_prompt_tokens} tokens exceed the "
                           f"model's context of {limit} tokens", param=max_field, code="context_length_exceeded")

    def check_prompt_chars(self, num_chars: int, field: str) -> None:
        """Refuse a text too long to tokenize into the context, before tokenizing it."""
        if num_chars > self.max_prompt_chars:
            raise APIError(f"the {field} text has {num_chars} characters, more than this server accepts "
                           f"({self.max_prompt_chars}, --max-prompt-chars)", param=field, code="prompt_too_long")

    def need_tokenizer(self, field: str) -> Any:
        if self.tokenizer is None:
            raise APIError("this model has no tokenizer: send token ids", param=field)
        return self.tokenizer

    async def in_pool(self, fn: Callable[..., T], *args: Any) -> T:
        """Run tokenizer work in the pool; the event loop keeps serving meanwhile."""
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a text prompt, tokenized in the pool; a text beyond the context is refused without
        building its ids."""
        tokenizer = self.need_tokenizer("prompt")
        try:
            return await self.in_pool(tokenizer.encode, text, add_special_tokens, self.max_model_len)
        except TooManyTokens as exc:
            raise _context_error(exc.num_tokens, self.max_model_len, "prompt") from None

    def log_request(self, request_id: str, prompts: list[tuple[str | None, list[int]]], params: Any) -> None:
        """With --enable-log-requests: the request's prompts (text, else token ids; cut to --max-log-len)
        and sampling parameters. Without it nothing of a request's content is logged."""
        if not self.config.enable_log_requests:
            return
        cut = self.config.max_log_len
        shown = [(text[:cut] if cut is not None else text) if text is not None
                 else (ids[:cut] if cut is not None else ids) for text, ids in prompts]
        request_logger.info("request %s: prompts=%r, prompt_tokens=%s, params=%s", request_id, shown,
                            [len(ids) for _, ids in prompts], params)

    def close(self) -> None:
        self.pool.shutdown(wait=False)


def _vocab_size(engine: Any) -> int | None:
    config = getattr(engine, "model_config", None)
    if config is not None and getattr(config, "vocab_size", None):
        return int(config.vocab_size)
    tokenizer = getattr(engine, "tokenizer", None)
    return tokenizer.vocab_size if tokenizer is not None else None


def _context_error(num_prompt_tokens: int, limit: int, field: str) -> APIError:
    return APIError(f"the prompt has {num_prompt_tokens} tokens but the model's context is {limit} tokens "
                    "(at least one must be left to generate)", param=field, code="context_length_exceeded")


def _enabled(setting: str, name: str, auto: bool) -> bool:
    return auto if setting == "auto" else setting == name


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's usage object; cached_tokens: prompt tokens resumed from the prefix cache."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"


class ClientGone(Exception):
    """The client closed the connection before the (non-streaming) response was ready."""


async def unless_disconnected(request: Request, work: Awaitable[Any]) -> Any:
    """Run `work`; if the client disconnects first, cancel it (its cleanup aborts the engine requests)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)  # let its cleanup abort the requests now
    if task.cancelled() or not task.done():
        raise ClientGone()
    return task.result()


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
