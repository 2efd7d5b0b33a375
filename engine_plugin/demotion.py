"""Which blocks a Demote lets go: pure choices over the hold ledger and the host tier.

The executor supersedes the claims a Demote replaces, then asks :func:`demotable` which
of the target's resident blocks it may touch and :func:`with_host_copies` which of those
may let their GPU copy go first. Nothing here changes a ledger, a tier or the pool.
A Demote that waits for host copies is kept as a :class:`PendingDemote`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvhint.engine_plugin.block_cache import BlockCache, BlockHandle
from kvhint.engine_plugin.holds import HoldLedger
from kvhint.engine_plugin.host_tier import HostTier
from kvhint.schemas import HintOutcome, HintOwner, ParsedAction

PLANNER, AGENT = HintOwner.PLANNER.value, HintOwner.AGENT.value


@dataclass(slots=True)
class PendingDemote:
    """A Demote waiting for host copies vLLM's connector is still making, until
    ``deadline`` (clock seconds): set when it first came, ``demote_copy_wait_s`` later,
    and never moved by a repeat of it (same id, or a new id for the same target)."""

    message_id: str
    action: ParsedAction
    deadline: float
    deferred: HintOutcome  # its first outcome: what a repeat of it is answered

    @property
    def scope(self) -> tuple[str | None, str]:
        payload = self.action.payload
        return payload.target.session_id, payload.owner.value


def demotable(holds: HoldLedger, handles: Sequence[BlockHandle], owner: str,
              scope: str | None) -> list[BlockHandle]:
    """The blocks a Demote of ``owner`` may let go. Of a session (``scope``): those no
    claim holds but the ones the Demote supersedes (its owner's for the session; an
    agent's Demote the planner's too), so a block another session shares and retains, a
    shared prefix's retain, or (under a planner's Demote) an agent's claim keeps it in G1.
    By block hashes (a global admin's): a planner's spares the blocks an agent's claim
    holds; an agent's, none."""
    if scope is not None:
        owners = (AGENT, PLANNER) if owner == AGENT else (PLANNER,)
        return [h for h in handles if not holds.held_beyond(h.block_id, scope, owners)]
    if owner == AGENT:
        return list(handles)
    return [h for h in handles if not holds.held_by(h.block_id, AGENT)]


def with_host_copies(tier: HostTier, handles: Sequence[BlockHandle]) -> list[BlockHandle]:
    """The blocks whose GPU copy may go first. vLLM serves a prefix from G1 first and
    continues from the host tier, never back: a G1 block past a block that must be
    recomputed is wasted. So only blocks with a finished host copy that lie deeper than
    every block without one; the others stay in G1 as they were, and a Demote never
    costs a hit. (Also refreshes the kept copies in the tier's eviction order.)"""
    kept = tier.keep([h.key for h in handles])
    uncopied_depth = max((h.depth for h in handles if h.key not in kept), default=-1)
    return [h for h in handles if h.key in kept and h.depth > uncopied_depth]


def copies_on_their_way(tier: HostTier, cache: BlockCache,
                        handles: Sequence[BlockHandle]) -> int:
    """How many blocks lack a finished host copy that is on its way: in flight, or of a
    block a request still holds (vLLM's connector copies a request's blocks
    asynchronously as it computes them, and a Demote planned as a response ends can
    arrive first). A free block with no copy at all is not counted: the tier lost it, or
    vLLM never stores it (0.32 leaves a finished request's last, decode-completed block
    unstored)."""
    return sum(1 for h in handles
               if not tier.contains(h.key) and (tier.copying(h.key) or cache.in_use(h)))
