"""What the planner's live actions hold, per worker and per tenant (for budgets).

:class:`Holdings` is the frozen view the planner reads. :class:`HoldingsLedger` is a small
mutable helper (no I/O) the caller keeps to produce that view: it records each planned
action, lets a newer protection of the same session on the same worker supersede the
older one (the plugin applies the same rule), settles the amount from the outcome,
shrinks it when the worker reports blocks it let go unasked, and expires by TTL. An
action recorded before it is published (``tentative``) is confirmed once published, or
undone when its publish fails: the holding it superseded comes back.

Blocks are counted once, as the worker counts them: a block under several holdings (a
system prompt every session's Retain covers) is one block, pinned if any of them is a
Pin, else retained. The ledger knows a holding's blocks by their hashes where the caller
names them (:func:`target_keys`); blocks it cannot name (a session's completion blocks,
holdings restored after a restart) count as that holding's own.

What an answer or an action means for a holding (blocks held, scopes, names) is the pure
rules of :mod:`.holding_rules`, re-exported here.
"""

from __future__ import annotations

import heapq
from collections.abc import Collection, Hashable, Sequence
from dataclasses import dataclass

from kvhint.router.policy.block_counts import PINNED, RETAINED, BlockCounts
from kvhint.router.policy.holding_rules import (
    AGENT_SCOPE,
    BLOCK_HASH_SCOPE_TYPES,
    HOLDING_TYPES,
    PREFETCH_SCOPE,
    agent_scope,
    block_hash_scope,
    common_prefix,
    held_blocks,
    named_keys,
    prefetch_held_until,
    prefetch_scope,
    room_left,
    target_keys,
    waits_for_blocks,
)
from kvhint.schemas.hints import ActionType
from kvhint.schemas.outcomes import HintOutcome

# The rules moved to holding_rules.py stay importable from here, as before the split.
__all__ = ["AGENT_SCOPE", "BLOCK_HASH_SCOPE_TYPES", "PREFETCH_SCOPE", "HoldingChange",
           "Holdings", "HoldingsLedger", "agent_scope", "block_hash_scope", "held_blocks",
           "prefetch_held_until", "prefetch_scope", "room_left", "target_keys",
           "waits_for_blocks"]


@dataclass(frozen=True, slots=True)
class Holdings:
    pinned_blocks: int = 0
    retained_blocks: int = 0


@dataclass(frozen=True, slots=True)
class HoldingChange:
    """What a new holding of a scope does to one owner's counts (a worker's or a
    tenant's), per kind: ``freed`` the blocks the scope's live holding it supersedes
    stops counting, ``added`` what it then adds (a Pin over blocks only retained moves
    them: +1 pinned, -1 retained each). :meth:`HoldingsLedger.replacing`."""

    freed: Holdings = Holdings()
    added: Holdings = Holdings()


@dataclass(slots=True)
class _Held:
    action_id: str
    worker_id: str
    tenant: str | None
    scope: str
    action_type: str
    blocks: int
    expires_at: float
    keys: tuple[int, ...]  # named blocks, root first; it covers keys[:blocks]
    api: bool = False  # an agent runtime's, sent through the router's sessions API

    @property
    def slot(self) -> int:
        return PINNED if self.action_type == ActionType.PIN.value else RETAINED

    def named(self) -> tuple[int, ...]:
        return self.keys[:self.blocks]


@dataclass(slots=True)
class _Unconfirmed:
    """An action recorded before its publish (``record(tentative=True)``): what
    :meth:`HoldingsLedger.undo` needs to put the ledger back as the worker still has it."""

    worker_id: str
    scope: str
    held: _Held | None  # its own holding (None: a Demote)
    replaced: _Held | None  # the scope's holding it superseded, which the worker still has
    # The next action recorded on the same scope of the worker (None: none yet): once that
    # one is published, what this one replaced is over on the worker, whatever this one's
    # fate (one worker's envelopes leave in the order recorded).
    next_id: str | None = None


def _holdings(counts: BlockCounts, owner: Hashable) -> Holdings:
    totals = counts.totals.get(owner)
    return Holdings(totals[0], totals[1]) if totals else Holdings()


class HoldingsLedger:
    """Blocks held by live Pin/Retain actions.

    ``scope`` identifies what an action protects (a session id, or a shared-prefix key);
    one live holding per (worker, scope): recording a new one replaces the old.
    """

    def __init__(self) -> None:
        self._by_id: dict[str, _Held] = {}
        self._by_scope: dict[tuple[str, str], str] = {}
        self._workers_of_scope: dict[str, set[str]] = {}
        self._expiry: list[tuple[float, str]] = []
        # Distinct (pinned, retained) blocks per worker, per tenant, and per (tenant,
        # worker) of the API holdings (an agent runtime's share of one worker).
        self._workers = BlockCounts()
        self._tenants = BlockCounts()
        self._api = BlockCounts()
        # Actions recorded before their publish, not yet confirmed or undone.
        self._unconfirmed: dict[str, _Unconfirmed] = {}

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
        keys: Sequence[int] = (),
        api: bool = False,
        tentative: bool = False,
    ) -> None:
        """Note a sent action (``api``: an agent runtime's, through the sessions API;
        ``tentative``: not published yet, :meth:`confirm` or :meth:`undo` follows).
        ``keys``: the hashes of the blocks it covers, root first, as far as known
        (:func:`target_keys`); the rest of its ``blocks`` count as its own. A Demote
        releases the scope's holding, since the plugin supersedes it the same way;
        Prefetch and Share leave it (the plugin does too). A Prefetch's own retain (until
        ``expires_at``, its deadline) is a holding of its own, one per action, as the
        worker keeps it (:func:`prefetch_scope`,
        :func:`~kvhint.router.policy.holding_rules.session_block_names`).
        An action id seen before replaces that holding (ids are meant to be unique; this
        keeps the scope index whole if one is not; the worker does the same)."""
        if (again := self._by_id.get(action_id)) is not None:
            self._drop(again)
        keys = named_keys(action_type, scope, blocks, keys)
        if action_type == ActionType.PREFETCH.value:
            scope = prefetch_scope(scope, action_id)
        old_id = self._by_scope.get((worker_id, scope))
        old = self._by_id[old_id] if old_id is not None else None
        if action_type in HOLDING_TYPES or action_type == ActionType.DEMOTE.value:
            self._follow(worker_id, scope, action_id)
        if action_type not in HOLDING_TYPES:
            if action_type == ActionType.DEMOTE.value:
                if old is not None:
                    self._drop(old)
                if tentative:  # on an empty scope too: see _Unconfirmed.next_id
                    self._unconfirmed[action_id] = _Unconfirmed(worker_id, scope, None, old)
            return
        held = _Held(action_id, worker_id, tenant, scope, action_type, blocks, expires_at,
                     tuple(keys), api)
        # A session's new protection mostly covers its old one's blocks again (the chain
        # grew by a turn): their common named prefix keeps its counts untouched, so a
        # re-protection costs the blocks that changed, not the whole chain.
        kept = 0
        if (old is not None and old.slot == held.slot and old.tenant == held.tenant
                and old.api == held.api):
            kept = common_prefix(old.named(), held.named())
        if old is not None:
            self._drop(old, kept_named=kept)
        self._insert(held, kept)
        if tentative:
            self._unconfirmed[action_id] = _Unconfirmed(worker_id, scope, held, old)

    def confirm(self, action_id: str) -> None:
        """A tentative action was published (or may have been: its fate is unknown): it
        stands as recorded."""
        self._unconfirmed.pop(action_id, None)

    def undo(self, action_id: str, now: float) -> None:
        """A tentative action was never published: its holding goes, and the holding it
        superseded (which the worker still has) comes back, unless it is over (its TTL,
        its worker forgotten) or an action recorded on the scope after this one (a
        holding or a Demote) was published. One of those still in flight that superseded
        this one, or came on the scope this one (a Demote) left empty, inherits what this
        one replaced, for its own undo.

        Not known here: what the worker said of the superseded holding meanwhile (its
        outcome, a release): it comes back as it was recorded. A publish fails before the
        NATS client first waits; before that, an envelope may wait for the one before it
        on its worker (:mod:`kvhint.router.service.hint_send`)."""
        entry = self._unconfirmed.pop(action_id, None)
        if entry is None:
            return
        for other in self._unconfirmed.values():
            if other.next_id == action_id:  # this one never left: the one after it follows
                other.next_id = entry.next_id
        if entry.held is not None:
            if self._by_id.get(action_id) is not entry.held:
                # Gone meanwhile: superseded (its successor takes over what it replaced),
                # expired, or its worker forgotten.
                for other in self._unconfirmed.values():
                    if other.replaced is entry.held:
                        other.replaced = entry.replaced
                return
            self._drop(entry.held)
        old = entry.replaced
        if old is None or old.expires_at <= now or old.action_id in self._by_id:
            return
        if entry.next_id is not None:
            # A later action on the scope: published, it superseded ``old`` on the worker
            # (before, a Demote recorded on the scope a failed Demote had emptied was not
            # followed, and ``old`` came back though the worker let it go); in flight, it
            # takes ``old`` over if it replaced nothing.
            later = self._unconfirmed.get(entry.next_id)
            if later is not None and later.replaced is None:
                later.replaced = old
            return
        if (old.worker_id, old.scope) not in self._by_scope:
            self._insert(old)

    def _follow(self, worker_id: str, scope: str, action_id: str) -> None:
        """``action_id`` is recorded on ``scope`` of the worker: it is the next action of
        the actions in flight there that have none yet."""
        for entry_id, entry in self._unconfirmed.items():
            if (entry.next_id is None and entry.worker_id == worker_id
                    and entry.scope == scope and entry_id != action_id):
                entry.next_id = action_id

    def holds(self, worker_id: str, scope: str) -> bool:
        """Whether a live holding of ``scope`` is on the worker."""
        return (worker_id, scope) in self._by_scope

    def workers_holding(self, scope: str) -> list[str]:
        """The workers with a live holding of ``scope``, sorted."""
        return sorted(self._workers_of_scope.get(scope, ()))

    def api_holders(self, scope: str) -> list[str]:
        """The workers whose live holding of ``scope`` is an agent runtime's (recorded
        with ``api``), sorted."""
        return sorted(worker_id for worker_id in self._workers_of_scope.get(scope, ())
                      if self._by_id[self._by_scope[(worker_id, scope)]].api)

    def release_scope(self, worker_id: str, scope: str) -> None:
        old = self._by_scope.get((worker_id, scope))
        if old is not None:
            self._drop(self._by_id[old])

    def settle(self, outcome: HintOutcome, now: float | None = None,
               retain_max_s: float | None = None) -> None:
        """Correct a holding by the worker's answer (:func:`held_blocks`). With ``now``,
        a holding past its TTL at the answer goes at once, as :meth:`expire` would drop
        it: a Prefetch answered at its deadline (clipped, with part of its target in G1)
        retains nothing, and the worker's deadline, counted from when it got the action,
        is never before the holding's ``expires_at``, counted from when it was planned.
        ``retain_max_s``: :func:`prefetch_held_until`.

        A ``deferred`` Prefetch still counts its requested blocks (they may all come),
        but one whose wait its worker clipped counts no more than it waits for
        (:func:`waits_for_blocks`): it can never hold more. Before, it counted every
        block it requested until it settled, and a tenant could be refused room (a 429)
        that the worker could never fill."""
        held = self._by_id.get(outcome.action_id)
        blocks = held_blocks(outcome)
        if held is not None and blocks is None:
            cap = waits_for_blocks(outcome)
            if (cap is not None and cap < held.blocks
                    and held.action_type == ActionType.PREFETCH.value):
                if cap > 0:
                    self._set_blocks(held, cap)
                else:
                    self._drop(held)
            return
        if held is None or blocks is None:
            return
        if now is not None and held.expires_at <= now:
            blocks = 0
        elif now is not None and held.action_type == ActionType.PREFETCH.value and (
                until := prefetch_held_until(held.expires_at, now, retain_max_s)
        ) < held.expires_at:
            held.expires_at = until
            heapq.heappush(self._expiry, (until, held.action_id))
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

    def blocks_of(self, action_id: str) -> int | None:
        """The blocks the live holding of ``action_id`` holds (None: none is live)."""
        held = self._by_id.get(action_id)
        return None if held is None else held.blocks

    def held_on(self, worker_id: str) -> list[str]:
        """The action ids of the live holdings on the worker."""
        return [h.action_id for h in self._by_id.values() if h.worker_id == worker_id]

    def forget_worker(self, worker_id: str, keep: Collection[str] = ()) -> int:
        """The worker holds nothing any more (its engine restarted; it is gone): forget
        its holdings (an undo brings none of them back); returns how many, for the caller
        to count. ``keep``: action ids the worker's new engine answered, whose holdings
        it has (HintDispatcher.reset_worker)."""
        gone = [h for h in self._by_id.values()
                if h.worker_id == worker_id and h.action_id not in keep]
        for held in gone:
            self._drop(held)
        for entry in self._unconfirmed.values():
            if entry.worker_id == worker_id:
                entry.replaced = None
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

    def added(self, worker_id: str, tenant: str | None, action_type: str, blocks: int,
              keys: Sequence[int], scope: str = "") -> tuple[int, int, int]:
        """(worker, tenant, tenant's API holdings on the worker) blocks a new API
        Pin/Retain/Prefetch of ``blocks`` on ``scope`` would add to what they hold of its
        kind: its named ``keys`` (root first) that other holdings already count so (a
        system prompt every session shares) add nothing; the rest add one each, as
        :meth:`record` will count them (a Prefetch's unnamed blocks named as its
        session's: another Prefetch of the session holding them, they add nothing;
        before, they were charged again, and a tenant got a 429 for room it held)."""
        slot = PINNED if action_type == ActionType.PIN.value else RETAINED
        named = tuple(named_keys(action_type, scope, blocks, keys)[:blocks])
        worker = blocks - self._workers.counted(worker_id, worker_id, named, slot)
        if tenant is None:
            return worker, 0, 0
        return (worker, blocks - self._tenants.counted(tenant, worker_id, named, slot),
                blocks - self._api.counted((tenant, worker_id), worker_id, named, slot))

    def tenant_retain_added(self, tenant: str, worker_id: str, keys: Sequence[int]) -> int:
        """Retained blocks a Retain naming ``keys`` (root first) on the worker would add
        to ``tenant``'s count: its blocks another holding of the tenant there already
        counts (a session's Retain over the system prompt a shared-prefix Retain names
        too, or the prefix's own earlier Retain) add nothing (:meth:`added`'s tenant
        figure). The planner reads it (``PlannerContext.tenant_retain_added``)."""
        return len(keys) - self._tenants.counted(tenant, worker_id, keys, RETAINED)

    def replacing(self, worker_id: str, tenant: str | None, scope: str, action_type: str,
                  blocks: int, keys: Sequence[int]) -> tuple[HoldingChange, HoldingChange]:
        """(worker, tenant): what recording a Pin/Retain/Prefetch of ``blocks`` on
        ``scope`` naming ``keys`` (root first) would do to the worker's and ``tenant``'s
        counts, as :meth:`record` counts them: the scope's live holding on the worker
        goes (a Prefetch supersedes none: its scope is its own), and the new one adds its
        named blocks no other holding counts, and its unnamed ones. ``tenant`` None: the
        tenant's change is none. The planner reads it for a session's Pin/Retain
        (``PlannerContext.holding_change``): a first protection of a session whose system
        prompt other holdings hold costs its own blocks only. Read only."""
        slot = PINNED if action_type == ActionType.PIN.value else RETAINED
        named = tuple(named_keys(action_type, scope, blocks, keys)[:blocks])
        old = None
        if action_type != ActionType.PREFETCH.value:
            old_id = self._by_scope.get((worker_id, scope))
            old = self._by_id[old_id] if old_id is not None else None
        old_named = old.named() if old is not None else ()
        old_slot = old.slot if old is not None else slot
        old_own = old.blocks - len(old_named) if old is not None else 0
        changes = []
        for counts, owner, its_old in ((self._workers, worker_id, True),
                                       (self._tenants, tenant, old is not None
                                        and old.tenant == tenant)):
            if owner is None:
                changes.append(HoldingChange())
                continue
            freed, added = counts.replaced(owner, worker_id,
                                           old_named if its_old else (), old_slot, named, slot)
            if its_old:
                freed[old_slot] += old_own
            added[slot] += blocks - len(named)
            changes.append(HoldingChange(Holdings(*freed), Holdings(*added)))
        return changes[0], changes[1]

    def worker(self, worker_id: str) -> Holdings:
        return _holdings(self._workers, worker_id)

    def claims(self, worker_id: str, tenant: str | None = None) -> tuple[int, int]:
        """Live holdings of some blocks on the worker, (Pins, Retains and Prefetches);
        with ``tenant``, its API holdings there only."""
        counts = (self._workers.claims if tenant is None else self._api.claims).get(
            worker_id if tenant is None else (tenant, worker_id), (0, 0))
        return counts[0], counts[1]

    def tenant(self, tenant: str) -> Holdings:
        return _holdings(self._tenants, tenant)

    def api_on_worker(self, tenant: str, worker_id: str) -> Holdings:
        """What ``tenant``'s agent runtimes hold on the worker through the sessions API
        (the planner's holdings for that tenant's sessions are not counted)."""
        return _holdings(self._api, (tenant, worker_id))

    def __len__(self) -> int:
        return len(self._by_id)

    def __contains__(self, action_id: object) -> bool:
        """Whether a live holding is the action ``action_id``'s."""
        return action_id in self._by_id

    def _insert(self, held: _Held, kept_named: int = 0) -> None:
        """Make ``held`` its scope's live holding and count it (but its first
        ``kept_named`` named blocks, which the holding it replaces left counted)."""
        self._by_id[held.action_id] = held
        self._by_scope[(held.worker_id, held.scope)] = held.action_id
        self._workers_of_scope.setdefault(held.scope, set()).add(held.worker_id)
        heapq.heappush(self._expiry, (held.expires_at, held.action_id))
        self._count(held, +1, kept_named=kept_named)

    def _set_blocks(self, held: _Held, blocks: int) -> None:
        """Resize a holding; it keeps (or gains) its root-most blocks, as the worker
        clips a claim and lets one go leaf first: the named prefix both sizes share keeps
        its counts."""
        if blocks == held.blocks:
            return  # as the worker planned it (most answers): counts stay as they are
        kept = min(held.blocks, blocks, len(held.keys))
        self._count(held, -1, kept)
        held.blocks = blocks
        self._count(held, +1, kept)

    def _count(self, held: _Held, sign: int, kept_named: int = 0) -> None:
        """Count the holding in (+1) or out (-1), except its first ``kept_named`` named
        blocks (another holding of the same scope, type and tenant takes them over)."""
        named = held.named()
        self._count_named(held, named[kept_named:], sign)
        self._count_own(held, sign * (held.blocks - len(named)))
        if held.blocks > 0:
            self._workers.claim(held.worker_id, held.slot, sign)
            if held.api and held.tenant is not None:
                self._api.claim((held.tenant, held.worker_id), held.slot, sign)

    def _count_named(self, held: _Held, keys: Sequence[int], sign: int) -> None:
        slot = held.slot
        self._workers.named(held.worker_id, held.worker_id, keys, slot, sign)
        if held.tenant is not None:
            self._tenants.named(held.tenant, held.worker_id, keys, slot, sign)
            if held.api:
                self._api.named((held.tenant, held.worker_id), held.worker_id, keys,
                                slot, sign)

    def _count_own(self, held: _Held, blocks: int) -> None:
        if not blocks:
            return  # BlockCounts.own changes nothing for 0 blocks
        slot = held.slot
        self._workers.own(held.worker_id, blocks, slot)
        if held.tenant is not None:
            self._tenants.own(held.tenant, blocks, slot)
            if held.api:
                self._api.own((held.tenant, held.worker_id), blocks, slot)

    def _drop(self, held: _Held, kept_named: int = 0) -> None:
        if self._by_id.pop(held.action_id, None) is None:
            return
        self._count(held, -1, kept_named)
        if self._by_scope.get((held.worker_id, held.scope)) == held.action_id:
            del self._by_scope[(held.worker_id, held.scope)]
            workers = self._workers_of_scope[held.scope]
            workers.discard(held.worker_id)
            if not workers:
                del self._workers_of_scope[held.scope]
