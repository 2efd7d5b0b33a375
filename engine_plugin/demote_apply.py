"""Demote in the executor (mixed into the
:class:`~kvhint.engine_plugin.executor.HintExecutor`): apply one, or keep it waiting for
the host copies vLLM's connector is still making (:class:`PendingDemote`, settled by
:meth:`DemoteMixin._settle_demotes` when they are done or at its deadline), and end a
waiting one a newer session-targeted action supersedes. Which blocks a Demote may let go
is :mod:`.demotion`'s choice."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from kvhint.engine_plugin.block_cache import BlockCache, BlockHandle
from kvhint.engine_plugin.config import PluginConfig
from kvhint.engine_plugin.demotion import (
    PendingDemote,
    copies_on_their_way,
    demotable,
    with_host_copies,
)
from kvhint.engine_plugin.holds import HoldLedger
from kvhint.engine_plugin.host_tier import HostTier
from kvhint.schemas import ActionType, Amount, HintOutcome, HintOwner, OutcomeStatus

if TYPE_CHECKING:
    from kvhint.schemas import Target

ACCEPTED, CLIPPED = OutcomeStatus.ACCEPTED, OutcomeStatus.CLIPPED
REJECTED = OutcomeStatus.REJECTED
PLANNER, AGENT = HintOwner.PLANNER.value, HintOwner.AGENT.value


class DemoteMixin:
    """The executor's Demote handling; the executor sets these up and supplies the
    outcome helpers (``_outcome``, ``_amount``, ``_remember``) and ``_resolve`` and
    ``_dispatch``."""

    cache: BlockCache
    config: PluginConfig
    clock: Callable[[], float]
    host_tier: HostTier | None
    holds: HoldLedger
    _pending_demotes: dict[str, PendingDemote]
    _settled: list[HintOutcome]
    _outcome: Callable[..., HintOutcome]
    _amount: Callable[[int], Amount]
    _remember: Callable[[tuple[str, str], HintOutcome], None]
    _resolve: Callable[[Target], tuple[list[int], int] | list]
    _dispatch: Callable[..., HintOutcome]

    def _demote(self, answer: Callable[..., HintOutcome], scope: str | None, owner: str,
                handles: list[BlockHandle], requested: Amount, notes: list[str]
                ) -> HintOutcome:
        assert self.host_tier is not None
        if scope is not None:
            self.holds.supersede(scope, owner)
            if owner == AGENT:
                self.holds.supersede(scope, PLANNER)
        mine = demotable(self.holds, handles, owner, scope)
        if spared := len(handles) - len(mine):
            notes.append(f"{spared} blocks other claims hold stay in G1 (another session's, "
                         "a shared prefix's, or an agent's)")
        copied = with_host_copies(self.host_tier, mine)
        # Retains left on them (only a block-hash Demote finds any) dropped, reported as
        # displaced; then the blocks go to the head of the eviction order, deepest first.
        # Pins stay (hard until their TTL): their blocks stay in G1, not counted demoted.
        self.holds.unretain(copied)
        demoted = [h for h in copied if not self.holds.is_held(h.block_id)]
        if pinned := len(copied) - len(demoted):
            notes.append(f"{pinned} pinned blocks stay in G1 until their Pin ends")
        self.cache.evict_first(demoted)
        if len(copied) < len(mine):
            uncopied = sum(1 for h in mine if not self.host_tier.contains(h.key))
            notes.append(f"{len(copied)} of {len(mine)} resident blocks demoted; the rest "
                         f"stay in G1 ({uncopied} without a finished host copy, and the "
                         "blocks before them)")
        # Nothing demoted because other claims hold every block is a clipped Demote (it
        # did all it may), not a rejected one: rejections in a row make the router stop
        # sending Demotes to this worker.
        status = ACCEPTED if not notes else (CLIPPED if demoted or not mine or pinned
                                             else REJECTED)
        return answer(status, "; ".join(notes), requested, self._amount(len(demoted)))

    def _copies_to_wait_for(self, handles: list[BlockHandle], owner: str,
                            scope: str | None) -> int:
        """How many of a Demote's own blocks (:func:`demotable`) have a host copy still
        on its way (:func:`copies_on_their_way`); 0 when the plugin does not wait."""
        assert self.host_tier is not None
        if self.config.demote_copy_wait_s <= 0:
            return 0
        return copies_on_their_way(self.host_tier, self.cache,
                                   demotable(self.holds, handles, owner, scope))

    def _supersede_waiting_demotes(self, session_id: str, owner: str, by: str
                                   ) -> list[PendingDemote]:
        """A newer session-targeted action of the same owner (the session's next turn came:
        a new protection) ends a Demote of that session still waiting for copies,
        unapplied; applied later, it would undo the newer action. Returns those ended."""
        ended: list[PendingDemote] = []
        for action_id, pending in list(self._pending_demotes.items()):
            if action_id == by or pending.scope != (session_id, owner):
                continue
            del self._pending_demotes[action_id]
            outcome = self._outcome(
                pending.message_id, action_id, ActionType.DEMOTE.value, REJECTED,
                f"superseded by {by} for the session while waiting for host copies; nothing "
                "changed")
            self._remember(("hint", action_id), outcome)
            self._settled.append(outcome)
            ended.append(pending)
        return ended

    def _settle_demotes(self, now: float) -> list[HintOutcome]:
        """Apply the waiting Demotes whose copies are done or whose deadline came."""
        done: list[HintOutcome] = []
        for action_id, pending in list(self._pending_demotes.items()):
            if now < pending.deadline:
                resolved = self._resolve(pending.action.payload.target)
                keys = resolved[0] if isinstance(resolved, tuple) else []
                handles = [h for h in map(self.cache.lookup, keys) if h is not None]
                if self._copies_to_wait_for(handles, pending.scope[1], pending.scope[0]):
                    continue
            del self._pending_demotes[action_id]
            outcome = self._dispatch(pending.message_id, pending.action, may_wait=False)
            self._remember(("hint", action_id), outcome)
            done.append(outcome)
        return done
