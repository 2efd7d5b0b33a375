"""Prefetch: have a target's blocks in G1 before they are needed (mixed into the
:class:`~kvhint.engine_plugin.executor.HintExecutor`).

Blocks already in G1 are ``accepted`` and retained until the deadline. Others arrive only
with a request (vLLM loads from the host tier only when admitting one), so the Prefetch is
answered ``deferred`` and waits: every step re-checks its blocks, and it ends when they are
all in G1 or at its deadline. That waiting is bounded per worker by the prefetch budget
(``prefetch_budget_fraction`` of the GPU blocks): a Prefetch past it waits only for its
root-most blocks that fit and ends ``clipped``; with no room it is answered at once. Its
``deferred`` then says how many it waits for (``waits_for``, outcome 1.1): the most it can
hold, which the router reserves instead of all it requested.

A Prefetch's ``applied`` is what it holds after its answer: the blocks its retain took
(the router counts it so against budgets until the deadline). The retain budget may take
fewer than are in G1 (higher-ranked claims fill it): the Prefetch is then ``clipped`` and
says how many. Before, it answered ``accepted`` with every block in G1 as ``applied``, and
the router counted as held blocks the worker did not retain.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec

from kvhint.engine_plugin.block_cache import BlockCache, BlockHandle
from kvhint.engine_plugin.config import PluginConfig
from kvhint.engine_plugin.host_tier import NO_HOST_TIER, HostTier
from kvhint.schemas import (
    ActionType,
    Amount,
    HintOutcome,
    HintOwner,
    OutcomeStatus,
    PrefetchPayload,
)
from kvhint.schemas.outcomes import CLIPPED_HIT_REACH

if TYPE_CHECKING:
    from kvhint.engine_plugin.executor import ExecutorCounters

ACCEPTED, CLIPPED, DEFERRED = OutcomeStatus.ACCEPTED, OutcomeStatus.CLIPPED, OutcomeStatus.DEFERRED
MISSING = OutcomeStatus.MISSING
PLANNER = HintOwner.PLANNER.value
# Added to the outcome of an action that replaced a Prefetch still waiting under its id
# (:meth:`PrefetchMixin._replace_waiting_prefetch`): that outcome answers the id.
REPLACED_PREFETCH_NOTE = ("replaced a Prefetch still waiting under this action_id (the "
                          "worker's memory of it was forgotten), waited for no more: this "
                          "outcome answers the id")


def _status(retained: int, handles: list[BlockHandle]) -> OutcomeStatus:
    """A Prefetch whose target is in G1: ``accepted`` when its retain took every block,
    else ``clipped`` (its ``applied``, what it holds, is less)."""
    return ACCEPTED if retained >= len(handles) else CLIPPED


def _room(retained: int, handles: list[BlockHandle], due: bool = False,
          clips: Sequence[str] = ()) -> str:
    """Why a Prefetch retains fewer blocks than are in G1 (no figures: a tenant reads
    it, router/service/tenant_reasons.py); ``due``: its deadline has come (nothing is
    retained past it); ``clips``: what its retain said (on a hybrid model, a hit point
    short of its target: no position past it is held)."""
    if retained >= len(handles):
        return ""
    if due:
        return " (its deadline has come)"
    reach = any(CLIPPED_HIT_REACH in c for c in clips)
    if reach and not any(c.startswith("retain budget") for c in clips):
        return (" (no prefix hit reaches further: the other KV cache groups' blocks it "
                "needs are not resident past it)")
    return " (the retain budget had no room for the rest)"


@dataclass(slots=True)
class PendingPrefetch:
    message_id: str
    keys: list[int]  # what it waits for: its root-most target blocks the budget took
    requested: Amount
    deadline: float
    clipped: str | None = None  # why it waits for fewer blocks than it named
    owner: str = PLANNER  # whose retain keeps its blocks once they are in G1

    @property
    def cost(self) -> int:
        """What it takes of the prefetch budget: each step re-checks its keys (one at
        least, so Prefetches naming nothing are bounded too)."""
        return max(1, len(self.keys))


class PrefetchMixin:
    """The executor's Prefetch handling; the executor sets these up and supplies the
    outcome helpers (``_outcome``, ``_amount``, ``_remember``, ``_retain``)."""

    cache: BlockCache
    config: PluginConfig
    clock: Callable[[], float]
    host_tier: HostTier | None
    counters: ExecutorCounters
    max_prefetch_blocks: int
    _pending: dict[str, PendingPrefetch]
    _prefetch_waiting: int
    _outcome: Callable[..., HintOutcome]
    _amount: Callable[[int], Amount]
    _remember: Callable[[tuple[str, str], HintOutcome], None]
    _retain: Callable[..., int]

    def _prefetch(self, message_id: str, action_id: str, payload: PrefetchPayload,
                  keys: list[int], handles: list[BlockHandle], requested: Amount
                  ) -> HintOutcome:
        type_ = ActionType.PREFETCH.value
        owner = payload.owner.value
        if requested.blocks and len(handles) >= requested.blocks:
            clips: list[str] = []
            retained = self._retain_until(action_id, handles, payload.deadline_s, owner, clips)
            return self._outcome(message_id, action_id, type_, _status(retained, handles),
                                 f"already resident in G1; {retained} of {len(handles)} "
                                 "blocks retained until the deadline"
                                 f"{_room(retained, handles, clips=clips)}",
                                 requested, self._amount(retained))
        # Waiting is bounded (prefetch_budget_fraction): root-most blocks first, as a
        # prefix hit needs them; none left, the Prefetch is settled now with what is in G1.
        room = self.max_prefetch_blocks - self._prefetch_waiting
        budget = (f"prefetch budget: {max(room, 0)} of {max(1, len(keys))} blocks may wait "
                  f"(max_prefetch_blocks={self.max_prefetch_blocks}, "
                  f"{self._prefetch_waiting} waiting)")
        if room <= 0:
            clips = []
            retained = self._retain_until(action_id, handles, payload.deadline_s, owner, clips)
            self.counters.prefetch_clipped_blocks += requested.blocks - len(handles)
            return self._outcome(
                message_id, action_id, type_, CLIPPED,
                f"{budget}; not waiting: {len(handles)} of {requested.blocks} blocks in G1 "
                f"({retained} retained until the deadline"
                f"{_room(retained, handles, clips=clips)})",
                requested, self._amount(retained))
        clipped = None
        if len(keys) > room:
            self.counters.prefetch_clipped_blocks += len(keys) - room
            keys, clipped = keys[:room], budget
        pending = PendingPrefetch(message_id, keys, requested,
                                   self.clock() + payload.deadline_s, clipped, owner)
        self._pending[action_id] = pending
        self._prefetch_waiting += pending.cost
        if self.host_tier is None:
            source = f"{NO_HOST_TIER} to load from"
        else:
            in_host = sum(1 for k in keys if self.host_tier.contains(k))
            source = f"{in_host} in the host tier, which vLLM loads only when a request is admitted"
        notes = [f"{len(handles)} of {requested.blocks} blocks in G1; {source}; the rest "
                 "arrive only with a request, so the final outcome comes then or at the "
                 "deadline"]
        if clipped:
            notes.append(f"{clipped}: waiting for the first {len(keys)}")
        deferred = self._outcome(message_id, action_id, type_, DEFERRED, "; ".join(notes),
                                 requested, self._amount(len(handles)))
        if clipped:
            # Outcome 1.1: the most it can hold when it settles (its first keys), for the
            # router to reserve no more than that meanwhile (schemas.outcomes).
            deferred = msgspec.structs.replace(deferred, waits_for=self._amount(len(keys)))
        return deferred

    def _replace_waiting_prefetch(self, action_id: str) -> bool:
        """A newer action under the id of a Prefetch still waiting replaces it (a repeat
        the idempotency memory forgot, applied again as any forgotten repeat, or another
        action under that id): the Prefetch is waited for no more and its share of the
        budget is given back (before, a repeat's was lost for good). It never settles, so
        it can neither answer the id a second time nor replace the newer action's claim
        (before, settling retained its blocks under the id, which ended a Retain sent
        meanwhile under it). Counted (``prefetches_replaced``); the newer action's outcome
        says so (:data:`REPLACED_PREFETCH_NOTE`) and is the id's answer: a sender waiting
        on the id gets that, never silence. Returns whether one was replaced."""
        if (earlier := self._pending.pop(action_id, None)) is None:
            return False
        self._prefetch_waiting -= earlier.cost
        self.counters.prefetches_replaced += 1
        return True

    def _settle_prefetches(self, now: float) -> list[HintOutcome]:
        done: list[HintOutcome] = []
        type_ = ActionType.PREFETCH.value
        for action_id, pending in list(self._pending.items()):
            handles = [h for h in map(self.cache.lookup, pending.keys) if h is not None]
            want = len(pending.keys) if pending.clipped else pending.requested.blocks
            complete = bool(pending.keys) and len(handles) >= want
            if not complete and now < pending.deadline:
                continue
            del self._pending[action_id]
            self._prefetch_waiting -= pending.cost
            if complete:
                clips = []
                retained = self._retain_until(action_id, handles, pending.deadline - now,
                                              pending.owner, clips)
                held = (f"{retained} of {len(handles)} blocks retained until the deadline"
                        f"{_room(retained, handles, now >= pending.deadline, clips)}")
                if pending.clipped is None:
                    outcome = self._outcome(
                        pending.message_id, action_id, type_, _status(retained, handles),
                        f"blocks became resident in G1 before the deadline; {held}",
                        pending.requested, self._amount(retained))
                else:
                    outcome = self._outcome(
                        pending.message_id, action_id, type_, CLIPPED,
                        f"the {len(handles)} blocks it waited for became resident in G1 "
                        f"before the deadline; {held}; {pending.clipped}", pending.requested,
                        self._amount(retained))
            elif handles:
                outcome = self._outcome(
                    pending.message_id, action_id, type_, CLIPPED,
                    f"deadline passed with {len(handles)} of {pending.requested.blocks} "
                    "blocks in G1", pending.requested, self._amount(len(handles)))
            else:
                outcome = self._outcome(pending.message_id, action_id, type_, MISSING,
                                        "deadline passed with no target block in G1",
                                        pending.requested)
            self._remember(("hint", action_id), outcome)
            done.append(outcome)
        return done

    def _retain_until(self, action_id: str, handles: list[BlockHandle], ttl_s: float,
                      owner: str, clips: list[str]) -> int:
        """Retain a Prefetch's blocks until its deadline, at ``prefetch_retain_priority``
        as ``owner``'s claim (an agent runtime's Prefetch ranks with its Retains, above
        every planner claim: hold_records.AGENT_RANK); returns how many the retain took
        (its budget; on a hybrid model no position past the hit point), what clipped it
        added to ``clips``."""
        if ttl_s <= 0:
            return 0
        return self._retain(action_id, self.config.prefetch_retain_priority, ttl_s, handles,
                            clips, None, owner)
