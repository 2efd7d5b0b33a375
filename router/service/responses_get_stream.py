"""A ``GET /v1/responses/{id}?stream=true``'s event stream, relayed (responses_api.py
opens it): ended as a POST's stream is (relay_end.py), its tenant slot given back once."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable

from starlette.responses import Response

from kvhint.router.service.relay_end import RelayEnd
from kvhint.router.service.relay_response import RelayResponse
from kvhint.router.service.responses_cancels import CancelWatch
from kvhint.router.service.responses_scan import ResponsesRelay
from kvhint.router.service.runtime import RouterRuntime
from kvhint.router.service.upstream import UpstreamBroken, UpstreamResponse


class Slot:
    """A streamed GET's tenant slot (``give_back`` None: a call that took none), given
    back once: when its answer is whole, or its stream ends, however it ends."""

    def __init__(self, give_back: Callable[[], None] | None) -> None:
        self._give_back = give_back
        # A streamed GET's (one that took a slot).
        self.streamed = give_back is not None
        # Its stream's relay gives it back (:func:`streamed_get`), not the call.
        self.relayed = False

    def give_back(self) -> None:
        give_back, self._give_back = self._give_back, None
        if give_back is not None:
            give_back()



def streamed_get(upstream: UpstreamResponse, headers: dict[str, str],
                 count: Callable[[int], None], relay: ResponsesRelay, watch: CancelWatch,
                 runtime: RouterRuntime, slot: Slot) -> Response:
    """A GET's event stream (responses_api.py ``ResponsesGateway._relayed``); a worker that breaks or
    goes silent mid-stream ends it as a POST's does (forwarding.py): with
    ``response.failed`` (an ``error`` event before ``response.created``), counted."""
    counted = gone = False
    # A client gone is counted 499 even after the terminal event (the stream is left
    # there anyway: :meth:`RelayEnd.read_no_further`).
    end = RelayEnd(relay, watch, upstream, runtime.metrics, served_once_finished=False,
                   max_event_bytes=runtime.settings.stream_event_max_bytes)

    async def chunks() -> AsyncGenerator[bytes, None]:
        nonlocal counted
        try:
            async for chunk in relay.relay(upstream.chunks()):
                end.heard()
                yield chunk
                if end.read_no_further():
                    break
            if (last := end.ended(gone)) is not None:
                yield last
        except UpstreamBroken as exc:
            # Broken by the router's own close for a client gone (on_gone): the client
            # left, the worker did not fail; or for a cancel (or silence) that left it open.
            if (last := end.broken(exc, gone)) is not None:
                yield last
        except asyncio.CancelledError:  # the router stopping: as a POST's (forwarding.py)
            if (last := end.stopping()) is not None:
                yield last
        except GeneratorExit:
            end.left()
            raise
        finally:
            watch.end()
            upstream.close()
            slot.give_back()
            if not counted:
                counted = True
                count(end.status)

    def on_gone(signal: asyncio.Future[None]) -> None:
        nonlocal gone
        if not signal.cancelled() and signal.exception() is None:
            gone = True
            upstream.close()

    async def on_unsent() -> None:
        nonlocal counted
        watch.end()
        slot.give_back()
        if not counted:  # the stream never started (the client left first)
            counted = True
            upstream.close()
            count(499)

    return RelayResponse(chunks(), upstream.status, headers, on_gone, on_unsent)
