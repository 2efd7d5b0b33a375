"""Retain claims given up for the engine's memory (mixed into
:class:`~kvhint.engine_plugin.holds.HoldLedger`): relief when vLLM cannot allocate
(:meth:`HoldReliefMixin.relieve`, and :meth:`~HoldReliefMixin.releasable`, what it could
free), displacement past the retain budget, and the pressure heap that orders both:
lowest priority first, then least recently claimed, then leaf first. Stale heap entries
are skipped lazily and the heap is rebuilt when they pile up."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable

from kvhint.engine_plugin.block_cache import BlockCache, BlockHandle
from kvhint.engine_plugin.hold_records import (
    ANY_RANK,
    DISPLACED,
    PRESSURE,
    Claim,
    ClaimKey,
    Hold,
    HoldCounters,
)

# Entries a lazily-cleaned heap may hold beyond twice its live ones before it is rebuilt.
COMPACT_SLACK = 1024


class HoldReliefMixin:
    """The ledger's relief and displacement; the ledger sets these up and supplies the
    bookkeeping helpers (``_note_loss``, ``_forget_hold``, ``_release``)."""

    cache: BlockCache
    max_retained: int
    counters: HoldCounters
    _holds: dict[int, Hold]
    _claims: dict[ClaimKey, Claim]
    _retained: int
    _pressure_heap: list[tuple[int, int, int, int, int]]
    _seq: itertools.count
    _note_loss: Callable[[ClaimKey, Claim, str, int], None]
    _cut_after_loss: Callable[[list[ClaimKey], list[BlockHandle], BlockHandle, str], None]
    _forget_hold: Callable[[int], None]
    _release: Callable[[list[BlockHandle]], None]

    def relieve(self, num_blocks: int, keep: frozenset[int] = frozenset()) -> int:
        """The engine needs memory: drop up to ``num_blocks`` retained blocks, only ones
        whose release frees memory (a block a running request also uses, or one in
        ``keep``, the allocating request's own hits, stays held: its protection would be
        lost for nothing)."""
        released = self._drop_retained(num_blocks, ANY_RANK, PRESSURE, only_freeing=True,
                                       keep=keep)
        self.counters.released_under_pressure += released
        return released

    def releasable(self, enough: int, keep: frozenset[int] = frozenset()) -> int:
        """Retained blocks :meth:`relieve` could free now (see there), counted up to
        ``enough``: relief that cannot free enough releases nothing."""
        count, in_use = 0, self.cache.in_use
        for hold in self._holds.values() if enough > 0 else ():
            if hold.retains and not hold.pins and hold.handle.block_id not in keep \
                    and not in_use(hold.handle):
                count += 1
                if count >= enough:
                    break
        return count

    def _fit_retained(self) -> None:
        """Back within ``max_retained``: a block whose pin ended while a retain also
        covered it becomes retained without the retain budget having counted it (a
        retain charges only blocks not held already), so the excess is displaced, lowest
        priority first."""
        excess = self._retained - self.max_retained
        if excess > 0:
            self.counters.displaced += self._drop_retained(excess, ANY_RANK, DISPLACED)

    def _push_pressure(self, hold: Hold) -> None:
        # Versions come from the ledger-wide sequence, not a per-hold count: a superseded
        # claim's hold is deleted and a new one made for the same block, and a per-hold
        # count would restart there and match the old hold's stale entries (its old,
        # lower priority would then decide when the block goes).
        hold.version = next(self._seq)
        heapq.heappush(self._pressure_heap, self._pressure_entry(hold))
        if len(self._pressure_heap) > 2 * len(self._holds) + COMPACT_SLACK:
            # Stale entries leave the heap only when they reach its top, and a high
            # priority's may never do: re-prioritising every idle review would grow the
            # heap without bound. Rebuild it from the live entries (amortised O(1)).
            self._pressure_heap = [self._pressure_entry(h) for h in self._holds.values()
                                   if h.retains and not h.pins]
            heapq.heapify(self._pressure_heap)

    @staticmethod
    def _pressure_entry(hold: Hold) -> tuple[int, int, int, int, int]:
        return (hold.priority, hold.touched, -hold.handle.depth,
                hold.handle.block_id, hold.version)

    def _drop_retained(self, num_blocks: int, below_priority: int, reason: str,
                       only_freeing: bool = False, keep: frozenset[int] = frozenset()
                       ) -> int:
        """Release up to ``num_blocks`` retain-only holds with priority (rank,
        :func:`~kvhint.engine_plugin.hold_records.retain_rank`) below ``below_priority``,
        in pressure order, noting the claims' losses as ``reason``;
        returns how many. ``only_freeing``: pass over (and keep) holds on blocks in use
        elsewhere. ``keep``: block ids passed over (kept) whatever the reason (relief: the
        allocating request's own hits; displacement: the displacing Retain's targets).

        On a hybrid model a dropped hold's claims may let go of more of their blocks
        (:mod:`.hold_cuts`), ``keep`` ones among them: those are released (their claims
        lost them) but make no room, since the displacing Retain takes them again or the
        allocating request reads them back (vLLM counts a free hit block as one to
        allocate); under ``only_freeing`` neither does a block a request still uses. So
        the loop runs until ``num_blocks`` released blocks make room (before, every
        release counted: a cut that released the displacing Retain's own positions
        stopped displacement short, and the Retain was clipped though lower ranks still
        held room). Returns every block released."""
        heap = self._pressure_heap
        released: list[BlockHandle] = []
        passed_over: list[tuple[int, int, int, int, int]] = []
        made_room = 0
        while heap and made_room < num_blocks:
            priority, _, _, block_id, version = heap[0]
            hold = self._holds.get(block_id)
            if hold is None or hold.version != version or hold.pins or not hold.retains:
                heapq.heappop(heap)
                continue
            if priority >= below_priority:
                break
            entry = heapq.heappop(heap)
            if block_id in keep or (only_freeing and self.cache.in_use(hold.handle)):
                passed_over.append(entry)
                continue
            first = len(released)
            self._drop_hold(hold, released, lost_to=reason)
            made_room += sum(1 for h in released[first:] if h.block_id not in keep and not (
                only_freeing and self.cache.in_use(h)))
        for entry in passed_over:
            heapq.heappush(heap, entry)
        if only_freeing:
            self.counters.kept_in_use_under_pressure += len(passed_over)
        self._release(released)
        return len(released)

    def _drop_hold(self, hold: Hold, released: list[BlockHandle], lost_to: str | None) -> None:
        """Forget a retain-only hold; its block goes to ``released``. ``lost_to``: the
        reason its claims lost it unasked (None: their sender asked). A hybrid model's
        side block lost so cuts its claims' positions from there on too
        (:mod:`.hold_cuts`), their blocks to ``released`` as well."""
        block_id = hold.handle.block_id
        cut: list[ClaimKey] = []
        for action_id in hold.retains:
            claim = self._claims.get(action_id)
            if claim is not None and block_id in claim.block_ids:
                claim.block_ids.discard(block_id)
                cut.append(action_id)
                if lost_to is not None:
                    self._note_loss(action_id, claim, lost_to, 0 if hold.handle.side else 1)
        hold.clear_retains()
        self._retained -= 1
        self._forget_hold(block_id)
        released.append(hold.handle)
        if lost_to is not None:
            self._cut_after_loss(cut, released, hold.handle, lost_to)
