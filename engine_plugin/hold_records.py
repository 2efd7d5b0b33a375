"""The hold ledger's records: a hold on one block, one action's claim, what a claim lost
unasked (:class:`ClaimLoss`), the ledger's counters, the claim kinds and loss reasons,
and the retain order (:func:`retain_rank`: an agent runtime's claims above the planner's).
Plain data; :class:`~kvhint.engine_plugin.holds.HoldLedger` keeps them consistent."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvhint.engine_plugin.block_cache import BlockHandle
from kvhint.schemas import HintOwner

PIN, RETAIN = "pin", "retain"
# Loss reasons. Each is its wire value (schemas.releases.ReleaseReason), sent as is.
DISPLACED, PRESSURE, RESET = "displaced", "pressure", "reset"
# vLLM dropped a held block from its prefix cache by another path (evict_blocks after a
# failed KV load, a cache-entry move): the hold protected nothing any more.
GONE = "gone"

# The order retained blocks go in (displaced by the retain budget, relieved under
# pressure): a claim's *rank*, its priority, plus AGENT_RANK for an agent runtime's claim
# (owner "agent", hints API; an agent's Prefetch retains as one too): every agent claim
# outranks every claim of the router's planner (and the plugin's own donor retains, a
# planner's Prefetch's), whatever their priorities;
# within each, the higher priority first. An agent runtime's explicit claim is kept ahead
# of the planner's predictions; the router caps what one tenant's agents claim on a
# worker (``budget.max_worker_share``).
AGENT_RANK = 101
ANY_RANK = 2 * AGENT_RANK  # above every rank: what relief and the budget's fit may take


def retain_rank(priority: int, owner: str) -> int:
    """A retain claim's rank (see AGENT_RANK)."""
    return priority + AGENT_RANK if owner == HintOwner.AGENT.value else priority


def retain_room_holders(priority: int, owner: str) -> str:
    """What holds the retain budget's room a Retain at ``priority`` of ``owner`` could not
    displace (every retained block left ranks at or above it). No figures, no tenant:
    the router shows it to the tenant whose action it answers."""
    if owner == HintOwner.AGENT.value:
        return (f"the room is held by agent runtimes' Retains of priority {priority} or "
                "more (an agent's Retains rank above the router planner's)")
    return (f"the room is held by the planner's (and this plugin's own) Retains of "
            f"priority {priority} or more and by any agent runtime's (an agent's Retains "
            "rank above the planner's)")


@dataclass(frozen=True, slots=True)
class DonorClaim:
    """The ledger key of a donor advice's retain claim: its own key space, never equal to
    a hint action's id (a str), so an advice and a hint sharing an id never replace each
    other's claim (nor does a waiting Prefetch settling under that id). Reports to the
    router name ``advice_id`` (:func:`claim_action_id`)."""

    advice_id: str


# A claim's key in the ledger: a hint action's id, or a donor advice's DonorClaim.
ClaimKey = str | DonorClaim


def claim_action_id(key: ClaimKey) -> str:
    """The id the router knows a claim by (its action's, its advice's)."""
    return key.advice_id if isinstance(key, DonorClaim) else key


@dataclass(slots=True)
class Hold:
    handle: BlockHandle
    pins: dict[ClaimKey, float] = field(default_factory=dict)  # claim key -> expiry
    retains: dict[ClaimKey, int] = field(default_factory=dict)  # claim key -> rank
    version: int = 0  # of its live entry in the pressure heap (older entries are stale)
    touched: int = 0  # sequence number of the latest retain claim (LRU among equals)
    # Retain claims per rank (priority, AGENT_RANK up for an agent's; at most 202 keys):
    # the hold's priority (its highest rank) is read from it,
    # not from ``retains``, which one block's claims can make long (before, each claim
    # made or ended on a block rescanned them all: 10k on 4 blocks expired in 2.5 s).
    levels: dict[int, int] = field(default_factory=dict)

    def add_retain(self, action_id: ClaimKey, priority: int) -> None:
        self.drop_retain(action_id)
        self.retains[action_id] = priority
        self.levels[priority] = self.levels.get(priority, 0) + 1

    def drop_retain(self, action_id: ClaimKey) -> bool:
        """Whether ``action_id`` had a retain claim here (now dropped)."""
        priority = self.retains.pop(action_id, None)
        if priority is None:
            return False
        if (left := self.levels[priority] - 1) > 0:
            self.levels[priority] = left
        else:
            del self.levels[priority]
        return True

    def clear_retains(self) -> None:
        self.retains.clear()
        self.levels.clear()

    @property
    def priority(self) -> int:
        """The highest rank (:func:`retain_rank`) of its retain claims."""
        return max(self.levels)


@dataclass(slots=True)
class Claim:
    kind: str
    block_ids: set[int]
    expiry: float
    scope: str | None  # the session a session-targeted action was about
    owner: str  # whose claim (HintOwner's value)
    # Its block ids by depth, built at its first cut on a hybrid model (.hold_cuts) and
    # read from ``from_depth`` to ``deepest`` only, so cutting a long claim position by
    # position (relief, deepest first) costs each block once, not the claim's size a cut.
    # Entries of blocks no longer in ``block_ids`` are stale (skipped).
    by_depth: dict[int, list[int]] | None = None
    deepest: int = -1
    # A hybrid model's claim (it may hold ``side`` blocks, .hold_cuts): a position it
    # loses unasked takes that position's side blocks with it. False on a one-group model,
    # whose losses then cost nothing more.
    sided: bool = False


@dataclass(frozen=True, slots=True)
class ClaimLoss:
    """Blocks one claim lost for ``reason`` since the last :meth:`HoldLedger.take_losses`;
    ``held``: the blocks it still holds (0 once it holds none or has ended)."""

    action_id: ClaimKey  # claim_action_id() gives the id the router knows
    kind: str
    scope: str | None
    reason: str
    released: int
    held: int


@dataclass(slots=True)
class HoldCounters:
    released_under_pressure: int = 0
    # Retained blocks relief passed over because a running request also used them, once
    # per relief call (an allocation that retries relief counts a block again).
    kept_in_use_under_pressure: int = 0
    # Retained pool blocks given back and reported ``displaced``: a higher-ranked
    # Retain's or the budget's displacement, a Demote or a block-hash release naming them.
    displaced: int = 0
    released_on_reset: int = 0
    expired_claims: int = 0
    superseded_claims: int = 0
    # Held blocks vLLM dropped from its prefix cache by another path: their holds were
    # given back (a budget is never spent on a block that no longer caches anything).
    released_gone: int = 0
