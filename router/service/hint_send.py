"""Sending hint envelopes: every action is recorded before its envelope is published, and
undone when the publish fails.

Recorded first, because whatever reads the router's records while a publish awaits must
find the action as sent: a session's end releasing what the session holds, a hints call's
budget check, expiries, and the action's own outcome, which the worker can answer before
the publish returns. Recorded after (as before), an end landing during the publish
released nothing of it (an agent's claim stayed on the worker for its TTL, a planner's
protection stayed in the ledger, counted against budgets, after the end superseded it on
the worker), two hints calls of one tenant both passed a budget with room for one, an
outcome that came back first was taken for another router's, and a send cancelled while
it awaited (the router stopping) left no row of an action the worker got.

Contracts (:class:`HintSender`):

- one step: ``send`` records every action of the call (holdings, pending, its store row)
  before its first await, so a caller's check (a budget) and the record are atomic
  where the caller does not await between them;
- one worker's envelopes leave in the order they were recorded (:class:`PublishOrder`),
  whatever the NATS client does while a publish awaits: a release that an end sent after
  seeing a claim reaches the worker after the claim. Each envelope's place is taken when
  it is recorded (a send to several workers keeps its place on each: before, it waited
  for its first worker before it queued for the second, and a later send to the second
  went first), and it waits only for the one before it on its worker;
- an envelope waiting for the one before it fails at once (``NATS not connected``) when
  the link goes down: the one before may be a publish nats-py cannot finish (its flush,
  which has no timeout, waits for a server to answer again). Before, every later send to
  that worker (the planner's tick, an end, agents' calls) waited with it;
- a publish NATS refuses (not connected, closed) undoes its actions
  (:meth:`HoldingsLedger.undo`: the holding each superseded comes back) and ends them
  ``failed``, counted as before: ``hints_total{outcome="failed"}`` and
  ``drops_total{what="hint_unsent"}``; so does a send cancelled before its publish began;
- a publish that does not return (cancelled: the router stopping) stands: the client
  queues a message before it first waits and closing drains its queue, so the action
  stays pending (its row already queued for the store) until its outcome or deadline.
"""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from kvhint.router.policy import HoldingsLedger, PlannedAction, target_keys
from kvhint.router.service.hint_records import API_SOURCE, FAILED, PENDING, SentAction
from kvhint.router.service.metrics import RouterMetrics
from kvhint.router.service.nats_link import NatsLink
from kvhint.schemas import PROTOCOL_VERSION, KvHintsEnvelope, Subjects, encode_hints

_NOT_CARRIED = "NATS not connected"
# How often an envelope waiting for the one before it looks at the link (only while one
# waits: an uncontended worker never polls).
_ORDER_POLL_S = 0.1


@dataclass(slots=True)
class Place:
    """One envelope's place in its worker's order: ``before`` is done once the envelope
    recorded before it on the worker is (None: none in flight)."""

    worker_id: str
    before: asyncio.Future[None] | None
    done: asyncio.Future[None]


class PublishOrder:
    """Each worker's envelopes published one at a time, in the order :meth:`take` gave
    their places (at record time: no await between a send's records and its places).
    Only envelopes in flight have an entry (bounded by them, a forgotten worker's too)."""

    def __init__(self) -> None:
        self._last: dict[str, asyncio.Future[None]] = {}

    def take(self, worker_id: str) -> Place:
        done = asyncio.get_running_loop().create_future()
        place = Place(worker_id, self._last.get(worker_id), done)
        self._last[worker_id] = done
        return place

    async def turn(self, place: Place, carried: Callable[[], bool]) -> bool:
        """Wait until the envelope before ``place`` is done; False, at once, while
        ``carried()`` says the link is down (a publish waiting on a server that is gone
        must not hold up those behind it: they fail as they would alone)."""
        before = place.before
        while before is not None and not before.done():
            if not carried():
                return False
            await asyncio.wait((before,), timeout=_ORDER_POLL_S)
        return True

    def leave(self, place: Place) -> None:
        """The envelope is published, or given up: the next may go once the one before
        this is done too (one given up while that one is still publishing must not let
        a later one overtake it)."""
        if place.before is not None and not place.before.done():
            place.before.add_done_callback(lambda _before: self._done(place))
        else:
            self._done(place)

    def _done(self, place: Place) -> None:
        if not place.done.done():
            place.done.set_result(None)
        if self._last.get(place.worker_id) is place.done:
            del self._last[place.worker_id]


class HintSender:
    """The dispatcher's sending half (module doc). It writes the dispatcher's
    ``holdings`` and ``pending``; ``save(record)`` queues an action's row,
    ``finish(record)`` ends an action (out of pending, its waiter told)."""

    def __init__(self, link: NatsLink | None, subjects: Subjects, holdings: HoldingsLedger,
                 pending: dict[str, SentAction], metrics: RouterMetrics,
                 block_size: Callable[[str], int], save: Callable[[SentAction], None],
                 finish: Callable[[SentAction], None], clock: Callable[[], float]) -> None:
        self._link = link
        self._subjects = subjects
        self._holdings = holdings
        self._pending = pending
        self._metrics = metrics
        self._block_size = block_size
        self._save = save
        self._finish = finish
        self._clock = clock
        self._order = PublishOrder()

    async def send(self, planned: Sequence[PlannedAction], session_ids: dict[str, str | None],
                   source: str, chains: Mapping[str, Sequence[int]]) -> list[SentAction]:
        """Record, then publish, ``planned`` (one envelope per worker); returns the
        records (``failed`` ones included). An action id may appear once in a call: the
        router tracks an action, and a worker answers one, by its id (a worker answers an
        envelope naming an id twice with one ``rejected`` for that id and applies none
        of its actions), so a call naming one twice is a bug: ValueError, nothing
        recorded or sent."""
        named = Counter(action.action.action_id for action in planned)
        if twice := sorted(action_id for action_id, n in named.items() if n > 1):
            raise ValueError(f"action ids named more than once in one send: {twice}")
        now = self._clock()
        by_worker: dict[str, list[PlannedAction]] = {}
        for action in planned:
            by_worker.setdefault(action.worker_id, []).append(action)
        envelopes: list[tuple[Place, bytes, list[SentAction]]] = []
        sent: list[SentAction] = []
        for worker_id, actions in by_worker.items():
            message_id = f"kvm-{uuid.uuid4().hex[:16]}"
            envelope = KvHintsEnvelope(protocol_version=PROTOCOL_VERSION, message_id=message_id,
                                       actions=[a.action for a in actions])
            records = [_record(action, message_id, session_ids, source, now)
                       for action in actions]
            sent += records
            if self._link is None:
                self._unsent(records, _NOT_CARRIED)
                continue
            for record, action in zip(records, actions):
                self._hold(record, action, chains.get(action.scope, ()))
            envelopes.append((self._order.take(worker_id), encode_hints(envelope), records))
        for index, (place, data, records) in enumerate(envelopes):
            try:
                await self._publish(place, data, records)
            except asyncio.CancelledError:
                for later, _data, unsent in envelopes[index + 1:]:
                    self._order.leave(later)
                    self._unsent(unsent, "cancelled before its publish")
                raise
        return sent

    def _hold(self, record: SentAction, action: PlannedAction, chain: Sequence[int]) -> None:
        """Record ``record`` as sent before its publish: its holding (tentative), pending,
        its row."""
        keys = target_keys(action.action_type, action.action.payload,
                           self._block_size(record.worker_id), chain)
        self._holdings.record(action_id=record.action_id, worker_id=record.worker_id,
                              tenant=record.tenant, scope=action.scope,
                              action_type=action.action_type, blocks=action.blocks,
                              expires_at=action.expires_at, keys=keys,
                              api=record.source == API_SOURCE, tentative=True)
        self._pending[record.action_id] = record
        self._save(record)

    async def _publish(self, place: Place, data: bytes, records: list[SentAction]) -> None:
        """Publish one envelope in its worker's order, then confirm or undo its records."""
        assert self._link is not None
        link = self._link
        try:
            its_turn = await self._order.turn(place, lambda: link.connected)
        except asyncio.CancelledError:
            self._order.leave(place)
            self._unsent(records, "cancelled before its publish")
            raise
        if not its_turn:
            self._order.leave(place)
            self._unsent(records, _NOT_CARRIED)
            return
        ok: bool | None = None  # None: the publish did not return (its fate unknown)
        try:
            ok = await link.publish(self._subjects.hints(place.worker_id), data)
        finally:
            self._order.leave(place)
            if ok is False:
                self._unsent(records, _NOT_CARRIED)
            else:
                self._published(records)

    def _published(self, records: list[SentAction]) -> None:
        for record in records:
            self._holdings.confirm(record.action_id)
            self._metrics.hints_sent.labels(record.action_type, record.source).inc()

    def _unsent(self, records: list[SentAction], reason: str) -> None:
        """The records' envelope never left: undone, ended ``failed`` and counted (one
        that ended meanwhile, its worker forgotten, was counted so)."""
        now = self._clock()
        for record in records:
            self._holdings.undo(record.action_id, now)
            if record.terminal:
                continue
            record.status, record.reason, record.updated_at = FAILED, reason, now
            self._metrics.drop("hint_unsent")
            self._metrics.hints.labels(record.action_type, FAILED, record.source).inc()
            self._finish(record)
            self._save(record)


def _record(action: PlannedAction, message_id: str, session_ids: dict[str, str | None],
            source: str, now: float) -> SentAction:
    return SentAction(
        action_id=action.action.action_id, message_id=message_id, worker_id=action.worker_id,
        tenant=action.tenant, session_id=session_ids.get(action.scope),
        action_type=action.action_type, source=source, trigger=action.reason,
        payload=action.action.payload, status=PENDING, created_at=now, updated_at=now,
        requested_blocks=action.blocks, scope=action.scope, expires_at=action.expires_at)
