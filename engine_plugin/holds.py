"""HoldLedger: which blocks the plugin holds in the engine's pool, for which actions.

A block is *held* (one extra reference in vLLM's BlockPool, so it is out of the free queue
and cannot be evicted) while at least one *claim* covers it. A claim is one action's hold
on its blocks, ending at its expiry:
- pin claims are hard until their expiry, within ``max_pinned_blocks``;
- retain claims are soft: :meth:`HoldLedger.relieve` drops them whenever the engine needs
  the memory, lowest priority first (an agent runtime's claims after every planner
  claim: :func:`~.hold_records.retain_rank`), then least recently claimed, then leaf first,
  passing over blocks a running request also uses (dropping those frees nothing). A
  block under several retains has the highest of their priorities. Re-prioritising is a
  heap push (stale entries are skipped lazily), never a re-sort.
- claims made for a session (``scope``) by one owner (the router's planner, an agent
  runtime) can be dropped together (:meth:`supersede`); another owner's claims on that
  session stay. A claim under an action id already claimed replaces that claim.

Blocks a claim loses without its sender asking (displaced by a higher-priority retain, by
the retain budget when a pin under a retain ends, or by a Demote or a block-hash release
naming the blocks, relieved under memory pressure, given back for a prefix-cache reset,
dropped from vLLM's cache by another path: :meth:`HoldLedger.release_gone`) are
remembered as :class:`ClaimLoss` until :meth:`HoldLedger.take_losses`, so the sender can
be told; TTL expiry and supersession are not (the sender knows of them).

Counts: ``pinned`` = holds with a pin claim; ``retained`` = holds with retain claims and
no pin claim. Single-threaded (the scheduler thread). Relief, displacement and the
pressure heap are :mod:`.hold_relief`'s; the records are :mod:`.hold_records`'.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable, Sequence
from dataclasses import replace

from kvhint.engine_plugin.block_cache import BlockCache, BlockHandle
from kvhint.engine_plugin.group_holds import Clip, positions
from kvhint.engine_plugin.hold_cuts import HoldCutsMixin
from kvhint.engine_plugin.hold_relief import COMPACT_SLACK, HoldReliefMixin
from kvhint.engine_plugin.hold_records import (
    DISPLACED,
    GONE,
    PIN,
    PRESSURE,
    RESET,
    RETAIN,
    Claim,
    ClaimKey,
    ClaimLoss,
    HoldCounters,
    Hold,
    retain_rank,
    retain_room_holders,
)

__all__ = ["DISPLACED", "GONE", "PIN", "PRESSURE", "RESET", "RETAIN", "BlockCache",
           "BlockHandle", "ClaimLoss", "HoldCounters", "HoldLedger"]


class HoldLedger(HoldReliefMixin, HoldCutsMixin):
    def __init__(self, cache: BlockCache, max_pinned: int, max_retained: int) -> None:
        self.cache = cache
        self.max_pinned = max_pinned
        self.max_retained = max_retained
        self.counters = HoldCounters()
        self._holds: dict[int, Hold] = {}
        # Held block ids by block hash, to find the holds a BlockRemoved event names.
        self._by_key: dict[int, set[int]] = {}
        self._claims: dict[str, Claim] = {}
        self._by_scope: dict[tuple[str, str], set[str]] = {}  # (scope, owner) -> action ids
        self._pinned = 0
        self._retained = 0
        self._expiry_heap: list[tuple[float, int, str]] = []
        # (priority, touched, -depth, block_id, version): what relieve() drops first.
        self._pressure_heap: list[tuple[int, int, int, int, int]] = []
        self._seq = itertools.count(1)
        # Losses not yet taken, by (action id, reason); their ``held`` is filled in when
        # they are taken.
        self._losses: dict[tuple[str, str], ClaimLoss] = {}

    @property
    def pinned(self) -> int:
        return self._pinned

    @property
    def retained(self) -> int:
        return self._retained

    def is_pinned(self, block_id: int) -> bool:
        hold = self._holds.get(block_id)
        return hold is not None and bool(hold.pins)

    def is_held(self, block_id: int) -> bool:
        return block_id in self._holds

    def held_by(self, block_id: int, owner: str) -> bool:
        """Whether a claim of ``owner`` holds the block."""
        hold = self._holds.get(block_id)
        if hold is None:
            return False
        claims = self._claims
        return any(claims[a].owner == owner for a in (*hold.pins, *hold.retains)
                   if a in claims)

    def held_beyond(self, block_id: int, scope: str, owners: Sequence[str]) -> bool:
        """Whether a claim other than ``owners``' claims for ``scope`` holds the block
        (another session's, a shared prefix's, another owner's)."""
        hold = self._holds.get(block_id)
        if hold is None:
            return False
        claims = self._claims
        for action_id in (*hold.pins, *hold.retains):
            claim = claims.get(action_id)
            if claim is None or claim.scope != scope or claim.owner not in owners:
                return True
        return False

    def handles(self) -> list[BlockHandle]:
        return [h.handle for h in self._holds.values()]

    def keys(self) -> dict[str, list[int]]:
        pinned = [h.handle.key for h in self._holds.values() if h.pins]
        retained = [h.handle.key for h in self._holds.values() if not h.pins and h.retains]
        return {"pinned": pinned, "retained": retained}

    @property
    def heap_entries(self) -> int:
        """Entries in the pressure and expiry heaps, stale ones included: bounded by twice
        the live holds and claims plus a constant, however often hints re-prioritise."""
        return len(self._pressure_heap) + len(self._expiry_heap)

    def next_expiry(self) -> float | None:
        return self._expiry_heap[0][0] if self._expiry_heap else None

    # --- claims ---------------------------------------------------------------------------

    def pin(self, action_id: str, handles: list[BlockHandle], expiry: float,
            scope: str | None, owner: str, clip: Clip | None = None
            ) -> tuple[int, str | None]:
        """Pin ``handles`` (root-most first); returns (target blocks pinned: ``side``
        ones not counted, budget note). ``clip``: what a short budget takes
        (:func:`~kvhint.engine_plugin.group_holds.claim_blocks`; None: root-most first)."""
        self._replace_claim(action_id)
        note = None
        fresh = [h for h in handles if not self.is_pinned(h.block_id)]
        room = max(self.max_pinned - self._pinned, 0)
        if len(fresh) > room:
            note = (f"pin budget: {room} of {len(fresh)} new blocks fit "
                    f"(max_pinned_blocks={self.max_pinned})")
            if clip is not None:  # a hybrid model's positions, with their hit's blocks
                handles = clip(lambda b: not self.is_pinned(b), room)
            else:
                keep = {h.block_id for h in fresh[:room]}  # root-most first: what a hit needs
                handles = [h for h in handles
                           if self.is_pinned(h.block_id) or h.block_id in keep]
        if not handles:
            return 0, note
        new_holds = []
        for handle in handles:
            hold = self._holds.get(handle.block_id)
            if hold is None:
                hold = self._new_hold(handle)
                new_holds.append(handle)
            elif not hold.pins and hold.retains:
                self._retained -= 1
            if not hold.pins:
                self._pinned += 1
            hold.pins[action_id] = expiry
        self.cache.hold(new_holds)
        self._add_claim(action_id, PIN, handles, expiry, scope, owner, clip is not None)
        return positions(handles), note

    def retain(self, action_id: str, priority: int, handles: list[BlockHandle], expiry: float,
               scope: str | None, owner: str, clip: Clip | None = None
               ) -> tuple[int, str | None]:
        """Retain ``handles`` (root-most first); a full budget first displaces retained
        blocks of lower rank (:func:`retain_rank`: an agent's claims above the planner's).
        Returns (blocks retained, budget note)."""
        self._replace_claim(action_id)
        note = None
        rank = retain_rank(priority, owner)
        fresh = [h for h in handles if h.block_id not in self._holds]
        room = self.max_retained - self._retained
        if len(fresh) > room:
            # Never the target's own blocks: held by a lower-ranked claim (the planner's
            # on the same session), they need no room; displaced, they would need it
            # again and the Retain would be clipped all the same.
            self.counters.displaced += self._drop_retained(
                len(fresh) - room, rank, DISPLACED,
                keep=frozenset(h.block_id for h in handles))
            room = self.max_retained - self._retained
            fresh = [h for h in handles if h.block_id not in self._holds]
        if len(fresh) > room:
            room = max(room, 0)
            note = (f"retain budget: {room} of {len(fresh)} new blocks fit "
                    f"(max_retained_blocks={self.max_retained}); "
                    f"{retain_room_holders(priority, owner)}")
            if clip is not None:  # a hybrid model's positions, with their hit's blocks
                handles = clip(lambda b: b not in self._holds, room)
            else:
                keep = {h.block_id for h in fresh[:room]}
                handles = [h for h in handles
                           if h.block_id in self._holds or h.block_id in keep]
        if not handles:
            return 0, note
        touched = next(self._seq)
        new_holds = []
        for handle in handles:
            hold = self._holds.get(handle.block_id)
            if hold is None:
                hold = self._new_hold(handle)
                new_holds.append(handle)
                self._retained += 1
            hold.add_retain(action_id, rank)
            hold.touched = touched
            if not hold.pins:
                self._push_pressure(hold)
        self.cache.hold(new_holds)
        self._add_claim(action_id, RETAIN, handles, expiry, scope, owner, clip is not None)
        return positions(handles), note

    def supersede(self, scope: str, owner: str) -> None:
        """Drop every claim ``owner`` made for ``scope`` (a session)."""
        action_ids = self._by_scope.pop((scope, owner), None)
        if not action_ids:
            return
        released: list[BlockHandle] = []
        for action_id in action_ids:
            self.counters.superseded_claims += 1
            self._end_claim(action_id, released, keep_scope=True)
        self._release(released)
        self._fit_retained()

    def unretain(self, handles: Sequence[BlockHandle]) -> None:
        """Drop the retain claims on these blocks (pinned ones keep their pins): a Demote
        naming them. The claims' senders did not ask, so each loss is noted as
        ``displaced`` and the blocks given back count in ``displaced`` too (the metric
        agrees with the releases the router hears). A hybrid model's claim that lost
        positions also lets go of its ``side`` blocks at positions it no longer holds
        (:mod:`.hold_cuts`)."""
        released: list[BlockHandle] = []
        cut: set[ClaimKey] = set()
        for handle in handles:
            hold = self._holds.get(handle.block_id)
            if hold is not None and not hold.pins:
                cut.update(hold.retains)
                self._drop_hold(hold, released, lost_to=DISPLACED)
        for action_id in cut:
            self._drop_stranded_sides(action_id, released)
        self.counters.displaced += len(released)
        self._release(released)

    def release_retains(self, handles: Sequence[BlockHandle], owner: str) -> tuple[int, int]:
        """Drop ``owner``'s block-hash (session-less) retain claims on these blocks, at its
        own request (a ``Retain{priority: 0}`` by block hashes); a claim left holding
        nothing ends. Session claims and pins stay. A Prefetch's retain is session-less
        too, so it goes with them. Each claim cut is noted as ``displaced`` (as a Demote
        naming blocks notes the claims it cuts): the release is another action than the
        claims', and the router counts each claim by its own id, so it must hear what
        each still holds (before, nothing was noted, and the router's ledger counted a
        Prefetch's released blocks as held until its deadline). Returns (blocks
        un-retained, blocks given back to the pool)."""
        released: list[BlockHandle] = []
        claims = self._claims
        dropped = 0
        for handle in handles:
            hold = self._holds.get(handle.block_id)
            if hold is None:
                continue
            mine = [a for a in hold.retains if (c := claims.get(a)) is not None
                    and c.scope is None and c.owner == owner]
            if not mine:
                continue
            dropped += 1
            for action_id in mine:
                hold.drop_retain(action_id)
                claim = claims[action_id]
                claim.block_ids.discard(handle.block_id)
                self._note_loss(action_id, claim, DISPLACED, 0 if hold.handle.side else 1)
                if not claim.block_ids:
                    del claims[action_id]  # its expiry heap entry is skipped as stale
                    self.counters.superseded_claims += 1
            if hold.pins:
                continue
            if hold.retains:
                self._push_pressure(hold)  # its priority may have dropped
            else:
                self._retained -= 1
                self._forget_hold(handle.block_id)
                released.append(hold.handle)
        # Every block given back here is reported as ``displaced`` to the claims it cut
        # (above), so the metric counts it as such.
        self.counters.displaced += len(released)
        self._release(released)
        return dropped, len(released)

    def expire(self, now: float) -> int:
        """End the claims whose expiry has come; returns how many."""
        released: list[BlockHandle] = []
        heap = self._expiry_heap
        ended = 0
        while heap and heap[0][0] <= now:
            expiry, _, action_id = heapq.heappop(heap)
            claim = self._claims.get(action_id)
            if claim is None or claim.expiry != expiry:
                continue
            ended += 1
            self._end_claim(action_id, released)
        self.counters.expired_claims += ended
        self._release(released)
        self._fit_retained()
        return ended

    def release_all(self) -> int:
        handles = self.handles()
        for action_id, claim in self._claims.items():
            if claim.block_ids:
                self._note_loss(action_id, claim, RESET, self._positions(claim.block_ids))
        self._holds.clear()
        self._by_key.clear()
        self._claims.clear()
        self._by_scope.clear()
        self._expiry_heap.clear()
        self._pressure_heap.clear()
        self._pinned = self._retained = 0
        self.counters.released_on_reset += len(handles)
        self._release(handles)
        return len(handles)

    def release_gone(self, keys: Iterable[int] | None = None) -> int:
        """Give back the holds on blocks that left vLLM's prefix cache by a path other
        than ours (BlockRemoved for a block we hold: ``evict_blocks`` after a failed KV
        load; None: check every hold, after an AllBlocksCleared). Their claims lose them
        (reported: the sender's budget no longer holds them) as ``GONE``, or as ``RESET``
        after an AllBlocksCleared: that is vLLM resetting its prefix cache, only one our
        wrapper did not release for first. A hybrid model's side block so lost cuts its
        claims' positions from there on (:mod:`.hold_cuts`), reported for the same
        reason. Returns how many blocks were given back, all counted in
        ``released_gone``. A removed hash whose held copy is still cached (vLLM keeps
        duplicate copies) keeps its hold."""
        if keys is None:
            candidates, reason = list(self._holds), RESET
        else:
            by_key = self._by_key
            candidates = [b for k in keys if k in by_key for b in by_key[k]]
            reason = GONE
        released: list[BlockHandle] = []
        for block_id in candidates:
            hold = self._holds.get(block_id)
            if hold is None or self.cache.is_cached(hold.handle):
                continue
            cut = []
            for action_id in (*hold.pins, *hold.retains):
                claim = self._claims.get(action_id)
                if claim is not None and block_id in claim.block_ids:
                    claim.block_ids.discard(block_id)
                    cut.append(action_id)
                    self._note_loss(action_id, claim, reason, 0 if hold.handle.side else 1)
            if hold.pins:
                self._pinned -= 1
            else:
                self._retained -= 1
            self._forget_hold(block_id)  # its pressure-heap entries are skipped as stale
            released.append(hold.handle)
            self._cut_after_loss(cut, released, hold.handle, reason)
        self.counters.released_gone += len(released)
        self._release(released)
        self._fit_retained()  # a cut pin may leave a retain under it past the budget
        return len(released)

    # --- internals ------------------------------------------------------------------------

    def _new_hold(self, handle: BlockHandle) -> Hold:
        hold = self._holds[handle.block_id] = Hold(handle)
        self._by_key.setdefault(handle.key, set()).add(handle.block_id)
        return hold

    def _forget_hold(self, block_id: int) -> None:
        hold = self._holds.pop(block_id)
        ids = self._by_key.get(hold.handle.key)
        if ids is not None:
            ids.discard(block_id)
            if not ids:
                del self._by_key[hold.handle.key]

    def _replace_claim(self, action_id: str) -> None:
        """A claim under an id already claimed replaces it. Ids are meant to be unique and
        the executor answers a repeat from memory, but one it no longer remembers (or a
        donor advice sharing a hint's id) must not orphan the old claim's holds, which
        no expiry would then end."""
        if action_id in self._claims:
            released: list[BlockHandle] = []
            self._end_claim(action_id, released)
            self._release(released)
            self._fit_retained()

    def _add_claim(self, action_id: str, kind: str, handles: list[BlockHandle],
                   expiry: float, scope: str | None, owner: str, sided: bool = False) -> None:
        self._claims[action_id] = Claim(kind, {h.block_id for h in handles}, expiry, scope,
                                         owner, sided=sided)
        if scope is not None:
            self._by_scope.setdefault((scope, owner), set()).add(action_id)
        heapq.heappush(self._expiry_heap, (expiry, next(self._seq), action_id))
        if len(self._expiry_heap) > 2 * len(self._claims) + COMPACT_SLACK:
            # A superseded claim's entry stays until its expiry: rebuild from live claims.
            self._expiry_heap = [(c.expiry, next(self._seq), a) for a, c in self._claims.items()]
            heapq.heapify(self._expiry_heap)

    def take_losses(self) -> list[ClaimLoss]:
        """The losses since the last call, one per (claim, reason), with what each claim
        holds now."""
        if not self._losses:
            return []
        losses = []
        for loss in self._losses.values():
            claim = self._claims.get(loss.action_id)
            losses.append(replace(loss, held=self._positions(claim.block_ids)
                                  if claim is not None else 0))
        self._losses.clear()
        return losses

    def _positions(self, block_ids: Iterable[int]) -> int:
        """Target positions among held blocks (a hybrid model's side blocks not counted):
        the unit the router counts a claim in."""
        holds = self._holds
        return sum(1 for b in block_ids if (h := holds.get(b)) is None or not h.handle.side)

    def _note_loss(self, action_id: str, claim: Claim, reason: str, blocks: int) -> None:
        if not blocks:
            return  # a side block: its claim's positions it cuts are noted (.hold_cuts)
        key = (action_id, reason)
        earlier = self._losses.get(key)
        self._losses[key] = (
            ClaimLoss(action_id, claim.kind, claim.scope, reason, blocks, 0) if earlier is None
            else replace(earlier, released=earlier.released + blocks))

    def _end_claim(self, action_id: str, released: list[BlockHandle],
                   keep_scope: bool = False) -> None:
        claim = self._claims.pop(action_id, None)
        if claim is None:
            return
        if claim.scope is not None and not keep_scope:
            scope_key = (claim.scope, claim.owner)
            scoped = self._by_scope.get(scope_key)
            if scoped is not None:
                scoped.discard(action_id)
                if not scoped:
                    del self._by_scope[scope_key]
        for block_id in claim.block_ids:
            hold = self._holds.get(block_id)
            if hold is not None:
                self._let_go(action_id, claim.kind, hold, released)

    def _release(self, handles: list[BlockHandle]) -> None:
        if handles:
            handles.sort(key=lambda h: -h.depth)  # leaf first: evicted first
            self.cache.release(handles)
