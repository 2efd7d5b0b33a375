"""The index is a pure function of its events: replaying them rebuilds it exactly, a
snapshot plus the events after it equals the live index, and the fast implementation
agrees with the naive reference on random event streams."""

from __future__ import annotations

import random

from kvhint.router.kv_index import (
    AllBlocksCleared,
    BlocksRemoved,
    BlocksStored,
    IndexEvent,
    InMemoryClusterKvIndex,
    NaiveClusterKvIndex,
    SnapshotBlock,
    SnapshotLoaded,
    WorkerPurged,
)

WORKERS = [f"w{i}" for i in range(6)]
TIERS = ["GPU", "GPU", "GPU", "CPU", "STORAGE"]


def random_chains(rng: random.Random, n: int) -> list[list[int]]:
    """Prefix-sharing chains, like conversations that share system prompts."""
    chains: list[list[int]] = []
    for _ in range(n):
        if chains and rng.random() < 0.6:
            base = rng.choice(chains)
            chain = base[: rng.randint(0, len(base))]
        else:
            chain = []
        chain = chain + [rng.getrandbits(64) for _ in range(rng.randint(1, 12))]
        chains.append(chain)
    return chains


def random_events(seed: int, n: int) -> list[IndexEvent]:
    rng = random.Random(seed)
    chains = random_chains(rng, 60)
    events: list[IndexEvent] = []
    for _ in range(n):
        w = rng.choice(WORKERS)
        roll = rng.random()
        chain = rng.choice(chains)
        if roll < 0.6:
            start = rng.randint(0, len(chain) - 1)
            end = rng.randint(start + 1, len(chain))
            parent = chain[start - 1] if start else None
            session = rng.choice([None, "a", "b", "c", f"s{rng.randint(0, 30)}"])
            events.append(BlocksStored(w, chain[start:end], parent, rng.choice(TIERS),
                                       session, 32 * (end - start)))
        elif roll < 0.97:
            k = rng.randint(1, 3)
            events.append(BlocksRemoved(w, rng.sample(chain, min(k, len(chain))),
                                        rng.choice(TIERS)))
        elif roll < 0.98:
            events.append(AllBlocksCleared(w))
        elif roll < 0.99:
            events.append(WorkerPurged(w, "test"))
        else:
            blocks = [SnapshotBlock(h, chain[i - 1] if i else None, rng.choice(TIERS))
                      for i, h in enumerate(chain[: rng.randint(1, len(chain))])]
            events.append(SnapshotLoaded(w, blocks, [("snap", [blocks[-1].block_hash])]))
    return events


def queries(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [c + [rng.getrandbits(64)] for c in random_chains(rng, 60)]


def test_fast_index_agrees_with_naive_reference() -> None:
    for seed in range(5):
        fast, naive = InMemoryClusterKvIndex(), NaiveClusterKvIndex()
        qs = queries(seed)
        for step, event in enumerate(random_events(seed, 3000)):
            fast.apply(event)
            naive.apply(event)
            if step % 50 == 0:
                for q in qs[:20]:
                    assert fast.match_prefix(q) == naive.match_prefix(q)
                    for tier in ("GPU", "CPU"):
                        assert fast.tier_prefix(q, tier) == naive.tier_prefix(q, tier)
        assert fast.export_state() == naive.export_state()
        assert fast.stats() == naive.stats()
        for q in qs:
            assert fast.match_prefix(q) == naive.match_prefix(q)
            assert fast.locate(q[0]) == naive.locate(q[0])
        for w in WORKERS:
            assert fast.worker_block_counts(w) == naive.worker_block_counts(w)
        for sid in ("a", "b", "c", "snap"):
            assert fast.session_placements(sid) == naive.session_placements(sid)


def test_replaying_the_events_rebuilds_an_identical_index() -> None:
    events = random_events(42, 5000)
    live = InMemoryClusterKvIndex()
    for event in events:
        live.apply(event)
    replayed = InMemoryClusterKvIndex()
    replayed.apply_all(events)
    assert replayed.export_state() == live.export_state()
    assert replayed.stats() == live.stats()
    assert live.stats().entries > 100  # the stream leaves a non-trivial index behind
    assert live.export_state().refs  # with hashes held twice in a host tier
    for q in queries(42):
        assert replayed.match_prefix(q) == live.match_prefix(q)


def _snapshot_of(index: InMemoryClusterKvIndex, worker: str) -> SnapshotLoaded:
    """What the worker's plugin would list: each block once per reference it holds."""
    state = index.export_state()
    refs = state.refs.get(worker, {})
    blocks = [SnapshotBlock(h, None, tier)
              for tier, hashes in sorted(state.blocks.get(worker, {}).items())
              for h in sorted(hashes) for _ in range(1 + refs.get(tier, {}).get(h, 0))]
    sessions = [(sid, list(p[worker])) for sid, p in state.sessions.items() if worker in p]
    return SnapshotLoaded(worker, blocks, sessions)


def test_snapshot_plus_later_events_equals_the_live_index() -> None:
    events = random_events(7, 4000)
    cut = 2500
    live = InMemoryClusterKvIndex()
    live.apply_all(events[:cut])
    restored = InMemoryClusterKvIndex()  # a router that starts late, at the cut
    for worker in WORKERS:
        restored.apply(_snapshot_of(live, worker))
    assert restored.export_state() == live.export_state()
    live.apply_all(events[cut:])
    restored.apply_all(events[cut:])
    assert restored.export_state() == live.export_state()
    for q in queries(7):
        assert restored.match_prefix(q) == live.match_prefix(q)
