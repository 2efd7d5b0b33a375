"""What a claim lets go of besides the blocks it lost (mixed into
:class:`~kvhint.engine_plugin.holds.HoldLedger`), on a hybrid model: a claim holds, beside
the followed group's block at each target position, the other KV-cache groups' blocks
(``side``) vLLM's hybrid prefix hit needs (:mod:`~kvhint.engine_plugin.group_holds`).
A side block sits at its position's key and serves only hit points past its position,
which need every position before them too. So:

- a claim that loses a side block unasked (relief, displacement, ``gone``) can give no
  hit past that position any more: it lets go of its blocks there and deeper
  (:meth:`HoldCutsMixin._cut_claim`), and the positions among them are reported lost
  for the same reason (the router counts a claim's positions; before, losing only side
  blocks was not reported at all, and the router counted positions as protected whose
  hit was gone);
- a claim that loses positions (a Demote naming them) lets go of its side blocks at
  positions it no longer holds (:meth:`HoldCutsMixin._drop_stranded_sides`; before, they
  stayed held, against the budget, until the claim ended); a position lost unasked
  (relief, displacement, ``gone``) takes its side blocks with it
  (:meth:`HoldCutsMixin._drop_sides_at`; before, they stayed held).

Positions before a lost side block stay held: a hit there may still be found (with the
other groups' blocks resident unheld, or a claim shorter than a window). A one-group
model holds no side blocks: nothing here runs.
"""

from __future__ import annotations

from collections.abc import Callable

from kvhint.engine_plugin.block_cache import BlockHandle
from kvhint.engine_plugin.hold_records import PIN, Claim, ClaimKey, Hold


class HoldCutsMixin:
    """The ledger's cuts of one claim; the ledger sets these up and supplies
    ``_note_loss``, ``_forget_hold`` and ``_push_pressure``."""

    _holds: dict[int, Hold]
    _claims: dict[ClaimKey, Claim]
    _pinned: int
    _retained: int
    _note_loss: Callable[[ClaimKey, Claim, str, int], None]
    _forget_hold: Callable[[int], None]
    _push_pressure: Callable[[Hold], None]

    def _cut_after_loss(self, cut: list[ClaimKey], released: list[BlockHandle],
                        lost: BlockHandle, reason: str) -> None:
        """Claims ``cut`` lost block ``lost`` unasked for ``reason`` (relief, displacement,
        ``gone``; the loss noted by the caller): a side block leaves no hit past its
        position, so each lets go of its blocks from there on (:meth:`_cut_claim`); a
        position takes its side blocks with it (:meth:`_drop_sides_at`). Blocks left with
        no claim go to ``released``."""
        if lost.side:
            for action_id in cut:
                self._cut_claim(action_id, released, lost.depth, reason)
        else:
            for action_id in cut:
                self._drop_sides_at(action_id, released, lost)

    def _cut_claim(self, action_id: ClaimKey, released: list[BlockHandle],
                   from_depth: int, reason: str) -> None:
        """Claim ``action_id`` lets go of its blocks at depth ``from_depth`` and deeper,
        noting the positions among them as lost for ``reason``; blocks left with no
        claim go to ``released``. The claim stays (until its expiry) when it is left
        holding nothing, as after any loss."""
        claim = self._claims.get(action_id)
        if claim is None:
            return
        holds = self._holds
        index = self._depth_index(claim)
        lost = 0
        for depth in range(from_depth, claim.deepest + 1):
            for block_id in index.pop(depth, ()):
                if block_id not in claim.block_ids:
                    continue  # lost already
                claim.block_ids.discard(block_id)
                hold = holds.get(block_id)
                if hold is not None and self._let_go(action_id, claim.kind, hold, released) \
                        and not hold.handle.side:
                    lost += 1
        claim.deepest = min(claim.deepest, from_depth - 1)
        if lost:
            self._note_loss(action_id, claim, reason, lost)

    def _depth_index(self, claim: Claim) -> dict[int, list[int]]:
        """``claim``'s block ids by depth (:attr:`Claim.by_depth`), built at its first use."""
        index = claim.by_depth
        if index is None:
            holds = self._holds
            index = claim.by_depth = {}
            for block_id in claim.block_ids:
                if (hold := holds.get(block_id)) is not None:
                    index.setdefault(hold.handle.depth, []).append(block_id)
            claim.deepest = max(index, default=-1)
        return index

    def _drop_sides_at(self, action_id: ClaimKey, released: list[BlockHandle],
                       position: BlockHandle) -> None:
        """Claim ``action_id``, having lost ``position`` unasked (relief, displacement,
        ``gone``; its loss noted by the caller), lets go of its side blocks at that
        position: they served only hit points past it. Blocks left with no claim go to
        ``released``. Nothing on a one-group model's claim (not ``sided``)."""
        claim = self._claims.get(action_id)
        if claim is None or not claim.sided:
            return
        holds = self._holds
        for block_id in self._depth_index(claim).get(position.depth, ()):
            hold = holds.get(block_id)
            if hold is None or not hold.handle.side or hold.handle.key != position.key \
                    or block_id not in claim.block_ids:
                continue
            claim.block_ids.discard(block_id)
            self._let_go(action_id, claim.kind, hold, released)

    def _drop_stranded_sides(self, action_id: ClaimKey, released: list[BlockHandle]) -> None:
        """Claim ``action_id``, having lost positions, lets go of its side blocks at
        positions it no longer holds (their loss is not noted: the positions' were);
        blocks left with no claim go to ``released``. Nothing on a one-group model's claim
        (not ``sided``: it holds no side blocks)."""
        claim = self._claims.get(action_id)
        if claim is None or not claim.sided:
            return
        holds = self._holds
        sides: list[Hold] = []
        kept_keys: set[int] = set()
        for block_id in claim.block_ids:
            hold = holds.get(block_id)
            if hold is None:
                continue
            if hold.handle.side:
                sides.append(hold)
            else:
                kept_keys.add(hold.handle.key)
        for hold in sides:
            if hold.handle.key not in kept_keys:
                claim.block_ids.discard(hold.handle.block_id)
                self._let_go(action_id, claim.kind, hold, released)

    def _let_go(self, action_id: ClaimKey, kind: str, hold: Hold,
                released: list[BlockHandle]) -> bool:
        """Drop claim ``action_id``'s pin or retain (``kind``) on ``hold``, the pinned and
        retained counts following; a hold left with no claim is forgotten and its block
        goes to ``released``. Returns whether the claim was on it."""
        if kind == PIN:
            if hold.pins.pop(action_id, None) is None:
                return False
            if not hold.pins:
                self._pinned -= 1
                if hold.retains:
                    self._retained += 1
                    self._push_pressure(hold)
        else:
            if not hold.drop_retain(action_id):
                return False
            if not hold.pins:
                if hold.retains:
                    self._push_pressure(hold)  # its priority may have dropped
                else:
                    self._retained -= 1
        if not hold.pins and not hold.retains:
            self._forget_hold(hold.handle.block_id)
            released.append(hold.handle)
        return True
