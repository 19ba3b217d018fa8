"""The part of a streamed response both generation endpoints share: the SSE loop over an engine request
group, chunk framing, the usage chunk and the error / [DONE] tail."""

from __future__ import annotations

import weakref
from typing import Any, AsyncIterator

from ..outputs import RequestOutput
from .async_engine import EngineDeadError, RequestGroup
from .protocol import APIError
from .state import SSE_DONE, ServerState, WaitingTicket, sse


class StreamingRun:
    """Subclasses set `chunk_object` and implement `_on_output` (remember finals, return the choice
    deltas of one engine output) and `_usage`."""

    chunk_object: str
    state: ServerState
    id: str
    created: int
    ticket: WaitingTicket

    def own(self, group: RequestGroup) -> None:
        """Call once the run is built: if the response is dropped without ever being read (the client left
        before the body or the collecting task started, so no `finally` of ours runs), the group is
        aborted and its waiting slots are given back when the run is collected."""
        weakref.finalize(self, _drop, group, self.ticket)

    async def _outputs(self, group: RequestGroup) -> AsyncIterator[RequestOutput]:
        """The group's outputs; each request stops counting as waiting at its first output, and whatever
        has not finished is aborted when the reader stops."""
        try:
            async for out in group:
                self.ticket.started(out.request_id)
                yield out
        finally:
            group.close()
            self.ticket.release()

    def _on_output(self, out: RequestOutput) -> list[dict[str, Any]]:
        raise NotImplementedError

    def _usage(self) -> dict[str, int]:
        raise NotImplementedError

    def _chunk(self, choices: list[dict[str, Any]], include_usage: bool) -> dict[str, Any]:
        chunk = {"id": self.id, "object": self.chunk_object, "created": self.created,
                 "model": self.state.config.served_model_name, "choices": choices}
        if include_usage:
            chunk["usage"] = None
        return chunk

    async def _stream_outputs(self, group: RequestGroup, include_usage: bool,
                              first: list[dict[str, Any]] | None = None) -> AsyncIterator[str]:
        try:
            if first:
                yield sse(self._chunk(first, include_usage))
            async for out in self._outputs(group):
                choices = self._on_output(out)
                if choices:
                    yield sse(self._chunk(choices, include_usage))
            if include_usage:
                yield sse({**self._chunk([], False), "usage": self._usage()})
        except EngineDeadError as exc:
            yield sse(APIError(str(exc), status=500, type="internal_server_error").body())
        finally:  # also when the reader stops before `_outputs` has started or while it is suspended
            group.close()
            self.ticket.release()
        yield SSE_DONE


def _drop(group: RequestGroup, ticket: WaitingTicket) -> None:
    group.close()
    ticket.release()
