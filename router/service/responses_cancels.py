"""Streams of a background response that its cancel would leave without an end.

vLLM 0.32 streams a background response's events (to the ``stream: true`` POST that
started it, or to ``GET /v1/responses/{id}?stream=true``) out of its event store until
one of them is ``response.completed`` (responses/serving.py
``responses_background_stream_generator``). A cancel (``POST .../cancel``,
``cancel_responses``) cancels the task that makes the events (``task.cancel()``): none
comes after it, ``response.completed`` never, and every such stream stays open and
silent until its client leaves, or the router's ``request_timeout_s`` (600 s) breaks it
with no terminal event at all.

So once this router has relayed a cancel the worker accepted (2xx), each stream of that
response it relays waits at most ``responses.cancel_grace_s`` for a terminal event; past
it the router closes the worker's stream and ends the client's with one of its own
(``ResponsesRelay.cancelled_event``), counted
(``kvhint_router_responses_cancel_ends_total``). A cancel relayed by another replica is
not seen here: a stream it leaves open ends at ``request_timeout_s``, as before.

The same generator never ends a stream whose last event is ``error`` (a generation
error: responses_stream_generator returns after it, without ``response.completed``): the
relays of these streams end them once they relayed a terminal event, whichever.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvhint.router.service.metrics import RouterMetrics
    from kvhint.router.service.responses_scan import ResponsesRelay


class CancelWatch:
    """One stream of ``response_id``'s events being relayed (:meth:`CancelWatches.watch`).
    ``fired``: its response was cancelled and no terminal event came within the grace:
    its worker's stream was closed (``close``) and the relay ends the client's itself.
    ``answer``: the worker's answer to the cancel (the response, status ``cancelled``),
    where it was a JSON object."""

    def __init__(self, watches: CancelWatches, response_id: str,
                 close: Callable[[], None]) -> None:
        self.response_id = response_id
        self.fired = False
        self.answer: dict[str, Any] | None = None
        self._watches = watches
        self._close = close
        self._timer: asyncio.TimerHandle | None = None

    def cancelled(self, answer: dict[str, Any] | None, grace_s: float) -> None:
        """A cancel of its response was relayed: the grace starts (once)."""
        if self._timer is None and not self.fired:
            self.answer = answer
            self._timer = asyncio.get_running_loop().call_later(grace_s, self._fire)

    def _fire(self) -> None:
        self.fired = True
        self._close()  # wakes the relay's read of a silent worker

    def end(self) -> None:
        """The stream ended (any way): no longer watched."""
        if self._timer is not None:
            self._timer.cancel()
        self._watches.forget(self)


class CancelWatches:
    """The streams of background responses this router relays, by response id (loop
    thread only; one entry per stream open now, removed as it ends)."""

    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self._by_id: dict[str, dict[CancelWatch, None]] = {}

    def watch(self, response_id: str, close: Callable[[], None]) -> CancelWatch:
        """A stream of ``response_id``'s events starts; ``close`` closes its worker's
        side. The caller ends the watch (:meth:`CancelWatch.end`) when the stream ends."""
        watch = CancelWatch(self, response_id, close)
        self._by_id.setdefault(response_id, {})[watch] = None
        return watch

    def forget(self, watch: CancelWatch) -> None:
        streams = self._by_id.get(watch.response_id)
        if streams is not None:
            streams.pop(watch, None)
            if not streams:
                del self._by_id[watch.response_id]

    def cancelled(self, response_id: str, answer: dict[str, Any] | None) -> int:
        """The worker accepted a cancel of ``response_id``: its streams' grace starts;
        how many streams."""
        streams = list(self._by_id.get(response_id, ()))
        for watch in streams:
            watch.cancelled(answer, self.grace_s)
        return len(streams)

    def __len__(self) -> int:
        return sum(len(streams) for streams in self._by_id.values())


def cancel_end(relay: ResponsesRelay, watch: CancelWatch, metrics: RouterMetrics) -> bytes:
    """The event a relay ends a stream with once ``watch`` fired (module doc), counted."""
    metrics.responses_cancel_ends.inc()
    return relay.cancelled_event(watch.answer)
