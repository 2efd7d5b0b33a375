"""The obvious cluster KV index: a set of hashes per (worker, tier).

It is the reference the shared test suite checks :class:`InMemoryClusterKvIndex` against
and the baseline of the index benchmarks: lookups ask every worker's sets block by block,
so a routing decision costs O(workers x matched blocks); storing and removing are plain set
operations. Same semantics as every index (see :mod:`.protocol`), no cleverness.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

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


class NaiveClusterKvIndex:
    def __init__(self, max_sessions: int = 100_000, max_frontiers: int = 4) -> None:
        self._blocks: dict[str, dict[str, set[int]]] = {}
        self._sessions = SessionTable(max_sessions, max_frontiers)
        self._counters = dict.fromkeys(
            ("stored", "removed", "duplicates", "missing", "cleared", "purged", "snapshots"), 0)

    def apply(self, event: IndexEvent) -> None:
        c = self._counters
        if isinstance(event, BlocksStored):
            tier_set = self._tier_set(event.worker_id, event.tier)
            for h in event.block_hashes:
                if h in tier_set:
                    c["duplicates"] += 1
                else:
                    tier_set.add(h)
                    c["stored"] += 1
            if event.session_id is not None and event.block_hashes:
                self._sessions.stored(event.session_id, event.worker_id, event.parent_hash,
                                      event.block_hashes[-1])
        elif isinstance(event, BlocksRemoved):
            tier_set = self._blocks.get(event.worker_id, {}).get(index_tier(event.tier), set())
            for h in event.block_hashes:
                if h in tier_set:
                    tier_set.discard(h)
                    c["removed"] += 1
                else:
                    c["missing"] += 1
        elif isinstance(event, AllBlocksCleared | WorkerPurged):
            c["cleared" if isinstance(event, AllBlocksCleared) else "purged"] += 1
            self._blocks.pop(event.worker_id, None)
            self._sessions.drop_worker(event.worker_id)
        elif isinstance(event, SnapshotLoaded):
            c["snapshots"] += 1
            self._blocks.pop(event.worker_id, None)
            self._sessions.drop_worker(event.worker_id)
            for block in event.blocks:
                tier_set = self._tier_set(event.worker_id, block.tier)
                if block.block_hash in tier_set:
                    c["duplicates"] += 1
                else:
                    tier_set.add(block.block_hash)
                    c["stored"] += 1
            self._sessions.load(event.worker_id, event.sessions)
        else:
            raise TypeError(f"not an index event: {event!r}")

    def apply_all(self, events: Iterable[IndexEvent]) -> None:
        for event in events:
            self.apply(event)

    def _tier_set(self, worker_id: str, tier: str) -> set[int]:
        return self._blocks.setdefault(worker_id, {}).setdefault(index_tier(tier), set())

    def match_prefix(self, block_hashes: Sequence[int]) -> PrefixMatch:
        out: dict[str, WorkerOverlap] = {}
        for worker_id, tiers in self._blocks.items():
            gpu = tiers.get(TIER_GPU, set())
            others = [s for t, s in tiers.items() if t != TIER_GPU]
            g = 0
            while g < len(block_hashes) and block_hashes[g] in gpu:
                g += 1
            e = g
            while e < len(block_hashes) and any(block_hashes[e] in s for s in others):
                e += 1
            if e:
                out[worker_id] = WorkerOverlap(g, e - g)
        return PrefixMatch(len(block_hashes), out)

    def tier_prefix(self, block_hashes: Sequence[int], tier: str) -> Mapping[str, int]:
        out = {}
        for worker_id, tiers in self._blocks.items():
            resident = tiers.get(index_tier(tier), set())
            n = 0
            while n < len(block_hashes) and block_hashes[n] in resident:
                n += 1
            if n:
                out[worker_id] = n
        return out

    def locate(self, block_hash: int) -> Mapping[str, frozenset[str]]:
        out = {}
        for worker_id, tiers in self._blocks.items():
            held = frozenset(t for t, s in tiers.items() if block_hash in s)
            if held:
                out[worker_id] = held
        return out

    def has_block(self, worker_id: str, block_hash: int, tier: str | None = None) -> bool:
        tiers = self._blocks.get(worker_id, {})
        if tier is not None:
            return block_hash in tiers.get(index_tier(tier), set())
        return any(block_hash in s for s in tiers.values())

    def session_placements(self, session_id: str) -> tuple[SessionPlacement, ...]:
        return self._sessions.placements(session_id)

    def worker_ids(self) -> tuple[str, ...]:
        with_blocks = {w for w, tiers in self._blocks.items() if any(tiers.values())}
        return tuple(sorted(with_blocks | self._sessions.workers()))

    def worker_block_counts(self, worker_id: str) -> Mapping[str, int]:
        return {t: len(s) for t, s in self._blocks.get(worker_id, {}).items() if s}

    def stats(self) -> IndexStats:
        by_tier = {t: sum(len(tiers.get(t, ())) for tiers in self._blocks.values())
                   for t in TIERS}
        distinct: set[int] = set()
        for tiers in self._blocks.values():
            for s in tiers.values():
                distinct |= s
        c = self._counters
        return IndexStats(
            distinct_blocks=len(distinct), entries=sum(by_tier.values()),
            entries_by_tier={t: n for t, n in by_tier.items() if n},
            workers=len(self.worker_ids()), sessions=len(self._sessions),
            stored_blocks=c["stored"], removed_blocks=c["removed"],
            duplicate_stores=c["duplicates"], missing_removes=c["missing"],
            cleared_workers=c["cleared"], purged_workers=c["purged"],
            snapshots_loaded=c["snapshots"], sessions_evicted=self._sessions.evicted,
            frontiers_dropped=self._sessions.frontiers_dropped)

    def export_state(self) -> IndexState:
        return IndexState(
            blocks={w: {t: frozenset(s) for t, s in tiers.items() if s}
                    for w, tiers in self._blocks.items() if any(tiers.values())},
            sessions=self._sessions.export())
