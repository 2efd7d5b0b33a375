"""The boundary between the scheduler thread and the transport (NATS) thread.

Bounded deques in both directions; nothing here blocks. ``deque.append``/``popleft`` are
atomic in CPython, so each deque has one producer thread and one consumer thread and
needs no lock. Everything dropped for lack of room is counted.

- inbound (transport -> scheduler): hints, donor advice, snapshot requests;
- outbound (scheduler -> transport): outcomes, hold releases, KV event batches (with
  their sequence number), the latest status figures and the latest snapshot.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from kvhint.schemas import HintOutcome, HoldsReleased, OutcomeStatus


@dataclass(slots=True)
class Inbound:
    kind: str  # "hints" | "advice" | "snapshot"
    data: bytes
    received_at: float  # time.monotonic() when the transport got it
    reply_to: str | None = None
    # Set under Mailbox.lock by the scheduler thread when it takes the message; the
    # transport answers ``deferred`` under the same lock only while it is not taken, so
    # a deferred always precedes the final outcome on the wire.
    taken: bool = False


@dataclass(frozen=True, slots=True)
class EventBatchOut:
    seq: int
    ts: float
    events: list[Any]  # vLLM event objects; encoded on the transport thread


@dataclass(frozen=True, slots=True)
class SnapshotOut:
    """A consistent copy of the index at event ``seq``, served in pages by the transport
    (which orders the raw nodes itself, off the scheduler thread)."""

    seq: int
    raw_blocks: list[tuple[int, int | None, int, dict[str, int] | None]]
    sessions: list[tuple[str, list[int]]]
    reply_to: str | None
    cursor: int
    limit: int
    error: str | None = None


@dataclass(slots=True)
class MailboxCounters:
    inbound_dropped: int = 0
    outcomes_dropped: int = 0
    releases_dropped: int = 0
    event_batches_dropped: int = 0
    events_dropped: int = 0


def _noop() -> None:
    return None


def peek_advice_id(data: bytes | str) -> str:
    """The ``advice_id`` of a (possibly malformed) advice message, or ""."""
    try:
        raw = msgspec.json.decode(data)
    except msgspec.DecodeError:
        return ""
    return str(raw.get("advice_id", "")) if isinstance(raw, dict) else ""


def pop_oldest(queue: deque[Any]) -> Any:
    """popleft, or None when the other thread emptied the deque meanwhile."""
    try:
        return queue.popleft()
    except IndexError:
        return None


@dataclass
class Mailbox:
    inbound_limit: int
    outcome_limit: int
    event_batch_limit: int
    inbound: deque[Inbound] = field(default_factory=deque)
    outcomes: deque[HintOutcome] = field(default_factory=deque)
    releases: deque[HoldsReleased] = field(default_factory=deque)
    event_batches: deque[EventBatchOut] = field(default_factory=deque)
    snapshots: deque[SnapshotOut] = field(default_factory=deque)
    counters: MailboxCounters = field(default_factory=MailboxCounters)
    # Latest status figures from the scheduler thread (replaced wholesale; read by the
    # heartbeat).
    status: dict[str, Any] = field(default_factory=dict)
    # Set by the transport: wakes its publisher when something was queued outbound.
    notify_transport: Callable[[], None] = _noop
    # Set by the connector: wakes an idle engine so it runs a scheduler step.
    wake_engine: Callable[[], None] = _noop
    # Set on the scheduler thread whenever a hook ran; the transport uses it to tell an
    # idle engine from a busy one.
    last_engine_activity: float = 0.0
    # Set on the scheduler thread: when a TTL or deadline next falls due (clock seconds).
    next_deadline: float | None = None
    # Set on the scheduler thread: when connector stats held back by their interval
    # should be shipped (wall-clock seconds), so an idle engine is woken for one step.
    stats_flush_at: float | None = None
    # Set on the scheduler thread: when a status refresh it skipped (rate limit) is due
    # (wall-clock seconds), so an idle engine is woken for one step to make it.
    status_refresh_at: float | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    # Action ids the scheduler thread has given a terminal outcome (the newest
    # ``outcome_limit``; under ``lock``): the transport's early ``deferred`` for a repeat
    # must not follow the terminal outcome the repeat will be answered with.
    answered: OrderedDict[str, None] = field(default_factory=OrderedDict)

    # --- transport side -----------------------------------------------------------------

    def post(self, item: Inbound) -> bool:
        """Queue an inbound message for the scheduler thread and wake the engine if this
        is the first one waiting; False (counted) when the inbox is full."""
        if len(self.inbound) >= self.inbound_limit:
            self.counters.inbound_dropped += 1
            return False
        was_empty = not self.inbound
        self.inbound.append(item)
        if was_empty:
            self.wake_engine()
        return True

    # --- scheduler side -----------------------------------------------------------------

    def take(self) -> Inbound | None:
        """The oldest inbound message, marked taken (scheduler thread)."""
        item = pop_oldest(self.inbound)
        if item is not None:
            with self.lock:
                item.taken = True
        return item

    def put_outcomes(self, outcomes: list[HintOutcome]) -> None:
        if not outcomes:
            return
        with self.lock:
            for outcome in outcomes:
                if outcome.status is not OutcomeStatus.DEFERRED and outcome.action_id:
                    self.answered[outcome.action_id] = None
                    self.answered.move_to_end(outcome.action_id)
            while len(self.answered) > self.outcome_limit:
                self.answered.popitem(last=False)
        for outcome in outcomes:
            if len(self.outcomes) >= self.outcome_limit and pop_oldest(self.outcomes) is not None:
                with self.lock:
                    self.counters.outcomes_dropped += 1
            self.outcomes.append(outcome)
        self.notify_transport()

    def put_releases(self, message: HoldsReleased) -> None:
        """Queue a release report (bounded like outcomes: the oldest go, counted)."""
        if len(self.releases) >= self.outcome_limit and pop_oldest(self.releases) is not None:
            with self.lock:
                self.counters.releases_dropped += 1
        self.releases.append(message)
        self.notify_transport()

    def put_events(self, batch: EventBatchOut) -> None:
        if len(self.event_batches) >= self.event_batch_limit:
            dropped = pop_oldest(self.event_batches)
            if dropped is not None:  # None: the transport drained it meanwhile
                self.drop_event_batch(dropped)
        self.event_batches.append(batch)
        self.notify_transport()

    def put_snapshot(self, snapshot: SnapshotOut) -> None:
        self.snapshots.append(snapshot)
        self.notify_transport()

    def drop_event_batch(self, batch: EventBatchOut) -> None:
        """The transport gave up on a batch (counted as dropped)."""
        with self.lock:
            self.counters.event_batches_dropped += 1
            self.counters.events_dropped += len(batch.events)
