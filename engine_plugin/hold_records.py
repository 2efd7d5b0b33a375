"""The hold ledger's records: a hold on one block, one action's claim, what a claim lost
unasked (:class:`ClaimLoss`), the ledger's counters, and the claim kinds and loss reasons.
Plain data; :class:`~kvhint.engine_plugin.holds.HoldLedger` keeps them consistent."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvhint.engine_plugin.block_cache import BlockHandle

PIN, RETAIN = "pin", "retain"
# Loss reasons. Each is its wire value (schemas.releases.ReleaseReason), sent as is.
DISPLACED, PRESSURE, RESET = "displaced", "pressure", "reset"
# vLLM dropped a held block from its prefix cache by another path (evict_blocks after a
# failed KV load, a cache-entry move): the hold protected nothing any more.
GONE = "gone"



@dataclass(slots=True)
class Hold:
    handle: BlockHandle
    pins: dict[str, float] = field(default_factory=dict)  # action id -> expiry
    retains: dict[str, int] = field(default_factory=dict)  # action id -> priority
    version: int = 0  # of its live entry in the pressure heap (older entries are stale)
    touched: int = 0  # sequence number of the latest retain claim (LRU among equals)
    # Retain claims per priority (at most 101 keys): the hold's priority is read from it,
    # not from ``retains``, which one block's claims can make long (before, each claim
    # made or ended on a block rescanned them all: 10k on 4 blocks expired in 2.5 s).
    levels: dict[int, int] = field(default_factory=dict)

    def add_retain(self, action_id: str, priority: int) -> None:
        self.drop_retain(action_id)
        self.retains[action_id] = priority
        self.levels[priority] = self.levels.get(priority, 0) + 1

    def drop_retain(self, action_id: str) -> bool:
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
        """The highest priority of its retain claims."""
        return max(self.levels)


@dataclass(slots=True)
class Claim:
    kind: str
    block_ids: set[int]
    expiry: float
    scope: str | None  # the session a session-targeted action was about
    owner: str  # whose claim (HintOwner's value)


@dataclass(frozen=True, slots=True)
class ClaimLoss:
    """Blocks one claim lost for ``reason`` since the last :meth:`HoldLedger.take_losses`;
    ``held``: the blocks it still holds (0 once it holds none or has ended)."""

    action_id: str
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
    displaced: int = 0
    released_on_reset: int = 0
    expired_claims: int = 0
    superseded_claims: int = 0
    # Held blocks vLLM dropped from its prefix cache by another path: their holds were
    # given back (a budget is never spent on a block that no longer caches anything).
    released_gone: int = 0
