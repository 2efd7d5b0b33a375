"""The ASGI side of a streamed answer: a response that relays each chunk as it comes and
notices a client that goes away, without a task group per response."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Awaitable, Callable

from starlette.responses import Response
from starlette.types import Receive, Scope, Send


class RelayResponse(Response):
    """A streamed response that forwards each relayed chunk as it comes.

    Starlette's StreamingResponse opens an anyio task group per response on ASGI < 2.4
    (uvicorn reports 2.3) to notice a client that goes away; one plain task watching
    ``receive`` does the same for a fraction of the cost. When the client is gone, the
    watcher's ``on_client_gone`` callback runs at once (it closes the upstream request, so
    a relay waiting on a silent worker wakes up); when the response ends any way, the
    relay generator is closed, which runs its accounting.
    """

    def __init__(self, chunks: AsyncGenerator[bytes, None], status_code: int,
                 headers: dict[str, str],
                 on_client_gone: Callable[[asyncio.Future[None]], None],
                 on_unsent: Callable[[], Awaitable[None]]) -> None:
        # No body attribute: init_headers then sets no Content-Length (chunked transfer).
        self.status_code = status_code
        self.media_type = headers.get("content-type", "text/event-stream")
        self.background = None
        self.init_headers(headers)
        self._chunks = chunks
        self._on_client_gone = on_client_gone
        self._on_unsent = on_unsent

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        gone = asyncio.ensure_future(wait_disconnect(receive))
        gone.add_done_callback(self._on_client_gone)
        try:
            await send({"type": "http.response.start", "status": self.status_code,
                        "headers": self.raw_headers})
            async for chunk in self._chunks:
                if gone.done():
                    return
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            gone.remove_done_callback(self._on_client_gone)
            gone.cancel()
            # Closing a generator never started runs none of its code, its accounting
            # included (cancelled while sending the headers): on_unsent settles it then,
            # and is a no-op once the relay has accounted.
            await self._chunks.aclose()
            await self._on_unsent()


async def wait_disconnect(receive: Receive) -> None:
    """Returns when the client disconnects (the request body already read)."""
    while (await receive())["type"] != "http.disconnect":
        pass
