"""What the planner's live actions hold, per worker and per tenant (for budgets).

:class:`Holdings` is the frozen view the planner reads. :class:`HoldingsLedger` is a small
mutable helper (no I/O) the caller keeps to produce that view: it records each planned
action, lets a newer protection of the same session on the same worker supersede the
older one (the plugin applies the same rule), settles the amount from the outcome,
shrinks it when the worker reports blocks it let go unasked, and expires by TTL.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from kvhint.schemas.hints import ActionType
from kvhint.schemas.outcomes import HintOutcome, OutcomeStatus


@dataclass(frozen=True, slots=True)
class Holdings:
    pinned_blocks: int = 0
    retained_blocks: int = 0


def held_blocks(outcome: HintOutcome) -> int | None:
    """The blocks a Pin/Retain holds on its worker after this answer: ``applied`` when
    accepted or clipped, none when rejected or missing; None for a ``deferred`` (not an
    answer yet)."""
    if not outcome.status.is_terminal:
        return None
    if outcome.status in (OutcomeStatus.ACCEPTED, OutcomeStatus.CLIPPED):
        return outcome.applied.blocks
    return 0


def room_left(held: int, limit: int | None) -> int:
    """Blocks a budget of ``limit`` has left with ``held`` in use (None: no limit)."""
    if limit is None:
        return 1 << 62
    return max(limit - held, 0)


@dataclass(slots=True)
class _Held:
    action_id: str
    worker_id: str
    tenant: str | None
    scope: str
    action_type: str
    blocks: int
    expires_at: float


_HOLDING_TYPES = frozenset({ActionType.PIN.value, ActionType.RETAIN.value})


class HoldingsLedger:
    """Blocks held by live Pin/Retain actions.

    ``scope`` identifies what an action protects (a session id, or a shared-prefix key);
    one live holding per (worker, scope): recording a new one replaces the old.
    """

    def __init__(self) -> None:
        self._by_id: dict[str, _Held] = {}
        self._by_scope: dict[tuple[str, str], str] = {}
        self._expiry: list[tuple[float, str]] = []
        # Running totals: (pinned, retained) per worker and per tenant.
        self._worker_totals: dict[str, list[int]] = {}
        self._tenant_totals: dict[str, list[int]] = {}

    def record(
        self,
        *,
        action_id: str,
        worker_id: str,
        tenant: str | None,
        scope: str,
        action_type: str,
        blocks: int,
        expires_at: float,
    ) -> None:
        """Note a sent action. Non-holding types (Demote, Prefetch, Share) release the
        scope's holding, since the plugin supersedes it the same way. An action id seen
        before replaces that holding (ids are meant to be unique; this keeps the scope
        index whole if one is not)."""
        if (again := self._by_id.get(action_id)) is not None:
            self._drop(again)
        self.release_scope(worker_id, scope)
        if action_type not in _HOLDING_TYPES:
            return
        held = _Held(action_id, worker_id, tenant, scope, action_type, blocks, expires_at)
        self._by_id[action_id] = held
        self._by_scope[(worker_id, scope)] = action_id
        heapq.heappush(self._expiry, (expires_at, action_id))
        self._count(held, +1)

    def release_scope(self, worker_id: str, scope: str) -> None:
        old = self._by_scope.get((worker_id, scope))
        if old is not None:
            self._drop(self._by_id[old])

    def settle(self, outcome: HintOutcome) -> None:
        """Correct a holding by the worker's answer (:func:`held_blocks`)."""
        held = self._by_id.get(outcome.action_id)
        blocks = held_blocks(outcome)
        if held is None or blocks is None:
            return
        if blocks > 0:
            self._set_blocks(held, blocks)
        else:
            self._drop(held)

    def released(self, action_id: str, still_held: int) -> None:
        """The worker let blocks of ``action_id`` go unasked (displaced, relieved, reset);
        it still holds ``still_held`` of them (0: the holding is over)."""
        held = self._by_id.get(action_id)
        if held is None:
            return
        if still_held <= 0:
            self._drop(held)
        elif still_held < held.blocks:
            self._set_blocks(held, still_held)

    def forget_worker(self, worker_id: str) -> int:
        """The worker's engine restarted and holds nothing: forget its holdings; returns
        how many."""
        gone = [h for h in self._by_id.values() if h.worker_id == worker_id]
        for held in gone:
            self._drop(held)
        return len(gone)

    def expire(self, now: float) -> int:
        """Forget holdings past their TTL; returns how many."""
        gone = 0
        heap = self._expiry
        while heap and heap[0][0] <= now:
            _, action_id = heapq.heappop(heap)
            held = self._by_id.get(action_id)
            if held is not None and held.expires_at <= now:
                self._drop(held)
                gone += 1
        return gone

    def worker(self, worker_id: str) -> Holdings:
        totals = self._worker_totals.get(worker_id)
        return Holdings(totals[0], totals[1]) if totals else Holdings()

    def tenant(self, tenant: str) -> Holdings:
        totals = self._tenant_totals.get(tenant)
        return Holdings(totals[0], totals[1]) if totals else Holdings()

    def __len__(self) -> int:
        return len(self._by_id)

    def _set_blocks(self, held: _Held, blocks: int) -> None:
        self._count(held, -1)
        held.blocks = blocks
        self._count(held, +1)

    def _count(self, held: _Held, sign: int) -> None:
        slot = 0 if held.action_type == ActionType.PIN.value else 1
        self._worker_totals.setdefault(held.worker_id, [0, 0])[slot] += sign * held.blocks
        if held.tenant is not None:
            self._tenant_totals.setdefault(held.tenant, [0, 0])[slot] += sign * held.blocks

    def _drop(self, held: _Held) -> None:
        if self._by_id.pop(held.action_id, None) is None:
            return
        self._count(held, -1)
        if self._by_scope.get((held.worker_id, held.scope)) == held.action_id:
            del self._by_scope[(held.worker_id, held.scope)]
