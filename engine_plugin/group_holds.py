"""What a Pin or Retain holds on a hybrid model: every KV cache group's blocks that vLLM's
prefix hit at the claim's end needs, not only the followed (full-attention) group's.

vLLM's hybrid coordinator accepts a hit of N blocks only when every group has what it
needs (the cache port's ``hit_groups``, read from vLLM by the adapter): another
full-attention group its blocks at all N positions; a sliding-window group its blocks at
the last ``tail`` positions before N; a Mamba group its state at position N (N - 1 with
EAGLE, whose hit of N - 1 matches the followed group's N and drops the last: the tail's
``lag``). Holding the
followed group's blocks alone (before) left the others to eviction, and a Pinned
session's next turn hit nothing.

A claim over target positions 1..N therefore holds, up to its *hit point* M: the
furthest position (within the run of consecutive positions the target starts with) at
which every group has what a hit needs resident now (:func:`claim_blocks`):
- the followed group's block at each position 1..M (one per position, what ``applied``
  and the router count);
- each other full-attention group's block at each of those positions;
- each tail group's blocks for M, so vLLM finds a hit of at least M blocks while the
  claim holds.
Positions past M are not held: no hit reaches them (at vLLM's default
``--prefix-cache-retention-interval`` 0 a response's window blocks are never cached, so a
session's chain usually stops short at its last prompt's end). The claim is ``clipped``
and says how far a hit reaches (:data:`~kvhint.schemas.outcomes.CLIPPED_HIT_REACH`);
before, it held the followed and other full-attention groups' blocks past M and counted
them in ``applied``, budgets and gauges, and the router counted them protected.
Every ledger hold is then one pool block, so budgets, relief and the pinned/retained
gauges count pool blocks. A budget that cannot take it all keeps the prefix whose hit,
tail included, reaches furthest (:meth:`_Shape.clip`), with no position past that hit
point (before, the longest prefix with that hit point), never positions without their tail
(the ledger's own clip, root-most first, would fill the room with positions and leave
some group's tail out: no hit at all). A claim's ``applied`` and the losses the router
hears of count target positions only (``side`` blocks not). A claim losing a side block
unasked (relief, displacement, ``gone``) lets go of its positions from that one on, whose
hit needed it, and those are reported; a Demote naming positions also drops each cut
claim's side blocks at the positions it no longer holds (:mod:`.hold_cuts`); a
block-hash release takes the side blocks at the positions it names
(:func:`with_side_blocks`).

Cost: one hit's tail a tail group, whatever the target's length; Gemma 3's layout
(5 or 6 sliding-window groups of 1024 tokens, block size 16) holds 320 or 384 more pool
blocks a claim of 64 positions or more; gpt-oss (one of 128) 8.

A one-group model has no ``hit_groups``: its handles pass through unchanged. A model with
a group no hold can take (the cache port's ``unheld_groups``: a kind or block size vLLM's
hit rules here do not cover) keeps no hit whatever is held: its Pins, Retains, Prefetches
and donor advice's retains are refused (:func:`unheld_reason`), not answered ``accepted``
with that group left out.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from kvhint.engine_plugin.block_cache import BlockCache, BlockHandle, GroupNeed
from kvhint.schemas.outcomes import CLIPPED_HIT_REACH, REJECTED_UNHELD_GROUPS

# The ledger's budget clip: (whether a block id is not held yet, room for such blocks) ->
# the blocks to hold.
Clip = Callable[[Callable[[int], bool], int], list[BlockHandle]]


def claim_blocks(cache: BlockCache, handles: list[BlockHandle]
                 ) -> tuple[list[BlockHandle], Clip | None, str | None]:
    """The blocks a claim on ``handles`` (the followed group's, root-most first) holds,
    the budget clip for them (None: the ledger's own, root-most first), and a note when
    the other groups' blocks let a hit reach fewer positions than the target has."""
    needs = cache.hit_groups
    if not needs or not handles:
        return handles, None, None
    shape = _Shape(cache, needs, handles)
    note = shape.note()
    shape.cut_at_hit()
    if not shape.primary:
        return [], None, note  # no hit: nothing a hold keeps
    return shape.blocks(len(shape.primary)), shape.clip, note


def unheld_reason(cache: BlockCache) -> str | None:
    """Why a Pin, Retain, Prefetch or retained donor advice is refused on this model (a
    capability rejection: the router stops sending them to the worker), or None when
    holds can keep its hit."""
    unheld = cache.unheld_groups
    if not unheld:
        return None
    return (f"{REJECTED_UNHELD_GROUPS}: vLLM's prefix hit also needs the blocks of KV cache "
            f"groups {', '.join(unheld)}, of a kind or block size no hold can take; "
            "nothing held")


def positions(handles: list[BlockHandle]) -> int:
    """Target positions among held blocks: the followed group's (``applied``'s unit)."""
    return sum(1 for h in handles if not h.side)


class _Shape:
    """One claim's blocks by position (index into the target's handles). The tail
    groups' blocks are looked up lazily: a claim whose hit point is its end (the usual
    case) reads only the last window's, as vLLM's right-to-left search does."""

    def __init__(self, cache: BlockCache, needs: tuple[GroupNeed, ...],
                 handles: list[BlockHandle]) -> None:
        # The followed group's block alone: the others are held as their own blocks.
        self.primary = [replace(h, blocks=h.blocks[:1]) for h in handles]
        self.cache = cache
        start = handles[0].depth
        run = 0  # positions a hit can reach: consecutive from the first one's
        while run < len(handles) and handles[run].depth == start + run:
            run += 1
        self.full = [[cache.side_block(h, n.group_id) for h in handles]
                     for n in needs if n.tail is None]
        # A hit needs every other full-attention group's blocks before it, as the
        # followed group's.
        for i in range(run):
            if any(blocks[i] is None for blocks in self.full):
                run = i
                break
        self.run = run
        self.tails = [(n.tail, n.lag, n.group_id) for n in needs if n.tail is not None]
        self._looked_up: dict[tuple[int, int], BlockHandle | None] = {}
        self.hit = {len(handles): self.hit_at(len(handles))}

    def cut_at_hit(self) -> None:
        """Drop the positions past the target's hit point: no hit reaches them, so a
        claim holds none of their blocks (before, it held the followed and other
        full-attention groups' blocks there, counted them in ``applied``, budgets and
        gauges, and the router counted them protected)."""
        hit = self.hit[len(self.primary)]
        if hit >= len(self.primary):
            return
        self.primary = self.primary[:hit]
        self.full = [blocks[:hit] for blocks in self.full]
        self.run = min(self.run, hit)
        self.hit = {hit: hit}

    def _tail_block(self, t: int, i: int) -> BlockHandle | None:
        key = (t, i)
        if key not in self._looked_up:
            self._looked_up[key] = self.cache.side_block(self.primary[i], self.tails[t][2])
        return self._looked_up[key]

    def hit_at(self, num: int) -> int:
        """The furthest hit point at or before ``num`` positions (0: none) that every
        group's resident blocks allow. A missing tail block at position j rules out every
        hit point whose window (ending ``lag`` positions before it) covers it, so the
        search goes on below j + lag (vLLM's)."""
        i = min(num, self.run) - 1
        while i >= 0:
            cut = -1  # the furthest hit point (its last index) a missing block rules out
            for t, (tail, lag, _) in enumerate(self.tails):
                top = i - lag
                for j in range(top, max(0, top + 1 - tail) - 1, -1):
                    if j + lag <= cut:
                        break
                    if self._tail_block(t, j) is None:
                        cut = j + lag
                        break
            if cut < 0:
                return i + 1
            i = cut - 1
        return 0

    def _tail(self, hit: int) -> list[BlockHandle]:
        return [b for t, (tail, lag, _) in enumerate(self.tails)
                for i in range(max(0, hit - lag - tail), hit - lag)
                if (b := self._tail_block(t, i)) is not None]

    def blocks(self, num: int) -> list[BlockHandle]:
        """The blocks a claim on the first ``num`` positions holds."""
        out = list(self.primary[:num])
        out.extend(b for blocks in self.full for b in blocks[:num] if b is not None)
        hit = self.hit.get(num)
        if hit is None:
            hit = self.hit[num] = self.hit_at(num)
        out.extend(self._tail(hit))
        return out

    def clip(self, fresh: Callable[[int], bool], room: int) -> list[BlockHandle]:
        """The blocks to hold when at most ``room`` may be ``fresh`` (not held yet): the
        prefix of positions up to the furthest hit point that fits, with that hit
        point's blocks, and the target's blocks already held. Reads
        every tail block of the run (the rare path: a short budget)."""
        prefix = [0] * (len(self.primary) + 1)
        for i, h in enumerate(self.primary):
            prefix[i + 1] = prefix[i] + fresh(h.block_id) + sum(
                1 for blocks in self.full if (b := blocks[i]) is not None and fresh(b.block_id))
        cumulative = []
        for t in range(len(self.tails)):
            sums = [0]
            for i in range(self.run):
                b = self._tail_block(t, i)
                sums.append(sums[-1] + (b is not None and fresh(b.block_id)))
            cumulative.append(sums)
        # Every prefix's hit point, left to right: a group's streak of resident blocks
        # ending at each position.
        streaks = []
        for t in range(len(self.tails)):
            streak = [0]
            for i in range(self.run):
                streak.append(streak[-1] + 1 if self._tail_block(t, i) is not None else 0)
            streaks.append(streak)
        hit = 0
        for i in range(len(self.primary)):
            if i < self.run:
                ok = True
                for (tail, lag, _), streak in zip(self.tails, streaks):
                    end = i + 1 - lag  # positions up to the window's end
                    ok = ok and (end <= 0 or streak[end] >= min(tail, end))
                hit = i + 1 if ok else hit
            self.hit[i + 1] = hit
        best = 0  # the furthest hit point that fits, held with no position past it
        for num in range(len(self.primary), 0, -1):
            if self.hit[num] != num:
                continue  # positions past a hit point keep no hit
            ends = [(tail, max(0, num - lag)) for tail, lag, _ in self.tails]
            cost = prefix[num] + sum(sums[end] - sums[max(0, end - tail)]
                                     for (tail, end), sums in zip(ends, cumulative))
            if cost <= room:
                best = num
                break
        held = self.blocks(best)
        ids = {b.block_id for b in held}
        held.extend(b for b in self.blocks(len(self.primary))
                    if b.block_id not in ids and not fresh(b.block_id))
        return held

    def note(self) -> str | None:
        hit, total = self.hit[len(self.primary)], len(self.primary)
        if hit >= total:
            return None
        return (f"the other KV cache groups' blocks a prefix hit needs are resident for "
                f"{hit} of {total} target blocks: {CLIPPED_HIT_REACH}{hit}, and the "
                f"{total - hit} past it are not held")


def with_side_blocks(cache: BlockCache, handles: list[BlockHandle]) -> list[BlockHandle]:
    """``handles`` and every other group's blocks at their positions: what a release by
    block hashes lets go of (a claim's side blocks go with its positions)."""
    out = list(handles)
    for need in cache.hit_groups:
        out.extend(b for h in handles if (b := cache.side_block(h, need.group_id)) is not None)
    return out
