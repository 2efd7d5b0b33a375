"""One suite, every ClusterKvIndex implementation (llm-d style): the fast in-memory index
and the naive reference must answer every read the same way."""

from __future__ import annotations

import pytest

from kvhint.router.kv_index import (
    NO_OVERLAP,
    AllBlocksCleared,
    BlocksRemoved,
    BlocksStored,
    ClusterKvIndex,
    InMemoryClusterKvIndex,
    NaiveClusterKvIndex,
    SessionPlacement,
    SnapshotBlock,
    SnapshotLoaded,
    WorkerOverlap,
    WorkerPurged,
)

IMPLEMENTATIONS = [InMemoryClusterKvIndex, NaiveClusterKvIndex]


@pytest.fixture(params=IMPLEMENTATIONS, ids=lambda c: c.__name__)
def index(request: pytest.FixtureRequest) -> ClusterKvIndex:
    return request.param()


def stored(w: str, hashes: list[int], parent: int | None = None, tier: str = "GPU",
           session: str | None = None) -> BlocksStored:
    return BlocksStored(w, hashes, parent, tier, session, 32 * len(hashes))


def test_is_a_cluster_kv_index(index: ClusterKvIndex) -> None:
    assert isinstance(index, ClusterKvIndex)


def test_empty_index_matches_nothing(index: ClusterKvIndex) -> None:
    match = index.match_prefix([1, 2, 3])
    assert match.num_blocks == 3 and dict(match.workers) == {}
    assert match.of("w0") == NO_OVERLAP
    assert index.locate(1) == {} and not index.has_block("w0", 1)
    assert index.worker_ids() == () and index.worker_block_counts("w0") == {}
    assert index.stats().distinct_blocks == 0 and index.stats().entries == 0


def test_longest_prefix_per_worker(index: ClusterKvIndex) -> None:
    index.apply(stored("w0", [1, 2, 3, 4]))
    index.apply(stored("w1", [1, 2]))
    index.apply(stored("w2", [2, 3, 4]))  # not a prefix: block 1 missing
    match = index.match_prefix([1, 2, 3, 4, 5])
    assert dict(match.workers) == {"w0": WorkerOverlap(4, 0), "w1": WorkerOverlap(2, 0)}
    assert match.of("w2") == NO_OVERLAP
    assert match.of("w0").total_blocks == 4


def test_prefix_stops_at_first_missing_block(index: ClusterKvIndex) -> None:
    index.apply(stored("w0", [1, 2, 3, 4]))
    index.apply(BlocksRemoved("w0", [2]))
    assert dict(index.match_prefix([1, 2, 3, 4]).workers) == {"w0": WorkerOverlap(1, 0)}


def test_external_tier_continues_the_gpu_prefix(index: ClusterKvIndex) -> None:
    index.apply(stored("w0", [1, 2]))
    index.apply(stored("w0", [3, 4], parent=2, tier="CPU"))
    index.apply(stored("w0", [5], parent=4))  # GPU again after the CPU run: not counted
    index.apply(stored("w1", [1, 2, 3], tier="CPU"))  # all external, from block 0
    match = index.match_prefix([1, 2, 3, 4, 5, 6])
    assert match.of("w0") == WorkerOverlap(2, 2)
    assert match.of("w1") == WorkerOverlap(0, 3)
    assert index.tier_prefix([1, 2, 3, 4, 5], "CPU") == {"w1": 3}
    assert index.tier_prefix([1, 2, 3, 4, 5], "GPU") == {"w0": 2}


def test_block_in_both_tiers(index: ClusterKvIndex) -> None:
    index.apply(stored("w0", [1, 2, 3]))
    index.apply(stored("w0", [1, 2, 3], tier="CPU"))
    index.apply(BlocksRemoved("w0", [2], "GPU"))  # GPU copy evicted, host copy stays
    assert index.match_prefix([1, 2, 3]).of("w0") == WorkerOverlap(1, 2)
    assert index.locate(2) == {"w0": frozenset({"CPU"})}
    assert index.locate(1) == {"w0": frozenset({"GPU", "CPU"})}
    assert index.has_block("w0", 2) and index.has_block("w0", 2, "CPU")
    assert not index.has_block("w0", 2, "GPU")
    assert index.worker_block_counts("w0") == {"GPU": 2, "CPU": 3}


def test_set_semantics_duplicates_and_missing_removes_are_counted(index: ClusterKvIndex) -> None:
    index.apply(stored("w0", [1, 2]))
    index.apply(stored("w0", [1, 2]))  # re-reported (kv_cache_report_mode=full) or a copy
    index.apply(BlocksRemoved("w0", [1]))
    index.apply(BlocksRemoved("w0", [1, 9]))
    index.apply(BlocksRemoved("nobody", [1]))
    stats = index.stats()
    assert stats.duplicate_stores == 2 and stats.missing_removes == 3
    assert stats.stored_blocks == 2 and stats.removed_blocks == 1
    assert not index.has_block("w0", 1) and index.has_block("w0", 2)


def test_a_hash_repeated_within_one_run_counts_once(index: ClusterKvIndex) -> None:
    # Two byte hashes with the same low 64 bits arrive as one int twice. The fast index's
    # all-new path counted the run's length: a residency stayed counted after removal.
    index.apply(stored("w0", [7, 7]))
    assert index.worker_block_counts("w0") == {"GPU": 1}
    assert index.stats().stored_blocks == 1 and index.stats().duplicate_stores == 1
    index.apply(BlocksRemoved("w0", [7]))
    assert index.worker_block_counts("w0") == {} and index.stats().entries == 0


def test_a_tier_outside_the_known_ones_is_kept_under_other(index: ClusterKvIndex) -> None:
    index.apply(stored("w0", [1, 2], tier="disk"))
    assert index.locate(1) == {"w0": frozenset({"OTHER"})}
    assert index.has_block("w0", 1, "disk") and index.tier_prefix([1, 2], "OTHER") == {"w0": 2}
    index.apply(BlocksRemoved("w0", [1, 2], "disk"))
    assert index.stats().entries == 0


def test_tier_names_are_taken_in_any_case(index: ClusterKvIndex) -> None:
    # vLLM's Mooncake store connector publishes medium "cpu"; before, the index kept its
    # blocks under OTHER, apart from the same blocks stored as "CPU".
    index.apply(stored("w0", [1, 2], tier="cpu"))
    index.apply(stored("w0", [3], parent=2, tier="Cpu"))
    assert index.locate(1) == {"w0": frozenset({"CPU"})}
    assert index.tier_prefix([1, 2, 3], "CPU") == {"w0": 3}
    assert index.has_block("w0", 3, "cpu") and index.worker_block_counts("w0") == {"CPU": 3}
    index.apply(BlocksRemoved("w0", [1, 2, 3], "CPU"))
    assert index.stats().entries == 0


def test_removal_of_last_copy_forgets_the_hash(index: ClusterKvIndex) -> None:
    index.apply(stored("w0", [7]))
    index.apply(stored("w1", [7]))
    index.apply(BlocksRemoved("w0", [7]))
    assert index.locate(7) == {"w1": frozenset({"GPU"})}
    index.apply(BlocksRemoved("w1", [7]))
    assert index.locate(7) == {} and index.stats().distinct_blocks == 0


def test_clear_and_purge_drop_one_worker_only(index: ClusterKvIndex) -> None:
    for w in ("w0", "w1", "w2"):
        index.apply(stored(w, [1, 2], session=f"s-{w}"))
    index.apply(AllBlocksCleared("w0"))
    index.apply(WorkerPurged("w1", "engine restarted"))
    assert set(index.match_prefix([1, 2, 3]).workers) == {"w2"}
    assert index.worker_ids() == ("w2",)
    assert index.session_placements("s-w0") == () and index.session_placements("s-w1") == ()
    stats = index.stats()
    assert stats.cleared_workers == 1 and stats.purged_workers == 1
    assert stats.entries == 2 and stats.distinct_blocks == 2
    index.apply(stored("w0", [1]))  # a purged worker can come back
    assert index.match_prefix([1, 2]).of("w0") == WorkerOverlap(1, 0)


def test_a_prefix_cache_reset_keeps_the_host_tier(index: ClusterKvIndex) -> None:
    # vLLM's AllBlocksCleared is the GPU pool's reset (BlockPool.reset_prefix_cache); the
    # offloading connector's CPU tier is not reset with it. Before, it went too: a false
    # miss on every block the worker could still load from host memory.
    for w in ("w0", "w1"):
        index.apply(stored(w, [1, 2], session=f"s-{w}"))
        index.apply(stored(w, [1, 2, 3], tier="CPU"))
    index.apply(AllBlocksCleared("w0"))
    assert index.match_prefix([1, 2, 3]).of("w0") == WorkerOverlap(0, 3)
    assert index.match_prefix([1, 2, 3]).of("w1") == WorkerOverlap(2, 1)
    assert index.worker_block_counts("w0") == {"CPU": 3}
    # Its sessions' blocks may be on the host: their placements stay.
    assert index.session_placements("s-w0") == (SessionPlacement("w0", (2,)),)
    # A clear of the CPU tier (a second clear in one batch: HiSparse's host pool).
    index.apply(AllBlocksCleared("w0", "CPU"))
    assert index.worker_block_counts("w0") == {} and index.worker_ids() == ("w1",)
    assert index.session_placements("s-w0") == ()
    assert index.stats().cleared_workers == 2 and index.stats().entries == 5
    assert index.export_state().blocks == {"w1": {"GPU": frozenset({1, 2}),
                                                  "CPU": frozenset({1, 2, 3})}}


def test_host_tier_counts_references_to_a_hash(index: ClusterKvIndex) -> None:
    # vLLM's offloading tier announces a hash once per chunk holding it (two chunks that
    # share a prefix not aligned to chunks) and fans each chunk's eviction out to all of
    # its hashes; its docs ask consumers to count. Before, the first chunk's eviction
    # dropped hashes 1 and 2 that the second chunk still holds.
    index.apply(stored("w0", [1, 2, 3, 4], tier="CPU"))   # chunk A
    index.apply(stored("w0", [1, 2, 5, 6], tier="CPU"))   # chunk B, same first two
    index.apply(BlocksRemoved("w0", [1, 2, 3, 4], "CPU"))  # chunk A evicted
    assert index.tier_prefix([1, 2, 5, 6], "CPU") == {"w0": 4}
    assert not index.has_block("w0", 3) and index.worker_block_counts("w0") == {"CPU": 4}
    stats = index.stats()
    assert (stats.repeat_stores, stats.repeat_removes, stats.duplicate_stores) == (2, 2, 0)
    assert index.export_state().refs == {}
    index.apply(BlocksRemoved("w0", [1, 2, 5, 6], "CPU"))  # chunk B evicted
    assert index.stats().entries == 0 and index.locate(1) == {}
    # GPU stays a set: a re-reported block is one residency, one removal drops it.
    index.apply(stored("w0", [7]))
    index.apply(stored("w0", [7]))
    index.apply(BlocksRemoved("w0", [7]))
    assert index.stats().entries == 0 and index.stats().duplicate_stores == 1


def test_references_are_part_of_the_state_and_of_a_snapshot(index: ClusterKvIndex) -> None:
    index.apply(stored("w0", [1, 2], tier="CPU"))
    index.apply(stored("w0", [1], tier="CPU"))
    assert index.export_state().refs == {"w0": {"CPU": {1: 1}}}
    # A snapshot lists a block once per reference.
    index.apply(SnapshotLoaded("w0", [SnapshotBlock(1, None, "CPU"),
                                      SnapshotBlock(1, None, "CPU"),
                                      SnapshotBlock(1, None, "CPU")]))
    assert index.export_state().refs == {"w0": {"CPU": {1: 2}}}
    index.apply(BlocksRemoved("w0", [1, 1], "CPU"))
    assert index.has_block("w0", 1, "CPU") and index.export_state().refs == {}
    index.apply(AllBlocksCleared("w0", "cpu"))
    assert index.stats().entries == 0 and index.export_state().refs == {}


def test_session_frontier_follows_the_chain(index: ClusterKvIndex) -> None:
    index.apply(stored("w0", [1, 2], session="s"))
    index.apply(stored("w0", [3, 4], parent=2, session="s"))
    assert index.session_placements("s") == (SessionPlacement("w0", (4,)),)
    index.apply(stored("w0", [5], parent=2, session="s"))  # a branch off block 2
    assert index.session_placements("s") == (SessionPlacement("w0", (4, 5)),)
    index.apply(stored("w1", [1, 2, 3, 4, 6], session="s"))  # moved to w1
    assert [p.worker_id for p in index.session_placements("s")] == ["w0", "w1"]
    index.apply(stored("w0", [7], parent=4, session="s"))  # back on w0: most recent last
    assert index.session_placements("s") == (SessionPlacement("w1", (6,)),
                                             SessionPlacement("w0", (5, 7)))
    index.apply(stored("w0", [8], session=None))  # no session: placements unchanged
    assert index.stats().sessions == 1


def test_sessions_and_frontiers_are_bounded() -> None:
    for cls in IMPLEMENTATIONS:
        index = cls(max_sessions=2, max_frontiers=2)
        for i, sid in enumerate(["a", "b", "c"]):
            index.apply(stored("w0", [i + 1], session=sid))
        assert index.session_placements("a") == ()
        assert index.stats().sessions == 2 and index.stats().sessions_evicted == 1
        for h in (10, 11, 12):  # three unrelated branches
            index.apply(stored("w0", [h], session="c"))
        assert index.session_placements("c") == (SessionPlacement("w0", (11, 12)),)
        assert index.stats().frontiers_dropped == 2


def test_snapshot_replaces_the_workers_state(index: ClusterKvIndex) -> None:
    index.apply(stored("w0", [1, 2, 3], session="old"))
    index.apply(stored("w1", [1, 2], session="other"))
    index.apply(SnapshotLoaded("w0", [SnapshotBlock(1, None), SnapshotBlock(5, 1),
                                      SnapshotBlock(6, 5, "CPU")], [("new", [6])]))
    assert index.match_prefix([1, 5, 6]).of("w0") == WorkerOverlap(2, 1)
    assert not index.has_block("w0", 2)
    assert index.session_placements("old") == ()
    assert index.session_placements("new") == (SessionPlacement("w0", (6,)),)
    assert index.session_placements("other") == (SessionPlacement("w1", (2,)),)
    assert index.stats().snapshots_loaded == 1


def test_many_workers_and_long_chains(index: ClusterKvIndex) -> None:
    chain = list(range(1000, 1200))
    for w in range(40):  # more workers than bits in one machine word
        index.apply(stored(f"w{w}", chain[: 5 * w]))
    match = index.match_prefix(chain)
    assert {w: o.gpu_blocks for w, o in match.workers.items()} == {
        f"w{w}": 5 * w for w in range(1, 40)}


def test_export_state_is_canonical(index: ClusterKvIndex) -> None:
    index.apply(stored("w0", [1, 2], session="s"))
    index.apply(stored("w0", [3], parent=2, tier="CPU"))
    state = index.export_state()
    assert state.blocks == {"w0": {"GPU": frozenset({1, 2}), "CPU": frozenset({3})}}
    assert state.sessions == {"s": {"w0": (2,)}}


def test_snapshot_listing_a_block_twice_counts_one_residency(index: ClusterKvIndex) -> None:
    index.apply(SnapshotLoaded("w0", [SnapshotBlock(1, None), SnapshotBlock(1, None),
                                      SnapshotBlock(1, None, "CPU")]))
    assert index.worker_block_counts("w0") == {"GPU": 1, "CPU": 1}
    assert index.stats().duplicate_stores == 1 and index.stats().entries == 2
    index.apply(BlocksRemoved("w0", [1]))
    assert index.worker_block_counts("w0") == {"CPU": 1}


def test_workers_that_come_and_go_reuse_their_slots() -> None:
    # A fleet whose worker ids change (autoscaling, restarts under new ids): each purged
    # worker's slot is reused, so the per-hash masks and every lookup's loop over slots
    # stay as wide as the live fleet. Before, 3,000 such ids made a 64-block lookup take
    # 13 ms instead of 5 us. (Slots are the fast index's own; the naive one has none.)
    index = InMemoryClusterKvIndex()
    index.apply(stored("keep", [1, 2, 3]))
    for n in range(3_000):
        index.apply(stored(f"gone-{n}", [1, 2, 100 + n]))
        index.apply(WorkerPurged(f"gone-{n}", "engine restarted"))
    index.apply(stored("new", [1, 2]))
    assert dict(index.match_prefix([1, 2, 3]).workers) == {
        "keep": WorkerOverlap(3, 0), "new": WorkerOverlap(2, 0)}
    assert index.worker_ids() == ("keep", "new")
    assert len(index._worker_of) == 2  # noqa: SLF001 - the slots themselves are the point
    assert index.locate(100) == {} and index.stats().distinct_blocks == 3
