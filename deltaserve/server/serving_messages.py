"""POST /v1/messages (Anthropic Messages) and /v1/messages/count_tokens.

The request is mapped onto the chat path (protocol_anthropic.py); the reply's thinking, text and tool calls
become Anthropic content blocks, streamed with Anthropic's event sequence:
message_start, ping, per block content_block_start / content_block_delta... / content_block_stop,
message_delta (stop_reason, usage), message_stop; an engine failure mid-stream is an `error` event.
Errors before the stream are answered in Anthropic's body shape by the app (api_server.error_body).
"""

from __future__ import annotations

import json
import uuid
from typing import Any, AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse

from .async_engine import EngineDeadError
from .chat_blocks import Block, BlockEvent, BlockRun, render_and_count, start_generation
from .protocol import parse_request
from .protocol_anthropic import CountTokensRequest, MessagesRequest
from .state import ServerState, unless_disconnected

STATUS_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


def anthropic_error_body(status: int, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": STATUS_TYPES.get(status, "api_error"), "message": message}}


def tool_use_id() -> str:
    return f"toolu_{uuid.uuid4().hex[:24]}"


async def create_message(state: ServerState, http: Request):
    req: MessagesRequest = parse_request(MessagesRequest, await http.body())
    chat = req.to_chat()
    gen = await start_generation(state, chat, "msg_", max_field="max_tokens", call_id=tool_use_id)
    run = _MessageRun(state, gen, req)
    if req.stream:
        return StreamingResponse(run.stream(), media_type="text/event-stream")
    return JSONResponse(await unless_disconnected(http, run.message()))


async def count_tokens(state: ServerState, http: Request) -> dict[str, int]:
    req: CountTokensRequest = parse_request(CountTokensRequest, await http.body())
    _, token_ids = await render_and_count(state, req.to_chat())
    return {"input_tokens": len(token_ids)}


def _event(name: str, payload: dict[str, Any]) -> str:
    return f"event: {name}\ndata: {json.dumps({'type': name, **payload}, ensure_ascii=False)}\n\n"


def _content_block(block: Block, full: bool) -> dict[str, Any]:
    """The block as content holds it (`full`), or as content_block_start announces it (empty)."""
    if block.kind == "thinking":
        return {"type": "thinking", "thinking": block.text if full else "", "signature": ""}
    if block.kind == "text":
        return {"type": "text", "text": block.text if full else ""}
    return {"type": "tool_use", "id": block.call_id, "name": block.name, "input": block.arguments() if full else {}}


class _MessageRun(BlockRun):
    def __init__(self, state: ServerState, gen, req: MessagesRequest):
        super().__init__(state, gen)
        self.req = req

    def _stop(self) -> dict[str, Any]:
        reason = self.finish_reason
        if reason == "length":
            return {"stop_reason": "max_tokens", "stop_sequence": None}
        if self.assembler.num_tool_calls:
            return {"stop_reason": "tool_use", "stop_sequence": None}
        stop = self.stop_reason
        if isinstance(stop, str) and stop in (self.req.stop_sequences or []):
            return {"stop_reason": "stop_sequence", "stop_sequence": stop}
        return {"stop_reason": "end_turn", "stop_sequence": None}

    def _usage(self) -> dict[str, int]:
        return {"input_tokens": self.gen.num_prompt_tokens, "output_tokens": self.output_tokens}

    def _shell(self) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.state.config.served_model_name}

    async def message(self) -> dict[str, Any]:
        blocks = await self.collect()
        return {**self._shell(), "content": [_content_block(b, full=True) for b in blocks], **self._stop(),
                "usage": self._usage()}

    async def stream(self) -> AsyncIterator[str]:
        start = {**self._shell(), "content": [], "stop_reason": None, "stop_sequence": None,
                 "usage": {"input_tokens": self.gen.num_prompt_tokens, "output_tokens": 0}}
        yield _event("message_start", {"message": start})
        yield _event("ping", {})
        try:
            async for events in self.events():
                for e in events:
                    yield _block_event(e)
        except EngineDeadError as exc:
            yield _event("error", {"error": {"type": "api_error", "message": str(exc)}})
            return
        finally:
            self.gen.group.close()
            self.ticket.release()
        yield _event("message_delta", {"delta": self._stop(), "usage": {"output_tokens": self.output_tokens}})
        yield _event("message_stop", {})


def _block_event(e: BlockEvent) -> str:
    b = e.block
    if e.type == "start":
        return _event("content_block_start", {"index": b.index, "content_block": _content_block(b, full=False)})
    if e.type == "stop":
        return _event("content_block_stop", {"index": b.index})
    if b.kind == "thinking":
        delta = {"type": "thinking_delta", "thinking": e.delta}
    elif b.kind == "text":
        delta = {"type": "text_delta", "text": e.delta}
    else:
        delta = {"type": "input_json_delta", "partial_json": e.delta}
    return _event("content_block_delta", {"index": b.index, "delta": delta})
