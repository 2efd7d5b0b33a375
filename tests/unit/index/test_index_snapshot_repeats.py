"""A snapshot whose pages list a session more than once (pages read from two copies of the
worker's index, as a plugin before paging by ``seq`` served them, or a worker's bug), or a
frontier twice in one session's entry. Before, ``snapshot_to_event`` concatenated the
listings: the resynced index held the session's frontier twice in its placement, and the
copies took the places of its branches under ``max_frontiers`` (counted as frontiers
dropped; a real branch lost). Now a snapshot with repeats rebuilds the same index as the
live one, the repeats counted (``AdapterCounters.snapshot_session_repeats``, the ingest
counter ``adapter_snapshot_session_repeats``). Blocks keep their contract: a GPU block
listed twice is one block (counted as a duplicate store), no count doubles."""

from __future__ import annotations

from kvhint.router.kv_index import AdapterCounters, InMemoryClusterKvIndex, snapshot_to_event
from kvhint.schemas import WorkerSnapshot
from kvhint.schemas.snapshot import SnapshotBlock, SnapshotSession
from ingest_fixtures import batch, headers, make_paging_ingestor, page, store
from test_index_replay import WORKERS, queries, random_events


def _pages(index: InMemoryClusterKvIndex, worker: str, repeat: bool) -> list[WorkerSnapshot]:
    """``worker``'s snapshot as its plugin lists it (each block once per reference it
    holds, each session once), on two pages. ``repeat``: the second page lists every
    session again, its last frontier twice, and the first GPU block again."""
    state = index.export_state()
    refs = state.refs.get(worker, {})
    blocks = [SnapshotBlock(h, None, tier)
              for tier, hashes in sorted(state.blocks.get(worker, {}).items())
              for h in sorted(hashes) for _ in range(1 + refs.get(tier, {}).get(h, 0))]
    sessions = [SnapshotSession(sid, list(p[worker]))
                for sid, p in state.sessions.items() if worker in p]
    again: list[SnapshotSession] = []
    extra: list[SnapshotBlock] = []
    if repeat:
        again = [SnapshotSession(s.session_id, [*s.frontiers, s.frontiers[-1]])
                 for s in sessions]
        extra = [b for b in blocks if b.medium == "GPU"][:1]
    first = WorkerSnapshot(worker_id=worker, epoch="e1", seq=9, block_size=32,
                           blocks=blocks, sessions=sessions, next_cursor=1)
    second = WorkerSnapshot(worker_id=worker, epoch="e1", seq=9, block_size=32,
                            blocks=extra, sessions=again)
    return [first, second]


def test_a_snapshot_listing_sessions_twice_rebuilds_the_live_index() -> None:
    events = random_events(11, 4000)
    cut = 2500
    live = InMemoryClusterKvIndex()
    live.apply_all(events[:cut])
    listed = {w: _pages(live, w, repeat=False) for w in WORKERS}
    sessions = sum(len(p[0].sessions) for p in listed.values())
    gpu_repeats = sum(any(b.medium == "GPU" for b in p[0].blocks) for p in listed.values())
    assert sessions > 20 and gpu_repeats > 2  # a non-trivial view to rebuild

    for repeat in (False, True):
        counters = AdapterCounters()
        restored = InMemoryClusterKvIndex()
        for worker in WORKERS:
            restored.apply(snapshot_to_event(_pages(live, worker, repeat), counters))
        assert restored.export_state() == live.export_state(), repeat
        for worker in WORKERS:
            assert restored.worker_block_counts(worker) == live.worker_block_counts(worker)
        stats = restored.stats()
        assert stats.frontiers_dropped == 0, repeat
        # Each session listed again, and its last frontier listed twice in that entry.
        assert counters.snapshot_session_repeats == (2 * sessions if repeat else 0)
        assert stats.duplicate_stores == (gpu_repeats if repeat else 0)
        later = InMemoryClusterKvIndex()
        later.apply_all(events[:cut])
        restored.apply_all(events[cut:])
        later.apply_all(events[cut:])
        assert restored.export_state() == later.export_state()
        for q in queries(11):
            assert restored.match_prefix(q) == later.match_prefix(q)


def test_the_ingestor_counts_a_session_listed_on_two_pages() -> None:
    """Through the ingestor's resync: a session on both pages (its branches 3 and 5, then
    5 again and 6) is one placement of its three branches, the repeats counted."""
    ing, index, _ = make_paging_ingestor()
    ing.on_event_message(headers("w0", "e1", 1), batch(store([1, 2, 3], session="t/s")))
    ing.on_event_message(headers("w0", "e1", 4), batch(store([9])))  # a gap: resync
    ing.on_snapshot_page(page("w0", "e1", 4, [(1, None, "GPU"), (3, 1, "GPU")],
                              cursor_next=2, sessions=[("t/s", [3, 5])]))
    ing.on_snapshot_page(page("w0", "e1", 4, [(5, 1, "GPU"), (6, 1, "GPU")],
                              sessions=[("t/s", [5, 6, 6])]))
    (placement,) = index.session_placements("t/s")
    assert placement.frontiers == (3, 5, 6)
    assert ing.stats().adapter["snapshot_session_repeats"] == 2
    assert index.stats().frontiers_dropped == 0
