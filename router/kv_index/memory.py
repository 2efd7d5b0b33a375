"""The in-memory cluster KV index: one dict from block hash to a residency bitmask.

Layout: every worker gets a *slot*; bit ``slot * 4 + tier`` of a hash's mask is set when
that worker holds the hash in that tier (tiers GPU=0, CPU=1, STORAGE=2, OTHER=3). A
prefix lookup walks the chain once, ANDing masks: one dict lookup per block plus a little
work per worker that drops out, independent of the index size (but not of its memory
latency: at 1M blocks a lookup is a cache miss or two).
Each slot also keeps the set of its hashes, so purging a worker costs its own blocks only.

Reference-counted tiers (all but GPU, see :mod:`.protocol`) keep the references past the
first in ``_refs``, by bit position, only for the hashes that have some: the common case (a
hash announced once) costs nothing more.

Invariants: a hash is a key iff its mask is non-zero; ``hash in _slot_hashes[s]`` iff
some tier bit of slot ``s`` is set in its mask; ``_tier_counts[s][t]`` is the number of
masks with bit ``s*4+t`` set; ``_refs[s*4+t]`` is non-empty and names only hashes whose
bit ``s*4+t`` is set (``t`` never GPU).
"""

from __future__ import annotations

import heapq
from collections import Counter, deque
from collections.abc import Iterable, Mapping, Sequence
from itertools import repeat

from kvhint.router.kv_index.events import (
    TIER_GPU,
    TIERS,
    AllBlocksCleared,
    BlocksRemoved,
    BlocksStored,
    IndexEvent,
    SnapshotLoaded,
    WorkerPurged,
    index_tier,
)
from kvhint.router.kv_index.protocol import (
    IndexState,
    IndexStats,
    PrefixMatch,
    SessionPlacement,
    WorkerOverlap,
)
from kvhint.router.kv_index.sessions import SessionTable

_BITS = 4
_TIER_BIT = {tier: i for i, tier in enumerate(TIERS)}
_GPU_BIT = _TIER_BIT[TIER_GPU]


def _tier_bit(tier: str) -> int:
    """A tier's bit, its name taken in any case; one outside TIERS is kept under OTHER, as
    the adapter keeps unknown mediums."""
    bit = _TIER_BIT.get(tier)
    return bit if bit is not None else _TIER_BIT[index_tier(tier)]


_SLOT_ALL = (1 << _BITS) - 1


class InMemoryClusterKvIndex:
    """Fast :class:`~kvhint.router.kv_index.protocol.ClusterKvIndex` (see module doc)."""

    def __init__(self, max_sessions: int = 100_000, max_frontiers: int = 4) -> None:
        self._masks: dict[int, int] = {}
        self._slot_of: dict[str, int] = {}
        self._worker_of: list[str] = []
        self._slot_hashes: list[set[int]] = []
        self._tier_counts: list[list[int]] = []
        self._gpu_pattern = 0  # bit slot*4 for every slot in use
        # Slots of purged workers, lowest first: a fleet whose worker ids come and go
        # (autoscaling, restarts under new ids) keeps its masks as wide as it is large.
        self._free_slots: list[int] = []
        self._sessions = SessionTable(max_sessions, max_frontiers)
        # bit position (slot * 4 + tier) -> hash -> references beyond the first.
        self._refs: dict[int, dict[int, int]] = {}
        self._repeat_stores = 0
        self._repeat_removes = 0
        self._stored = 0
        self._removed = 0
        self._duplicates = 0
        self._missing = 0
        self._cleared = 0
        self._purged = 0
        self._snapshots = 0
        self._handlers = {
            BlocksStored: self._on_stored,
            BlocksRemoved: self._on_removed,
            AllBlocksCleared: self._on_cleared,
            WorkerPurged: self._on_purged,
            SnapshotLoaded: self._on_snapshot,
        }

    # --- writes ---------------------------------------------------------------------

    def apply(self, event: IndexEvent) -> None:
        self._handlers[type(event)](event)  # type: ignore[operator]

    def apply_all(self, events: Iterable[IndexEvent]) -> None:
        handlers = self._handlers
        for event in events:
            handlers[type(event)](event)  # type: ignore[operator]

    def _slot(self, worker_id: str) -> int:
        slot = self._slot_of.get(worker_id)
        if slot is None:
            if self._free_slots:
                slot = heapq.heappop(self._free_slots)
                self._worker_of[slot] = worker_id
            else:
                slot = len(self._worker_of)
                self._worker_of.append(worker_id)
                self._slot_hashes.append(set())
                self._tier_counts.append([0] * len(TIERS))
            self._slot_of[worker_id] = slot
            self._gpu_pattern |= 1 << (slot * _BITS)
        return slot

    def _on_stored(self, event: BlocksStored) -> None:
        hashes = event.block_hashes
        if not hashes:
            return
        slot = self._slot_of.get(event.worker_id)
        if slot is None:
            slot = self._slot(event.worker_id)
        self._store(slot, _tier_bit(event.tier), hashes)
        if event.session_id is not None:
            self._sessions.stored(event.session_id, event.worker_id, event.parent_hash,
                                  hashes[-1])

    def _store(self, slot: int, tier: int, hashes: Sequence[int]) -> None:
        bit = 1 << (slot * _BITS + tier)
        masks = self._masks
        own = self._slot_hashes[slot]
        if not any(map(masks.__contains__, hashes)):
            # The common case, all in C: hashes nobody holds yet (a fresh run). A chain
            # never repeats a hash, but a run may (two byte hashes with the same low 64
            # bits): count what ``own`` gained, not the run's length.
            masks.update(zip(hashes, repeat(bit)))
            before = len(own)
            own.update(hashes)
            added = len(own) - before
            self._tier_counts[slot][tier] += added
            self._stored += added
            if added != len(hashes):
                self._repeats_in_run(slot, tier, hashes)
            return
        slot_all = _SLOT_ALL << (slot * _BITS)
        counted = tier != _GPU_BIT
        added = dup = 0
        for h in hashes:
            m = masks.get(h)
            if m is None:
                masks[h] = bit
                own.add(h)
                added += 1
                continue
            if m & bit:
                if counted:
                    refs = self._refs.setdefault(slot * _BITS + tier, {})
                    refs[h] = refs.get(h, 0) + 1
                    self._repeat_stores += 1
                else:
                    dup += 1
                continue
            masks[h] = m | bit
            added += 1
            if not m & slot_all:
                own.add(h)
        self._tier_counts[slot][tier] += added
        self._stored += added
        self._duplicates += dup

    def _repeats_in_run(self, slot: int, tier: int, hashes: Sequence[int]) -> None:
        """A fresh run that names a hash more than once: GPU keeps one (the rest counted
        as duplicates), a reference-counted tier one reference per mention."""
        extra = [(h, n - 1) for h, n in Counter(hashes).items() if n > 1]
        total = sum(n for _, n in extra)
        if tier == _GPU_BIT:
            self._duplicates += total
            return
        refs = self._refs.setdefault(slot * _BITS + tier, {})
        for h, n in extra:
            refs[h] = refs.get(h, 0) + n
        self._repeat_stores += total

    def _on_removed(self, event: BlocksRemoved) -> None:
        hashes = event.block_hashes
        slot = self._slot_of.get(event.worker_id)
        if slot is None:
            self._missing += len(hashes)
            return
        tier = _tier_bit(event.tier)
        bit = 1 << (slot * _BITS + tier)
        masks = self._masks
        own = self._slot_hashes[slot]
        refs = self._refs.get(slot * _BITS + tier)
        only_here = all(map(bit.__eq__, map(masks.get, hashes, repeat(0))))
        if only_here and len(set(hashes)) == len(hashes) and not (
                refs and any(map(refs.__contains__, hashes))):
            # The common case, all in C: each hash held by this worker in this tier only.
            deque(map(masks.__delitem__, hashes), maxlen=0)
            own.difference_update(hashes)
            self._tier_counts[slot][tier] -= len(hashes)
            self._removed += len(hashes)
            return
        slot_all = _SLOT_ALL << (slot * _BITS)
        removed = missing = 0
        for h in hashes:
            m = masks.get(h, 0)
            if not m & bit:
                missing += 1
                continue
            if refs and h in refs:  # another reference holds it
                if refs[h] > 1:
                    refs[h] -= 1
                else:
                    del refs[h]
                    if not refs:
                        del self._refs[slot * _BITS + tier]
                self._repeat_removes += 1
                continue
            m ^= bit
            if m:
                masks[h] = m
            else:
                del masks[h]
            removed += 1
            if not m & slot_all:
                own.discard(h)
        self._tier_counts[slot][tier] -= removed
        self._removed += removed
        self._missing += missing

    def _drop_worker(self, worker_id: str) -> None:
        self._sessions.drop_worker(worker_id)
        slot = self._slot_of.get(worker_id)
        if slot is None:
            return
        for tier in range(_BITS):
            self._refs.pop(slot * _BITS + tier, None)
        keep = ~(_SLOT_ALL << (slot * _BITS))
        masks = self._masks
        for h in self._slot_hashes[slot]:
            m = masks[h] & keep
            if m:
                masks[h] = m
            else:
                del masks[h]
        self._slot_hashes[slot] = set()
        self._tier_counts[slot] = [0] * len(TIERS)

    def _on_cleared(self, event: AllBlocksCleared) -> None:
        self._cleared += 1
        slot = self._slot_of.get(event.worker_id)
        if slot is not None:
            tier = _tier_bit(event.tier)
            self._refs.pop(slot * _BITS + tier, None)
            bit = 1 << (slot * _BITS + tier)
            slot_all = _SLOT_ALL << (slot * _BITS)
            masks = self._masks
            own = self._slot_hashes[slot]
            for h in [h for h in own if masks[h] & bit]:
                m = masks[h] ^ bit
                if m:
                    masks[h] = m
                else:
                    del masks[h]
                if not m & slot_all:
                    own.discard(h)
            self._tier_counts[slot][tier] = 0
            if own:  # blocks left in another tier: the sessions' placements may use them
                return
        self._sessions.drop_worker(event.worker_id)

    def _on_purged(self, event: WorkerPurged) -> None:
        self._purged += 1
        self._drop_worker(event.worker_id)
        slot = self._slot_of.pop(event.worker_id, None)
        if slot is not None:  # nothing of it is left in any mask: the slot is free
            self._gpu_pattern &= ~(1 << (slot * _BITS))
            heapq.heappush(self._free_slots, slot)

    def _on_snapshot(self, event: SnapshotLoaded) -> None:
        self._snapshots += 1
        self._drop_worker(event.worker_id)
        slot = self._slot(event.worker_id)
        by_tier: dict[int, list[int]] = {}
        for block in event.blocks:
            by_tier.setdefault(_tier_bit(block.tier), []).append(block.block_hash)
        for tier, hashes in by_tier.items():
            # Listed twice: in GPU counted like a duplicate store, elsewhere a reference.
            self._store(slot, tier, hashes)
        self._sessions.load(event.worker_id, event.sessions)

    # --- reads ----------------------------------------------------------------------

    def match_prefix(self, block_hashes: Sequence[int]) -> PrefixMatch:
        # One pass, one dict lookup per block. (A C-level map/accumulate variant was no
        # faster: the cost is the dict's memory latency, ~0.5 us per lookup at 1M blocks.)
        get = self._masks.get
        gpu_alive = self._gpu_pattern  # slots still matching on GPU (bit slot*4)
        ext_alive = 0  # slots past their GPU prefix, still matching in another tier
        gpu_end: dict[int, int] = {}
        ext_end: dict[int, int] = {}
        i = 0
        for h in block_hashes:
            m = get(h, 0)
            if m & gpu_alive != gpu_alive:
                dropped = gpu_alive & ~m
                gpu_alive ^= dropped
                ext_alive |= dropped
                while dropped:
                    low = dropped & -dropped
                    gpu_end[low] = i
                    dropped ^= low
            if ext_alive:
                # Any non-GPU tier bit of a slot, moved onto the slot's GPU bit.
                e = ((m >> 1) | (m >> 2) | (m >> 3)) & ext_alive
                if e != ext_alive:
                    dead = ext_alive ^ e
                    ext_alive = e
                    while dead:
                        low = dead & -dead
                        ext_end[low] = i
                        dead ^= low
                if not gpu_alive and not ext_alive:
                    break
            elif not gpu_alive:
                break
            i += 1
        n = len(block_hashes)
        while gpu_alive:  # resident on GPU to the end of the chain
            low = gpu_alive & -gpu_alive
            gpu_end[low] = ext_end[low] = n
            gpu_alive ^= low
        while ext_alive:
            low = ext_alive & -ext_alive
            ext_end[low] = n
            ext_alive ^= low
        workers = self._worker_of
        out: dict[str, WorkerOverlap] = {}
        for low, end in ext_end.items():
            if end:
                gpu = gpu_end[low]
                out[workers[(low.bit_length() - 1) >> 2]] = WorkerOverlap(gpu, end - gpu)
        return PrefixMatch(n, out)

    def tier_prefix(self, block_hashes: Sequence[int], tier: str) -> Mapping[str, int]:
        get = self._masks.get
        shift = _tier_bit(tier)
        alive = self._gpu_pattern << shift
        ends: dict[int, int] = {}
        i = 0
        for h in block_hashes:
            if not alive:
                break
            m = get(h, 0)
            if m & alive != alive:
                dropped = alive & ~m
                alive ^= dropped
                while dropped:
                    low = dropped & -dropped
                    ends[low] = i
                    dropped ^= low
            i += 1
        while alive:
            low = alive & -alive
            ends[low] = len(block_hashes)
            alive ^= low
        workers = self._worker_of
        return {workers[(low.bit_length() - 1 - shift) >> 2]: end
                for low, end in ends.items() if end}

    def locate(self, block_hash: int) -> Mapping[str, frozenset[str]]:
        m = self._masks.get(block_hash, 0)
        out: dict[str, frozenset[str]] = {}
        slot = 0
        while m:
            bits = m & _SLOT_ALL
            if bits:
                out[self._worker_of[slot]] = frozenset(
                    t for t, i in _TIER_BIT.items() if bits >> i & 1)
            m >>= _BITS
            slot += 1
        return out

    def has_block(self, worker_id: str, block_hash: int, tier: str | None = None) -> bool:
        slot = self._slot_of.get(worker_id)
        if slot is None:
            return False
        bits = self._masks.get(block_hash, 0) >> (slot * _BITS) & _SLOT_ALL
        return bool(bits if tier is None else bits >> _tier_bit(tier) & 1)

    def session_placements(self, session_id: str) -> tuple[SessionPlacement, ...]:
        return self._sessions.placements(session_id)

    def worker_ids(self) -> tuple[str, ...]:
        with_blocks = {w for w, s in self._slot_of.items() if self._slot_hashes[s]}
        return tuple(sorted(with_blocks | self._sessions.workers()))

    def worker_block_counts(self, worker_id: str) -> Mapping[str, int]:
        slot = self._slot_of.get(worker_id)
        if slot is None:
            return {}
        return {t: c for t, c in zip(TIERS, self._tier_counts[slot]) if c}

    def stats(self) -> IndexStats:
        by_tier = {t: sum(c[i] for c in self._tier_counts) for t, i in _TIER_BIT.items()}
        return IndexStats(
            distinct_blocks=len(self._masks), entries=sum(by_tier.values()),
            entries_by_tier={t: c for t, c in by_tier.items() if c},
            workers=len(self.worker_ids()), sessions=len(self._sessions),
            stored_blocks=self._stored, removed_blocks=self._removed,
            duplicate_stores=self._duplicates, missing_removes=self._missing,
            cleared_workers=self._cleared, purged_workers=self._purged,
            snapshots_loaded=self._snapshots, sessions_evicted=self._sessions.evicted,
            frontiers_dropped=self._sessions.frontiers_dropped,
            repeat_stores=self._repeat_stores, repeat_removes=self._repeat_removes)

    def export_state(self) -> IndexState:
        blocks: dict[str, dict[str, set[int]]] = {}
        for h, m in self._masks.items():
            slot = 0
            while m:
                bits = m & _SLOT_ALL
                if bits:
                    per_tier = blocks.setdefault(self._worker_of[slot], {})
                    for t, i in _TIER_BIT.items():
                        if bits >> i & 1:
                            per_tier.setdefault(t, set()).add(h)
                m >>= _BITS
                slot += 1
        refs: dict[str, dict[str, dict[int, int]]] = {}
        for position, held in self._refs.items():
            worker = self._worker_of[position // _BITS]
            refs.setdefault(worker, {})[TIERS[position % _BITS]] = dict(held)
        return IndexState(
            blocks={w: {t: frozenset(s) for t, s in tiers.items()}
                    for w, tiers in blocks.items()},
            sessions=self._sessions.export(), refs=refs)
