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
  seeing a claim reaches the worker after the claim;
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
from collections.abc import Callable, Mapping, Sequence

from kvhint.router.policy import HoldingsLedger, PlannedAction, target_keys
from kvhint.router.service.hint_records import API_SOURCE, FAILED, PENDING, SentAction
from kvhint.router.service.metrics import RouterMetrics
from kvhint.router.service.nats_link import NatsLink
from kvhint.schemas import PROTOCOL_VERSION, KvHintsEnvelope, Subjects, encode_hints

_NOT_CARRIED = "NATS not connected"


class PublishOrder:
    """One lock per worker: its envelopes are published one at a time, in the order
    their senders asked (an asyncio lock serves its waiters first come, first served)."""

    def __init__(self) -> None:
        self._locks: dict[str, asyncio.Lock] = {}

    def of(self, worker_id: str) -> asyncio.Lock:
        lock = self._locks.get(worker_id)
        if lock is None:
            lock = self._locks[worker_id] = asyncio.Lock()
        return lock

    def forget(self, worker_id: str) -> None:
        """The registry forgot the worker (a lock in use stays, for its waiters)."""
        lock = self._locks.get(worker_id)
        if lock is not None and not lock.locked():
            del self._locks[worker_id]


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
        records (``failed`` ones included)."""
        now = self._clock()
        by_worker: dict[str, list[PlannedAction]] = {}
        for action in planned:
            by_worker.setdefault(action.worker_id, []).append(action)
        envelopes: list[tuple[str, bytes, list[SentAction]]] = []
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
            envelopes.append((worker_id, encode_hints(envelope), records))
        for index, (worker_id, data, records) in enumerate(envelopes):
            try:
                await self._publish(worker_id, data, records)
            except asyncio.CancelledError:
                for _worker, _data, later in envelopes[index + 1:]:
                    self._unsent(later, "cancelled before its publish")
                raise
        return sent

    def forget_worker(self, worker_id: str) -> None:
        self._order.forget(worker_id)

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

    async def _publish(self, worker_id: str, data: bytes, records: list[SentAction]) -> None:
        """Publish one envelope in its worker's order, then confirm or undo its records."""
        lock = self._order.of(worker_id)
        try:
            await lock.acquire()
        except asyncio.CancelledError:
            self._unsent(records, "cancelled before its publish")
            raise
        ok: bool | None = None  # None: the publish did not return (its fate unknown)
        try:
            assert self._link is not None
            ok = await self._link.publish(self._subjects.hints(worker_id), data)
        finally:
            lock.release()
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
