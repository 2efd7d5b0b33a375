"""Waiting for a worker's response to start while the client may leave.

Contract: a request to a worker that nobody waits for any more is cancelled if still on
its way, and its response closed if it opened anyway, so its connection goes back to the
pool (and vLLM aborts the request); a failure nobody reads is marked seen.
"""

from __future__ import annotations

import asyncio

from kvhint.router.service.upstream import UpstreamResponse, UpstreamTimeout, UpstreamUnavailable


class ClientGone(Exception):
    """The client of a non-streamed request left before its worker answered."""


async def until_open(opening: asyncio.Future[UpstreamResponse],
                     client_gone: asyncio.Future[None] | None) -> UpstreamResponse:
    """The worker's response once it starts, or :class:`ClientGone` (the request to the
    worker cancelled) if the client leaves first."""
    if client_gone is None:
        return await opening
    await asyncio.wait((opening, client_gone), return_when=asyncio.FIRST_COMPLETED)
    if opening.done() or client_gone.cancelled():
        return await opening
    opening.cancel()
    try:
        late = await opening
    except (asyncio.CancelledError, UpstreamUnavailable, UpstreamTimeout):
        pass
    else:  # it opened before the cancel took: give its connection back
        late.close()
    raise ClientGone


def drop_opening(opening: asyncio.Future[UpstreamResponse]) -> None:
    """Let go of a request to a worker nobody waits for any more: cancel it if it is still
    on its way, close its response if it opened anyway (now or before the cancel took),
    and mark a failure as seen (asyncio logs an exception never retrieved)."""
    def settle(done: asyncio.Future[UpstreamResponse]) -> None:
        if done.cancelled():
            return
        if done.exception() is None:
            done.result().close()
    opening.cancel()
    opening.add_done_callback(settle)
