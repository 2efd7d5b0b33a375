"""The boundary between the scheduler thread and the transport (NATS) thread.

Bounded deques in both directions; nothing here blocks. ``deque.append``/``popleft`` are
atomic in CPython, so the deques need no lock (outcomes have two producers: the scheduler
thread, and the transport's early ``deferred`` and inbox-full answers; a bound may then
be passed by one for a moment). What the two threads decide together (taken, answered,
in flight) is under ``lock``. Everything dropped for lack of room is counted.

- inbound (transport -> scheduler): hints, donor advice, snapshot requests;
- outbound (scheduler -> transport): outcomes, hold releases, KV event batches (with
  their sequence number), the latest status figures and the latest snapshot.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import msgspec

from kvhint.schemas import DONOR_ACTION_TYPE, HintOutcome, HoldsReleased, OutcomeStatus
from kvhint.schemas._codec import HOSTILE_INPUT_ERRORS
from kvhint.schemas.advice import echoed_advice_id

# What an answer is remembered under (``Mailbox.answered``, ``Mailbox.in_flight``): a hint
# action's id, or a donor advice's id kept apart from it, as the executor keeps them (an
# advice and a hint action may share an id). Before, they shared one key: an advice's
# answer replaced the hint action's, and a repeat of that hint finding the inbox full was
# answered with the advice's ``kv.donor`` outcome (its own never applied nor answered).
AnswerKey = str | tuple[str, str]


def answer_key(action_id: str, action_type: str) -> AnswerKey:
    return (DONOR_ACTION_TYPE, action_id) if action_type == DONOR_ACTION_TYPE else action_id


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
    # The hints message decoded by the transport when it came (None: another kind, or
    # not decoded), so the scheduler thread does not decode it again.
    decoded: Any = None


# What a drained vLLM event holds in memory, estimated high: the event with its lists and
# parent hash (~250 bytes), and each token id and block hash in them (an int object and
# its list slot: 36-44 bytes); extra keys (LoRA, multimodal, cache salt: rare) are counted
# at the same rate. A BlockStored carries its block's token ids, so a batch of an 8k-token
# prefill holds ~0.45 MB (estimated ~0.6 MB).
EVENT_BYTES = 320
EVENT_ITEM_BYTES = 48


def event_batch_bytes(events: Sequence[Any]) -> int:
    """The memory ``events`` hold, estimated (above): what bounds the batches waiting for
    the transport (``event_buffer_bytes``)."""
    items = 0
    for event in events:
        items += (len(getattr(event, "token_ids", None) or ())
                  + len(getattr(event, "block_hashes", None) or ())
                  + len(getattr(event, "extra_keys", None) or ()))
    return EVENT_BYTES * len(events) + EVENT_ITEM_BYTES * items


@dataclass(frozen=True, slots=True)
class EventBatchOut:
    seq: int
    ts: float
    events: list[Any]  # vLLM event objects; encoded on the transport thread
    # Set by Mailbox.put_events: the batch's estimated size (event_batch_bytes), and the
    # sizes of every batch put up to and including this one, so the size of what waits
    # is read from the two ends of the queue (Mailbox.queued_event_bytes).
    nbytes: int = 0
    upto: int = 0


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
    # Final outcomes dropped for lack of room: the router never learns them (a loss,
    # alerted on). ``deferred`` ones dropped (the transport's early answers, and the
    # engine's own for an action not yet done) are in ``deferred_dropped`` only: a final
    # outcome still follows each, so nothing is lost.
    outcomes_dropped: int = 0
    deferred_dropped: int = 0
    # Action ids forgotten from the in-flight set to keep it bounded (a repeat of one
    # arriving while the inbox is full is then answered ``rejected``).
    in_flight_forgotten: int = 0
    # Answered action ids forgotten to bound that memory (a repeat of one arriving while
    # the inbox is full is then answered ``rejected``, not its first outcome again).
    answered_forgotten: int = 0
    releases_dropped: int = 0
    event_batches_dropped: int = 0
    events_dropped: int = 0


def _noop() -> None:
    return None


def peek_advice_id(data: bytes | str) -> str:
    """The ``advice_id`` of a (possibly malformed) advice message, or "" (also for one
    too long to echo: ``schemas.advice.echoed_advice_id``)."""
    try:
        raw = msgspec.json.decode(data)
    except (msgspec.DecodeError, *HOSTILE_INPUT_ERRORS):  # not JSON, nested too deeply
        return ""
    return echoed_advice_id(str(raw.get("advice_id", ""))) if isinstance(raw, dict) else ""


def pop_oldest(queue: deque[Any]) -> Any:
    """popleft, or None when the other thread emptied the deque meanwhile."""
    try:
        return queue.popleft()
    except IndexError:
        return None


@dataclass(frozen=True, slots=True)
class RepeatAnswers:
    """How a hints message that found the inbox full is answered, per action id."""

    again: list[HintOutcome]  # answered before: that terminal outcome, sent again
    in_flight: list[AnswerKey]  # queued or being applied: its own outcome follows
    new: list[AnswerKey]  # unknown here: rejected (inbox full)


@dataclass
class Mailbox:
    inbound_limit: int
    outcome_limit: int
    event_batch_limit: int
    # The most the waiting event batches may hold, by event_batch_bytes (each BlockStored
    # carries its token ids: a count alone held GBs through a NATS outage). None: set by
    # the PluginCore given this mailbox, from its config's ``event_buffer_bytes``.
    event_bytes_limit: int | None = None
    # How many answered action ids (with their terminal outcome) and in-flight ids are
    # remembered; the connector passes ``max_remembered_actions``, the executor's own
    # idempotency memory, so the transport knows a repeat for as long as the engine does.
    answered_limit: int = 10_000
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
    # Set by the transport when a figure it exports changed (the connection, what it
    # published, NATS errors); cleared by the scheduler thread just before it reads the
    # figures for /metrics. An idle engine woken (by the transport) steps to ship them.
    stats_changed: bool = False
    # Set on the scheduler thread: when a status refresh it skipped (rate limit) is due
    # (wall-clock seconds), so an idle engine is woken for one step to make it.
    status_refresh_at: float | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    # Action ids the scheduler thread has given a terminal outcome, with that outcome
    # (the newest ``answered_limit``; under ``lock``). The transport's early ``deferred``
    # for a repeat must not follow the terminal outcome the repeat will be answered
    # with, and a repeat that finds the inbox full gets that outcome again, not a
    # ``rejected`` contradicting it.
    answered: OrderedDict[AnswerKey, HintOutcome] = field(default_factory=OrderedDict)
    # Action ids of hints queued for the scheduler thread and not yet given a terminal
    # outcome (queued, or applied and ``deferred``; under ``lock``, bounded by
    # ``answered_limit``): a repeat that finds the inbox full is answered nothing new.
    in_flight: OrderedDict[AnswerKey, None] = field(default_factory=OrderedDict)
    # The sizes of all event batches ever put (scheduler thread; EventBatchOut.upto).
    event_bytes_put: int = 0

    # --- transport side -----------------------------------------------------------------

    def post(self, item: Inbound, action_ids: Sequence[AnswerKey] = ()) -> bool:
        """Queue an inbound message for the scheduler thread and wake the engine if this
        is the first one waiting; False (counted) when the inbox is full. ``action_ids``
        (a hints message's, or an advice's :func:`answer_key`) are in flight from here
        until their terminal outcome: noted under the lock before the scheduler thread
        can take the message."""
        with self.lock:
            if len(self.inbound) >= self.inbound_limit:
                self.counters.inbound_dropped += 1
                return False
            in_flight = self.in_flight
            for action_id in action_ids:
                if action_id:
                    in_flight[action_id] = None
                    in_flight.move_to_end(action_id)
            while len(in_flight) > self.answered_limit:
                in_flight.popitem(last=False)
                self.counters.in_flight_forgotten += 1
            was_empty = not self.inbound
            self.inbound.append(item)
        if was_empty:
            self.wake_engine()
        return True

    def repeat_answers(self, action_ids: Sequence[AnswerKey]) -> RepeatAnswers:
        """Sort the action ids of a hints message (or an advice's :func:`answer_key`)
        the full inbox turned away: a repeat (redelivery) of an action answered or in
        flight must get the first copy's answer or nothing new, never a contradicting
        ``rejected``."""
        again: list[HintOutcome] = []
        in_flight: list[AnswerKey] = []
        new: list[AnswerKey] = []
        with self.lock:
            for action_id in action_ids:
                outcome = self.answered.get(action_id) if action_id else None
                if outcome is not None:
                    again.append(outcome)
                elif action_id and action_id in self.in_flight:
                    in_flight.append(action_id)
                else:
                    new.append(action_id)
        return RepeatAnswers(again, in_flight, new)

    def put_deferred(self, outcomes: list[HintOutcome]) -> list[HintOutcome]:
        """Queue early ``deferred`` outcomes (transport thread, under ``lock``) within
        ``outcome_limit``; returns those queued. A deferred is advisory (the terminal
        outcome follows), so when the queue is full the deferred is what goes, counted,
        never a terminal outcome already waiting."""
        room = max(self.outcome_limit - len(self.outcomes), 0)
        queued, dropped = outcomes[:room], len(outcomes) - room
        if dropped > 0:
            self.counters.deferred_dropped += dropped
        self.outcomes.extend(queued)  # the final outcomes can only come after
        return queued

    # --- scheduler side -----------------------------------------------------------------

    def take(self) -> Inbound | None:
        """The oldest inbound message, marked taken (scheduler thread)."""
        item = pop_oldest(self.inbound)
        if item is not None:
            with self.lock:
                item.taken = True
        return item

    def put_back(self, item: Inbound) -> None:
        """Put the rest of a message the scheduler thread took in part (its step's action
        budget spent) back at the head of the inbox, for the next step."""
        with self.lock:
            self.inbound.appendleft(item)

    def put_outcomes(self, outcomes: list[HintOutcome], remember: bool = True,
                     advice: bool = False) -> None:
        """Queue outcomes (the oldest queued go when full, counted). ``remember``: the
        terminal ones are the answers repeats get (False for the transport's inbox-full
        rejections: transient, a retry under the same id is applied). ``advice``: they
        answer a donor advice (remembered under its :func:`answer_key`), not a hints
        message's actions. Before, the key was taken from each outcome's action_type: a
        hints message's action naming ``kv.donor`` (answered rejected, that type echoed)
        was remembered as an advice's, its id stayed in flight for good (a repeat of it
        finding the inbox full got no answer at all) and an advice of that id finding the
        inbox full got the hint action's rejection as its own."""
        if not outcomes:
            return
        if remember:
            kind = DONOR_ACTION_TYPE if advice else ""
            with self.lock:
                answered, in_flight = self.answered, self.in_flight
                for outcome in outcomes:
                    if outcome.status is not OutcomeStatus.DEFERRED and outcome.action_id:
                        key = answer_key(outcome.action_id, kind)
                        answered[key] = outcome
                        answered.move_to_end(key)
                        in_flight.pop(key, None)
                while len(answered) > self.answered_limit:
                    answered.popitem(last=False)
                    self.counters.answered_forgotten += 1
        for outcome in outcomes:
            if len(self.outcomes) >= self.outcome_limit and (
                    dropped := pop_oldest(self.outcomes)) is not None:
                with self.lock:  # a deferred's final outcome follows: not a loss
                    if dropped.status.is_terminal:
                        self.counters.outcomes_dropped += 1
                    else:
                        self.counters.deferred_dropped += 1
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
        """Queue a batch within ``event_batch_limit`` batches and ``event_bytes_limit``
        bytes: the oldest go first, counted (the router sees the sequence gap and takes a
        snapshot); a batch past the byte bound by itself is dropped, counted."""
        queue, byte_limit = self.event_batches, self.event_bytes_limit
        if byte_limit is not None:
            nbytes = event_batch_bytes(batch.events)
            self.event_bytes_put += nbytes
            batch = replace(batch, nbytes=nbytes, upto=self.event_bytes_put)
            if nbytes > byte_limit:
                self.drop_event_batch(batch)
                return
        while len(queue) >= self.event_batch_limit or (
                byte_limit is not None and self.queued_event_bytes() + batch.nbytes > byte_limit):
            dropped = pop_oldest(queue)
            if dropped is None:  # the transport drained it meanwhile
                break
            self.drop_event_batch(dropped)
        queue.append(batch)
        self.notify_transport()

    def queued_event_bytes(self) -> int:
        """What the waiting event batches hold (event_batch_bytes; the batch the transport
        is publishing is not counted). Read from the queue's two ends: batches leave only
        from the head, oldest first, and one the transport fails to publish goes back
        there; one taken by the transport between the two reads is counted still."""
        queue = self.event_batches
        try:
            first, last = queue[0], queue[-1]
        except IndexError:  # empty, or emptied by the transport meanwhile
            return 0
        return last.upto - first.upto + first.nbytes

    def put_snapshot(self, snapshot: SnapshotOut) -> None:
        self.snapshots.append(snapshot)
        self.notify_transport()

    def waiting_snapshot(self) -> SnapshotOut | None:
        """The newest snapshot still waiting for the transport (not an error), or None.
        A request handled meanwhile shares its copy (consistent at its own ``seq``: the
        router replays the events after it) rather than copy the whole index again:
        while NATS is down the waiting requests hold one copy, not one a step."""
        try:
            last = self.snapshots[-1]
        except IndexError:  # empty, or emptied by the transport meanwhile
            return None
        return last if last.error is None else None

    def drop_event_batch(self, batch: EventBatchOut) -> None:
        """The transport gave up on a batch (counted as dropped)."""
        with self.lock:
            self.counters.event_batches_dropped += 1
            self.counters.events_dropped += len(batch.events)
