"""Distinct blocks held per owner (a worker, a tenant, or a tenant's API holdings on one
worker), pinned and retained, as a worker counts them: a block under several holdings is
one block, pinned if any of them is a Pin, else retained (holdings.HoldingsLedger keeps
one per kind of owner). Pure; no I/O.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

# The slot of each holding type in a block's reference counts and an owner's totals.
PINNED, RETAINED = 0, 1


def _state(refs: list[int]) -> int | None:
    """What a block counts as: pinned under any Pin, else retained under any Retain."""
    if refs[PINNED]:
        return PINNED
    return RETAINED if refs[RETAINED] else None


class BlockCounts:
    """Distinct blocks held, pinned and retained, per owner (a worker, a tenant, or a
    tenant's API holdings on one worker): per-(owner, block) reference counts by holding
    type, and running totals per owner that change only when a block's state (pinned /
    retained / not held) does."""

    def __init__(self) -> None:
        self._refs: dict[tuple[Hashable, str, int], list[int]] = {}
        self.totals: dict[Hashable, list[int]] = {}

    def named(self, owner: Hashable, worker_id: str, keys: Sequence[int], slot: int,
              sign: int) -> None:
        refs_of, totals = self._refs, self.totals.setdefault(owner, [0, 0])
        for key in keys:
            ref_key = (owner, worker_id, key)
            refs = refs_of.get(ref_key)
            if refs is None:
                refs = refs_of[ref_key] = [0, 0]
            before = _state(refs)
            refs[slot] += sign
            after = _state(refs)
            if after is None:
                del refs_of[ref_key]
            if before != after:
                if before is not None:
                    totals[before] -= 1
                if after is not None:
                    totals[after] += 1

    def counted(self, owner: Hashable, worker_id: str, keys: Sequence[int], slot: int) -> int:
        """How many of ``keys`` a new holding of type ``slot`` would not add to the
        owner's ``slot`` total: already pinned (for a Pin), already held (for a Retain:
        a pinned block stays pinned)."""
        refs_of = self._refs
        count = 0
        for key in keys:
            refs = refs_of.get((owner, worker_id, key))
            if refs is not None and (slot == RETAINED or refs[PINNED]):
                count += 1
        return count

    def own(self, owner: Hashable, blocks: int, slot: int) -> None:
        """``blocks`` (negative: fewer) that no other holding can share."""
        if blocks:
            self.totals.setdefault(owner, [0, 0])[slot] += blocks
