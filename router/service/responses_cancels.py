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
(``kvhint_router_responses_cancel_ends_total``). A cancel relayed by another replica
reaches this one as a NATS notice (responses_cancel_notices.py) and starts the same grace
here (one published while this replica's link was down: found by asking the worker once
the link is back, responses_cancel_rechecks.py); a stream opened after a cancel seen
lately starts in it.

The same generator never ends a stream whose last event is ``error`` (a generation
error: responses_stream_generator returns after it, without ``response.completed``): the
relays of these streams end them once they relayed a terminal event, whichever.

Nor one whose background task died of any other exception (an engine that died, a
parser's bug: only ``GenerationError`` becomes an ``error`` event): the task's
``finally`` wakes the generator, which finds no new event and waits again, for good
(``_run_background_request_stream``); the response stays ``queued`` in vLLM's store
too (stored so at its creation, replaced by its final response only). Nothing the
worker answers tells such a stream from a slow one, so each stream of a background
response waits at most ``responses.background_idle_s`` for its
next event; past it the router closes the worker's stream and ends the client's with
``response.failed`` (``ResponsesRelay.failure_event``, 504), counted
(``kvhint_router_responses_router_ends_total{reason="background_idle"}``). Unset, a
silent stream ends at ``request_timeout_s`` as any other.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvhint.router.service.metrics import RouterMetrics
    from kvhint.router.service.responses_scan import ResponsesRelay


# Responses cancelled lately remembered by id (~100 bytes each): a stream opened after
# the cancel starts in the grace (CancelWatches.was_cancelled).
MAX_CANCELLED_IDS = 10_000


class CancelWatch:
    """One stream of ``response_id``'s events being relayed (:meth:`CancelWatches.watch`).
    ``fired``: the router closed its worker's stream (``close``) and the relay ends the
    client's itself; ``reason`` says why: ``cancelled`` (its response was cancelled and
    no terminal event came within the grace) or ``background_idle`` (no event within
    ``idle_s``: module doc). ``answer``: the worker's answer to the cancel (the
    response, status ``cancelled``), where it was a JSON object."""

    def __init__(self, watches: CancelWatches, response_id: str,
                 close: Callable[[], None], idle_s: float | None = None,
                 worker_id: str | None = None) -> None:
        self.response_id = response_id
        # The worker it streams from (None: not told): where a recheck asks whether its
        # response was cancelled (responses_cancel_rechecks.py).
        self.worker_id = worker_id
        self.fired = False
        self.reason: str | None = None
        self.answer: dict[str, Any] | None = None
        self.idle_s = idle_s
        self._watches = watches
        self._close = close
        self._timer: asyncio.TimerHandle | None = None
        self._idle_timer: asyncio.TimerHandle | None = None
        self._heard_at = 0.0
        if idle_s is not None:
            loop = asyncio.get_running_loop()
            self._heard_at = loop.time()
            self._idle_timer = loop.call_later(idle_s, self._idle_check)

    def heard(self) -> None:
        """An event came from the worker: its idle wait starts again."""
        if self._idle_timer is not None:
            self._heard_at = asyncio.get_running_loop().time()

    def cancelled(self, answer: dict[str, Any] | None, grace_s: float) -> None:
        """A cancel of its response was relayed: the grace starts (once)."""
        if self._timer is None and not self.fired:
            self.answer = answer
            self._timer = asyncio.get_running_loop().call_later(
                grace_s, self._fire, "cancelled")

    @property
    def settled(self) -> bool:
        """Whether it ends without a cancel's word: fired, or in a cancel's grace."""
        return self.fired or self._timer is not None

    def _idle_check(self) -> None:
        assert self.idle_s is not None
        loop = asyncio.get_running_loop()
        left = self._heard_at + self.idle_s - loop.time()
        if left > 0:  # heard since it was armed: one timer per wait, not per event
            self._idle_timer = loop.call_later(left, self._idle_check)
        else:
            self._idle_timer = None
            self._fire("background_idle")

    def _fire(self, reason: str) -> None:
        if self.fired:
            return
        self.fired, self.reason = True, reason
        self._close()  # wakes the relay's read of a silent worker

    def end(self) -> None:
        """The stream ended (any way): no longer watched."""
        for timer in (self._timer, self._idle_timer):
            if timer is not None:
                timer.cancel()
        self._watches.forget(self)


class CancelWatches:
    """The streams of background responses this router relays, by response id (loop
    thread only; one entry per stream open now, removed as it ends). ``idle_s``: how
    long each waits for an event (None: no bound of its own: module doc)."""

    def __init__(self, grace_s: float, idle_s: float | None = None,
                 on_forgotten: Callable[[], None] | None = None) -> None:
        self.grace_s = grace_s
        self.idle_s = idle_s
        self._by_id: dict[str, dict[CancelWatch, None]] = {}
        # The responses cancelled lately (here or told by another replica), oldest first,
        # at most MAX_CANCELLED_IDS: a stream of one opened later starts in its grace
        # (the id map keeps this for the ids it holds only). Past the bound the oldest is
        # forgotten, counted (``on_forgotten``): a stream of it opened later ends at
        # ``idle_s`` instead.
        self._cancelled: OrderedDict[str, None] = OrderedDict()
        self._on_forgotten = on_forgotten

    def watch(self, response_id: str, close: Callable[[], None],
              worker_id: str | None = None) -> CancelWatch:
        """A stream of ``response_id``'s events starts from ``worker_id``; ``close``
        closes its worker's side. The caller ends the watch (:meth:`CancelWatch.end`)
        when the stream ends, and tells it of each event it relays
        (:meth:`CancelWatch.heard`)."""
        watch = CancelWatch(self, response_id, close, self.idle_s, worker_id)
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
        self._cancelled[response_id] = None
        self._cancelled.move_to_end(response_id)
        if len(self._cancelled) > MAX_CANCELLED_IDS:
            self._cancelled.popitem(last=False)
            if self._on_forgotten is not None:
                self._on_forgotten()
        streams = list(self._by_id.get(response_id, ()))
        for watch in streams:
            watch.cancelled(answer, self.grace_s)
        return len(streams)

    def unsettled(self) -> dict[str, str]:
        """response id -> its worker, of each response with a stream open here, from a
        known worker, that no cancel reached yet (:attr:`CancelWatch.settled`)."""
        found: dict[str, str] = {}
        for response_id, streams in self._by_id.items():
            for watch in streams:
                if not watch.settled and watch.worker_id is not None:
                    found[response_id] = watch.worker_id
                    break
        return found

    def was_cancelled(self, response_id: str) -> bool:
        """Whether a cancel of ``response_id`` was seen lately (:meth:`cancelled`)."""
        return response_id in self._cancelled

    def __len__(self) -> int:
        return sum(len(streams) for streams in self._by_id.values())


def cancel_end(relay: ResponsesRelay, watch: CancelWatch, metrics: RouterMetrics) -> bytes:
    """The event a relay ends a stream with once ``watch`` fired for its response's
    cancel (module doc), counted. (Silence, ``background_idle``, is the worker's failure:
    relay_end.py ends that stream.)"""
    metrics.responses_cancel_ends.inc()
    return relay.cancelled_event(watch.answer)
