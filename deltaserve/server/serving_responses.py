"""POST /v1/responses (OpenAI Responses, nothing stored): the request is mapped onto the chat path
(protocol_responses.py); the reply's reasoning, text and tool calls become `reasoning`, `message` and
`function_call` output items. Streamed as Responses events, each with its `sequence_number`:
response.created, response.in_progress, per item response.output_item.added, its part / text /
argument events, response.output_item.done, then response.completed (response.incomplete when
max_output_tokens cut it); an engine failure mid-stream is an `error` event.
"""

from __future__ import annotations

import json
from typing import Any, AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse

from .async_engine import EngineDeadError
from .chat_blocks import Block, BlockEvent, BlockRun, start_generation
from .protocol import parse_request
from .protocol_responses import ResponsesRequest
from .state import ServerState, unless_disconnected


async def create_response(state: ServerState, http: Request):
    req: ResponsesRequest = parse_request(ResponsesRequest, await http.body())
    chat = req.to_chat()
    gen = await start_generation(state, chat, "resp_", max_field="max_output_tokens")
    run = _ResponseRun(state, gen, req)
    if req.stream:
        return StreamingResponse(run.stream(), media_type="text/event-stream")
    return JSONResponse(await unless_disconnected(http, run.response()))


def _item_id(block: Block, run_id: str) -> str:
    prefix = {"thinking": "rs", "text": "msg", "tool_call": "fc"}[block.kind]
    return f"{prefix}_{run_id[len('resp_'):]}_{block.index}"


def _part(block: Block, text: str) -> dict[str, Any]:
    if block.kind == "thinking":
        return {"type": "reasoning_text", "text": text}
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


class _ResponseRun(BlockRun):
    def __init__(self, state: ServerState, gen, req: ResponsesRequest):
        super().__init__(state, gen)
        self.req = req
        self._seq = 0

    def _item(self, block: Block, done: bool) -> dict[str, Any]:
        status = "completed" if done else "in_progress"
        item_id = _item_id(block, self.id)
        if block.kind == "thinking":
            return {"type": "reasoning", "id": item_id, "summary": [], "status": status,
                    "content": [_part(block, block.text)] if done else []}
        if block.kind == "text":
            return {"type": "message", "id": item_id, "role": "assistant", "status": status,
                    "content": [_part(block, block.text)] if done else []}
        return {"type": "function_call", "id": item_id, "call_id": block.call_id, "name": block.name,
                "arguments": block.text if done else "", "status": status}

    def _response(self, status: str, output: list[dict[str, Any]]) -> dict[str, Any]:
        req = self.req
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        body = {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "model": self.state.config.served_model_name, "output": output, "error": None,
                "incomplete_details": incomplete, "instructions": req.instructions,
                "tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
                "tool_choice": (req.tool_choice.model_dump() if hasattr(req.tool_choice, "model_dump")
                                else req.tool_choice or "auto"),
                "parallel_tool_calls": req.parallel_tool_calls is not False, "temperature": req.temperature,
                "top_p": req.top_p, "max_output_tokens": req.max_output_tokens, "previous_response_id": None,
                "store": False, "metadata": req.metadata or {}, "text": {"format": {"type": "text"}},
                "reasoning": {"effort": req.reasoning.effort if req.reasoning else None, "summary": None}}
        if status in ("completed", "incomplete"):
            # no *_tokens_details: cached and reasoning tokens are not counted apart
            body["usage"] = {"input_tokens": self.gen.num_prompt_tokens, "output_tokens": self.output_tokens,
                             "total_tokens": self.gen.num_prompt_tokens + self.output_tokens}
        return body

    def _status(self) -> str:
        return "incomplete" if self.finish_reason == "length" else "completed"

    async def response(self) -> dict[str, Any]:
        blocks = await self.collect()
        return self._response(self._status(), [self._item(b, done=True) for b in blocks])

    # ---- streaming -----------------------------------------------------------------------------
    def _event(self, name: str, payload: dict[str, Any]) -> str:
        self._seq += 1
        data = {"type": name, "sequence_number": self._seq - 1, **payload}
        return f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    async def stream(self) -> AsyncIterator[str]:
        yield self._event("response.created", {"response": self._response("in_progress", [])})
        yield self._event("response.in_progress", {"response": self._response("in_progress", [])})
        try:
            async for events in self.events():
                for e in events:
                    for chunk in self._block_events(e):
                        yield chunk
        except EngineDeadError as exc:
            yield self._event("error", {"code": "internal_server_error", "message": str(exc), "param": None})
            return
        finally:
            self.gen.group.close()
            self.ticket.release()
        status = self._status()
        name = "response.completed" if status == "completed" else "response.incomplete"
        output = [self._item(b, done=True) for b in self.assembler.blocks]
        yield self._event(name, {"response": self._response(status, output)})

    def _block_events(self, e: BlockEvent) -> list[str]:
        b = e.block
        where = {"item_id": _item_id(b, self.id), "output_index": b.index}
        if e.type == "start":
            out = [self._event("response.output_item.added", {"output_index": b.index,
                                                              "item": self._item(b, done=False)})]
            if b.kind != "tool_call":
                out.append(self._event("response.content_part.added",
                                       {**where, "content_index": 0, "part": _part(b, "")}))
            return out
        if e.type == "delta":
            if b.kind == "tool_call":
                return [self._event("response.function_call_arguments.delta", {**where, "delta": e.delta})]
            name = "response.reasoning_text.delta" if b.kind == "thinking" else "response.output_text.delta"
            extra = {} if b.kind == "thinking" else {"logprobs": []}
            return [self._event(name, {**where, "content_index": 0, "delta": e.delta, **extra})]
        if b.kind == "tool_call":
            out = [self._event("response.function_call_arguments.done",
                               {**where, "name": b.name, "arguments": b.text})]
        else:
            name = "response.reasoning_text.done" if b.kind == "thinking" else "response.output_text.done"
            extra = {} if b.kind == "thinking" else {"logprobs": []}
            out = [self._event(name, {**where, "content_index": 0, "text": b.text, **extra}),
                   self._event("response.content_part.done", {**where, "content_index": 0,
                                                              "part": _part(b, b.text)})]
        out.append(self._event("response.output_item.done", {"output_index": b.index,
                                                             "item": self._item(b, done=True)}))
        return out
