"""Differential test: the fast index and the naive reference answer every read alike on
random event streams wider than ``test_index_replay``'s: unknown tier names, runs that
repeat a hash or are empty, removals of hashes never stored or listed twice, snapshots
listing a block twice or a session with too many frontiers, small session bounds, and
more workers than fit one machine word coming and going (slot reuse)."""

from __future__ import annotations

import random

import pytest

from kvhint.router.kv_index import (
    AllBlocksCleared,
    BlocksRemoved,
    BlocksStored,
    ClusterKvIndex,
    IndexEvent,
    InMemoryClusterKvIndex,
    NaiveClusterKvIndex,
    SnapshotBlock,
    SnapshotLoaded,
    WorkerPurged,
)

WORKERS = [f"w{i}" for i in range(20)]
TIERS = ["GPU", "GPU", "GPU", "CPU", "STORAGE", "OTHER", "cpu", "DISK"]
READ_TIERS = ["GPU", "CPU", "STORAGE", "OTHER", "cpu", "DISK"]


def _events(rng: random.Random, n: int) -> tuple[list[IndexEvent], list[list[int]]]:
    chains: list[list[int]] = []
    for _ in range(40):
        base = rng.choice(chains)[: rng.randint(0, 6)] if chains and rng.random() < 0.6 else []
        chains.append(base + [rng.randrange(1, 400) for _ in range(rng.randint(1, 10))])
    sessions = [None, None, "a", "b", "c", "d", "e", "f"]
    events: list[IndexEvent] = []
    for _ in range(n):
        w = rng.choice(WORKERS[: rng.choice((4, 20))])
        chain = rng.choice(chains)
        roll = rng.random()
        if roll < 0.5:
            i = rng.randrange(len(chain))
            j = rng.randint(i, len(chain))  # may be empty
            run = chain[i:j]
            if run and rng.random() < 0.1:
                run = run + [run[0]]  # a hash repeated within one run
            events.append(BlocksStored(w, run, chain[i - 1] if i else None,
                                       rng.choice(TIERS), rng.choice(sessions), 16 * len(run)))
        elif roll < 0.85:
            hashes = rng.sample(chain, min(len(chain), rng.randint(1, 4)))
            if rng.random() < 0.1:
                hashes.append(hashes[0])  # listed twice
            if rng.random() < 0.1:
                hashes.append(1000 + rng.randrange(50))  # never stored
            events.append(BlocksRemoved(w, hashes, rng.choice(TIERS)))
        elif roll < 0.9:
            events.append(AllBlocksCleared(w, rng.choice(TIERS)))
        elif roll < 0.95:
            events.append(WorkerPurged(w, "test"))
        else:
            blocks = [SnapshotBlock(h, chain[k - 1] if k else None, rng.choice(TIERS))
                      for k, h in enumerate(chain)]
            if blocks and rng.random() < 0.3:
                blocks.append(blocks[0])
            snap_sessions = [(rng.choice(sessions[2:]), rng.sample(chain, min(len(chain), k)))
                             for k in (0, 1, 3, 5)]
            events.append(SnapshotLoaded(w, blocks, snap_sessions))
    return events, chains


def _assert_same(fast: ClusterKvIndex, naive: ClusterKvIndex, chains: list[list[int]]) -> None:
    assert fast.export_state() == naive.export_state()
    assert fast.stats() == naive.stats()
    assert fast.worker_ids() == naive.worker_ids()
    for chain in chains:
        query = chain + [999]
        assert fast.match_prefix(query) == naive.match_prefix(query)
        for tier in READ_TIERS:
            assert dict(fast.tier_prefix(query, tier)) == dict(naive.tier_prefix(query, tier))
        for h in chain[:3]:
            assert dict(fast.locate(h)) == dict(naive.locate(h))
    for w in WORKERS:
        assert dict(fast.worker_block_counts(w)) == dict(naive.worker_block_counts(w))
        for h in chains[0][:4] + [1000]:
            for tier in (None, *READ_TIERS):
                assert fast.has_block(w, h, tier) == naive.has_block(w, h, tier)
    for sid in "abcdef":
        assert fast.session_placements(sid) == naive.session_placements(sid)


@pytest.mark.parametrize("seed", range(6))
def test_fast_and_naive_agree_on_wide_random_streams(seed: int) -> None:
    rng = random.Random(seed)
    events, chains = _events(rng, 1500)
    fast = InMemoryClusterKvIndex(max_sessions=4, max_frontiers=2)
    naive = NaiveClusterKvIndex(max_sessions=4, max_frontiers=2)
    for step, event in enumerate(events):
        fast.apply(event)
        naive.apply(event)
        if step % 100 == 0:
            _assert_same(fast, naive, chains)
    _assert_same(fast, naive, chains)
    # Not vacuous: the stream left residencies in several tiers and evicted sessions.
    stats = fast.stats()
    assert len(stats.entries_by_tier) >= 3 and stats.sessions_evicted > 0
