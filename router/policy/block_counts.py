"""Distinct blocks held per owner (a worker, a tenant, or a tenant's API holdings on one
worker), pinned and retained, as a worker counts them: a block under several holdings is
one block, pinned if any of them is a Pin, else retained (holdings.HoldingsLedger keeps
one per kind of owner). Pure; no I/O.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

# The slot of each holding type in a block's reference counts and an owner's totals.
PINNED, RETAINED = 0, 1


class BlockCounts:
    """Distinct blocks held, pinned and retained, per owner (a worker, a tenant, or a
    tenant's API holdings on one worker): per-(owner, block) reference counts by holding
    type, and running totals per owner that change only when a block's state (pinned /
    retained / not held) does."""

    def __init__(self) -> None:
        # (owner, worker) -> block -> [pins, retains]; an owner's blocks on a worker
        # apart, so the per-block loops below key by the block alone.
        self._refs: dict[tuple[Hashable, str], dict[int, list[int]]] = {}
        self.totals: dict[Hashable, list[int]] = {}
        # Live holdings of some blocks per owner, [Pins, Retains]: on a hybrid model each
        # also holds its own tail blocks (router.policy.claim_cost.held_pool_blocks).
        self.claims: dict[Hashable, list[int]] = {}

    def named(self, owner: Hashable, worker_id: str, keys: Sequence[int], slot: int,
              sign: int) -> None:
        # What a block counts as, before and after: pinned under any Pin, else retained
        # under any Retain (inline: the simulator's hottest loop, millions of keys a trace).
        totals = self.totals.setdefault(owner, [0, 0])
        refs_key = (owner, worker_id)
        refs_of = self._refs.get(refs_key)
        if refs_of is None:
            refs_of = self._refs[refs_key] = {}
        for key in keys:
            refs = refs_of.get(key)
            if refs is None:
                refs = refs_of[key] = [0, 0]
                before = None
            else:
                before = PINNED if refs[PINNED] else (RETAINED if refs[RETAINED] else None)
            refs[slot] += sign
            after = PINNED if refs[PINNED] else (RETAINED if refs[RETAINED] else None)
            if after is None:
                del refs_of[key]
            if before != after:
                if before is not None:
                    totals[before] -= 1
                if after is not None:
                    totals[after] += 1
        if not refs_of:
            del self._refs[refs_key]

    def counted(self, owner: Hashable, worker_id: str, keys: Sequence[int], slot: int) -> int:
        """How many of ``keys`` a new holding of type ``slot`` would not add to the
        owner's ``slot`` total: already pinned (for a Pin), already held (for a Retain:
        a pinned block stays pinned)."""
        refs_of = self._refs.get((owner, worker_id))
        if refs_of is None:
            return 0
        count = 0
        for key in keys:
            refs = refs_of.get(key)
            if refs is not None and (slot == RETAINED or refs[PINNED]):
                count += 1
        return count

    def replaced(self, owner: Hashable, worker_id: str, old: Sequence[int], old_slot: int,
                 new: Sequence[int], new_slot: int) -> tuple[list[int], list[int]]:
        """What a holding naming ``new`` (type ``new_slot``) that supersedes one naming
        ``old`` (type ``old_slot``; empty: none) on the worker does to the owner's
        [pinned, retained] totals: (freed, added), the first what dropping the old one
        takes off them (a block another holding holds too stays), the second what the new
        one then adds (a block another holding already counts so adds nothing; a Pin over
        one only retained moves it, +1 pinned and -1 retained). Read only; the named blocks
        only (a holding's unnamed ones are its own, one each)."""
        refs_of = self._refs.get((owner, worker_id), {})
        freed, added = [0, 0], [0, 0]
        after: dict[int, list[int]] = {}  # key -> its refs once the old holding is gone
        for key in old:
            _shift(refs_of, after, key, old_slot, -1, freed)
        for key in new:
            _shift(refs_of, after, key, new_slot, +1, added)
        # freed counts what the old holding's drop takes off, so as positive figures.
        return [-freed[0], -freed[1]], added

    def own(self, owner: Hashable, blocks: int, slot: int) -> None:
        """``blocks`` (negative: fewer) that no other holding can share."""
        if blocks:
            self.totals.setdefault(owner, [0, 0])[slot] += blocks

    def claim(self, owner: Hashable, slot: int, sign: int) -> None:
        """One holding of type ``slot`` more (+1) or fewer (-1) for ``owner``."""
        counts = self.claims.setdefault(owner, [0, 0])
        counts[slot] += sign
        if not any(counts):
            del self.claims[owner]


def _shift(refs_of: dict[int, list[int]], after: dict[int, list[int]], key: int, slot: int,
           sign: int, change: list[int]) -> None:
    """One more (``sign`` +1) or fewer (-1) holding of type ``slot`` on ``key`` in the
    working copy ``after`` of ``refs_of`` (:meth:`BlockCounts.replaced`); ``change`` takes
    the owner's totals' change."""
    refs = after.get(key)
    if refs is None:
        refs = after[key] = list(refs_of.get(key, (0, 0)))
    before = PINNED if refs[PINNED] else (RETAINED if refs[RETAINED] else None)
    refs[slot] = max(refs[slot] + sign, 0)
    now = PINNED if refs[PINNED] else (RETAINED if refs[RETAINED] else None)
    if before != now:
        if before is not None:
            change[before] -= 1
        if now is not None:
            change[now] += 1
