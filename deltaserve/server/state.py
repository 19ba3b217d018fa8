"""What every endpoint handler needs (the engine, the served name, limits, parsers on / off) and the small
helpers they share: model-name and context-length checks, SSE framing, usage, disconnect watching."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from typing import Any, Awaitable

from starlette.requests import Request

from .async_engine import AsyncEngine
from .lifecycle import DEFAULT_STREAM_INACTIVITY_TIMEOUT
from .logprobs import TokenText
from .metrics import ServerMetrics
from .protocol import APIError


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    served_model_name: str
    model_path: str | None = None
    api_key: str | None = None
    max_logprobs: int = 20
    tool_call_parser: str = "auto"    # auto | qwen | none
    reasoning_parser: str = "auto"    # auto | qwen3 | none
    stream_inactivity_timeout: float | None = DEFAULT_STREAM_INACTIVITY_TIMEOUT  # s a response may sit unread


class ServerState:
    def __init__(self, engine: AsyncEngine, config: ServerConfig, metrics: ServerMetrics):
        self.engine, self.config, self.metrics = engine, config, metrics
        self.tokenizer = engine.engine.tokenizer
        self.max_model_len = int(engine.engine.max_model_len)
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
            raise APIError(f"the prompt has {num_prompt_tokens} tokens but the model's context is {limit} tokens "
                           "(at least one must be left to generate)", param=prompt_field,
                           code="context_length_exceeded")
        if max_tokens is not None and num_prompt_tokens + max_tokens > limit:
            raise APIError(f"{max_field}={max_tokens} plus the prompt's {num_prompt_tokens} tokens exceed the "
                           f"model's context of {limit} tokens", param=max_field, code="context_length_exceeded")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self.tokenizer is None:
            raise APIError("this model has no tokenizer: send token ids", param="prompt")
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)


def _enabled(setting: str, name: str, auto: bool) -> bool:
    return auto if setting == "auto" else setting == name


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


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
