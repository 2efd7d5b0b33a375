"""The obvious cluster KV index: hash -> reference count per (worker, tier) (GPU counts are
always 1: a set).

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
        self._blocks: dict[str, dict[str, dict[int, int]]] = {}
        self._sessions = SessionTable(max_sessions, max_frontiers)
        self._counters = dict.fromkeys(
            ("stored", "removed", "duplicates", "missing", "cleared", "purged", "snapshots",
             "repeat_stores", "repeat_removes"), 0)

    def apply(self, event: IndexEvent) -> None:
        c = self._counters
        if isinstance(event, BlocksStored):
            for h in event.block_hashes:
                self._store(event.worker_id, event.tier, h)
            if event.session_id is not None and event.block_hashes:
                self._sessions.stored(event.session_id, event.worker_id, event.parent_hash,
                                      event.block_hashes[-1])
        elif isinstance(event, BlocksRemoved):
            counts = self._blocks.get(event.worker_id, {}).get(index_tier(event.tier), {})
            for h in event.block_hashes:
                n = counts.get(h, 0)
                if n > 1:
                    counts[h] = n - 1
                    c["repeat_removes"] += 1
                elif n:
                    del counts[h]
                    c["removed"] += 1
                else:
                    c["missing"] += 1
        elif isinstance(event, AllBlocksCleared):
            c["cleared"] += 1
            tiers = self._blocks.get(event.worker_id, {})
            tiers.pop(index_tier(event.tier), None)
            if not any(tiers.values()):
                self._blocks.pop(event.worker_id, None)
                self._sessions.drop_worker(event.worker_id)
        elif isinstance(event, WorkerPurged):
            c["purged"] += 1
            self._blocks.pop(event.worker_id, None)
            self._sessions.drop_worker(event.worker_id)
        elif isinstance(event, SnapshotLoaded):
            c["snapshots"] += 1
            self._blocks.pop(event.worker_id, None)
            self._sessions.drop_worker(event.worker_id)
            for block in event.blocks:
                self._store(event.worker_id, block.tier, block.block_hash)
            self._sessions.load(event.worker_id, event.sessions)
        else:
            raise TypeError(f"not an index event: {event!r}")

    def _store(self, worker_id: str, tier: str, h: int) -> None:
        tier = index_tier(tier)
        counts = self._blocks.setdefault(worker_id, {}).setdefault(tier, {})
        n = counts.get(h, 0)
        if not n:
            counts[h] = 1
            self._counters["stored"] += 1
        elif tier == TIER_GPU:
            self._counters["duplicates"] += 1
        else:
            counts[h] = n + 1
            self._counters["repeat_stores"] += 1

    def apply_all(self, events: Iterable[IndexEvent]) -> None:
        for event in events:
            self.apply(event)

    def match_prefix(self, block_hashes: Sequence[int]) -> PrefixMatch:
        out: dict[str, WorkerOverlap] = {}
        for worker_id, tiers in self._blocks.items():
            gpu = tiers.get(TIER_GPU, {})
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
            resident = tiers.get(index_tier(tier), {})
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
            return block_hash in tiers.get(index_tier(tier), {})
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
                distinct |= s.keys()
        c = self._counters
        return IndexStats(
            distinct_blocks=len(distinct), entries=sum(by_tier.values()),
            entries_by_tier={t: n for t, n in by_tier.items() if n},
            workers=len(self.worker_ids()), sessions=len(self._sessions),
            stored_blocks=c["stored"], removed_blocks=c["removed"],
            duplicate_stores=c["duplicates"], missing_removes=c["missing"],
            cleared_workers=c["cleared"], purged_workers=c["purged"],
            snapshots_loaded=c["snapshots"], sessions_evicted=self._sessions.evicted,
            frontiers_dropped=self._sessions.frontiers_dropped,
            repeat_stores=c["repeat_stores"], repeat_removes=c["repeat_removes"])

    def export_state(self) -> IndexState:
        return IndexState(
            blocks={w: {t: frozenset(s) for t, s in tiers.items() if s}
                    for w, tiers in self._blocks.items() if any(tiers.values())},
            sessions=self._sessions.export(),
            refs={w: refs for w, tiers in self._blocks.items()
                  if (refs := {t: {h: n - 1 for h, n in s.items() if n > 1}
                               for t, s in tiers.items() if any(n > 1 for n in s.values())})})
