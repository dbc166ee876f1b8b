"""Server-sent event streams for the native and OpenAI routes: when to write a frame, and a
response that gives up on clients that stop reading.

Memory stays bounded whatever the client does: frames are built only when the response is
ready to write one, from the requests' folded state (`changes`), so a client that reads
slowly gets fewer, larger frames (cumulative frames: only the newest matters; incremental
frames: the deltas since the previous frame), never a backlog of frames. A client that
does not read at all for `--send-timeout` seconds has its requests aborted.

A stream's HTTP response starts when every item passed every check (the tokenizer's, the
scheduler's admission: queue limit, grammar compile), which the scheduler says with an
empty admission output (scheduler.admit); rejections before that are plain HTTP errors,
failures after it an error event in the stream.
"""

from __future__ import annotations

import asyncio
import logging
from typing import AsyncIterator

from starlette.responses import StreamingResponse

from api_proc.boundary import dumps
from api_proc.state import RequestState

log = logging.getLogger(__name__)

DONE = "data: [DONE]\n\n"
# An SSE comment (clients skip it), sent after KEEPALIVE_S seconds without a frame: a
# stream queued behind others has its HTTP response at once (once every check passed) and
# keeps its connection busy while it waits, so no client read timeout (httpx's default is
# 5 s) fires before its first token.
KEEPALIVE = ": keep-alive\n\n"
KEEPALIVE_S = 3.0


def sse(obj: dict) -> str:
    return f"data: {dumps(obj)}\n\n"


async def changes(states: list[RequestState]) -> AsyncIterator[list[int]]:
    """Yields the indices of the states that have something new to show (outputs folded
    in), first those that have something already, until every state finished; an empty
    list after KEEPALIVE_S seconds without news (the caller sends KEEPALIVE). A state whose
    only output is the scheduler's admission has nothing to show yet."""
    event = asyncio.Event()
    for s in states:
        s.listener = event
    for s in states:
        s.take()
    first = [i for i, s in enumerate(states) if not s.admitted_only]
    if first:
        yield first
    remaining = {i for i, s in enumerate(states) if not s.finished}
    while remaining:
        changed = [i for i in sorted(remaining) if states[i].pending]
        if not changed:
            event.clear()
            try:
                await asyncio.wait_for(event.wait(), KEEPALIVE_S)
            except asyncio.TimeoutError:
                yield []
            continue
        for i in changed:
            states[i].take()
        shown = [i for i in changed if not states[i].admitted_only]
        if shown:
            yield shown
        remaining -= {i for i in changed if states[i].finished}


class _Stalled(Exception):
    pass


class SSEResponse(StreamingResponse):
    """A text/event-stream response whose every write must complete within send_timeout
    (uvicorn blocks a write while the client's socket buffer is full). On a stall the
    frame generator is closed (its cleanup aborts the requests) and the connection is
    dropped."""

    def __init__(self, frames: AsyncIterator[str], send_timeout: float,
                 media_type: str = "text/event-stream"):
        """media_type: another line format streamed alike (Ollama's NDJSON)."""
        super().__init__(frames, media_type=media_type)
        self.send_timeout = send_timeout

    async def stream_response(self, send) -> None:
        async def timed(message: dict) -> None:
            try:
                await asyncio.wait_for(send(message), self.send_timeout)
            except asyncio.TimeoutError:
                raise _Stalled from None
        try:
            await timed({"type": "http.response.start", "status": self.status_code,
                         "headers": self.raw_headers})
            async for chunk in self.body_iterator:
                await timed({"type": "http.response.body", "body": chunk.encode("utf-8"),
                             "more_body": True})
            await timed({"type": "http.response.body", "body": b"", "more_body": False})
        except _Stalled:
            log.warning("a stream's client read nothing for %g s (--send-timeout): its "
                        "requests are aborted and the connection dropped", self.send_timeout)
            await self.body_iterator.aclose()
