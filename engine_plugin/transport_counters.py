"""What the NATS transport counts, and nats-py's async errors counted and reported.

nats-py reports some losses only through its ``error_cb``: a subscription whose pending
messages pass its limits (a slow consumer) has the inbound hint, advice or snapshot
request discarded by the client, and the callback is all that says so. Every one is
counted (``kvhint:nats_errors{kind}``) and reported by a warning at most every
:data:`NATS_ERROR_WARN_EVERY_S` per kind, with how many came since the last one.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from nats.errors import SlowConsumerError

from kvhint.engine_plugin.config import LOGGER_NAME

logger = logging.getLogger(LOGGER_NAME)

NATS_ERROR_WARN_EVERY_S = 30.0
SLOW_CONSUMER = "slow_consumer"
OTHER_NATS_ERROR = "other"


@dataclass(slots=True)
class TransportCounters:
    connects: int = 0
    disconnects: int = 0
    event_batches_published: int = 0
    events_published: int = 0
    outcomes_published: int = 0
    releases_published: int = 0
    heartbeats_published: int = 0
    snapshot_pages: int = 0
    # Publishes NATS refused, by what: a queued outcome, release report or event batch
    # goes back to its queue's head and is retried; a heartbeat or a snapshot page is
    # lost (the next heartbeat follows; the router asks for the page again).
    queued_publish_errors: int = 0
    heartbeat_publish_errors: int = 0
    snapshot_reply_errors: int = 0
    # Queued outcomes and release reports past NATS max_payload even made smaller
    # (transport_oversize): lost.
    oversize_dropped: int = 0
    # nats-py's async errors (error_cb), by kind: a slow consumer's message is discarded.
    nats_slow_consumer_errors: int = 0
    nats_other_errors: int = 0
    inbound_rejected: int = 0
    deferred_at_once: int = 0
    # Repeats (same action id) that found the inbox full: answered their first copy's
    # terminal outcome again, or nothing new while the first copy was in flight.
    repeats_answered_again: int = 0
    repeats_in_flight: int = 0
    # Kept snapshots dropped before their time to stay within snapshot_keep_blocks (a
    # router still paging one starts over from a new snapshot).
    snapshots_dropped: int = 0
    # Kept snapshots let go by their count or age bound (the same for a router still
    # paging one).
    snapshots_evicted: int = 0
    # Snapshot requests no page could answer: no reply subject, or no connection.
    snapshot_requests_unanswered: int = 0
    # The events stream was missing and could not be created (nor had anyone else made
    # it meanwhile): batches go out as plain NATS messages, not kept for replay.
    stream_create_failures: int = 0
    # JetStream did not answer whether the events stream exists (not enabled on the
    # server, or timed out): batches go out as plain NATS messages, not kept for replay.
    jetstream_unavailable: int = 0
    # Exceptions other than NATS or socket errors caught in a round of the publisher (a
    # bug: what it was publishing may be lost; the publisher goes on after a pause).
    internal_errors: int = 0
    # Outcomes the transport answered itself (inbox full: rejected; engine busy:
    # deferred), by (action type, status): the type bounded (outcome_counts: one from the
    # wire may be any string); changed and read under the mailbox's lock.
    outcomes: Counter[tuple[str, str]] = field(default_factory=Counter)

    def outcomes_seen(self, lock: threading.Lock) -> dict[tuple[str, str], int]:
        with lock:
            return dict(self.outcomes)


def nats_error_kind(exc: BaseException) -> str:
    """The bounded ``kind`` of a nats-py async error."""
    return SLOW_CONSUMER if isinstance(exc, SlowConsumerError) else OTHER_NATS_ERROR


def note_internal_error(counters: TransportCounters, what: str,
                        exc: BaseException | bool = True) -> None:
    """An exception the transport caught (a bug; call from the ``except``, or pass it as
    ``exc``): counted as kvhint:internal_errors, with the plugin hooks' own, and logged
    with its traceback the first time, at DEBUG after."""
    counters.internal_errors += 1
    logger.log(logging.ERROR if counters.internal_errors == 1 else logging.DEBUG,
               "kvhint: %s (kvhint:internal_errors)", what, exc_info=exc)


@dataclass(slots=True)
class NatsErrorLog:
    """Counts nats-py's async errors into ``counters`` and warns about them, rate-limited
    per kind (the transport thread calls :meth:`note`)."""

    counters: TransportCounters
    clock: Callable[[], float] = time.monotonic
    every_s: float = NATS_ERROR_WARN_EVERY_S
    _warned_at: dict[str, float] = field(default_factory=dict)
    _since: Counter[str] = field(default_factory=Counter)

    def note(self, exc: BaseException) -> str:
        kind = nats_error_kind(exc)
        if kind == SLOW_CONSUMER:
            self.counters.nats_slow_consumer_errors += 1
        else:
            self.counters.nats_other_errors += 1
        self._since[kind] += 1
        now = self.clock()
        last = self._warned_at.get(kind)
        if last is not None and now - last < self.every_s:
            logger.debug("kvhint: NATS error: %s", exc)
            return kind
        self._warned_at[kind] = now
        count, self._since[kind] = self._since[kind], 0
        if kind == SLOW_CONSUMER:
            logger.warning("kvhint: NATS slow consumer: %d inbound message(s) discarded by "
                           "the client since the last warning (kvhint:nats_errors); last: %s",
                           count, exc)
        else:
            logger.warning("kvhint: %d NATS error(s) since the last warning "
                           "(kvhint:nats_errors); last: %s", count, exc)
        return kind
