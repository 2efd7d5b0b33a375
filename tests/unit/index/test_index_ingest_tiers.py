"""Tiers on the wire path (vLLM batch -> adapter -> index): which tier a prefix-cache reset
clears, and mediums spelt in another case. vLLM facts checked on the installed 0.32:
``BlockPool.reset_prefix_cache`` emits the medium-less ``AllBlocksCleared``, once per pool
``KVCacheCoordinator.reset_prefix_cache`` resets (the GPU pool; with HiSparse also its
host pool, medium CPU, on the same queue); the offloading connector's host tier resets
with no event; the Mooncake store connector publishes medium "cpu"."""

from __future__ import annotations

from ingest_fixtures import Clock, batch, headers, remove, store

from kvhint import schemas as s
from kvhint.router.kv_index import (
    AllBlocksCleared,
    EventBatchAdapter,
    InMemoryClusterKvIndex,
    KvEventIngestor,
    WorkerOverlap,
)


def _fed(*batches: bytes) -> tuple[KvEventIngestor, InMemoryClusterKvIndex]:
    index = InMemoryClusterKvIndex()
    ing = KvEventIngestor(index, Clock())
    for seq, payload in enumerate(batches, start=1):
        ing.on_event_message(headers("w0", "e1", seq), payload)
    return ing, index


def test_a_prefix_cache_reset_clears_the_gpu_tier_only() -> None:
    _, index = _fed(batch(store([1, 2], session="t/s"), store([1, 2, 3], medium="CPU")),
                    batch(s.AllBlocksCleared()))
    assert index.export_state().blocks == {"w0": {"CPU": frozenset({1, 2, 3})}}
    assert index.match_prefix([1, 2, 3]).of("w0") == WorkerOverlap(0, 3)
    assert index.stats().cleared_workers == 1
    assert [p.worker_id for p in index.session_placements("t/s")] == ["w0"]


def test_a_second_clear_in_one_batch_is_the_host_pools() -> None:
    # HiSparse: the coordinator resets the GPU pool and the host pool (medium CPU) in one
    # call, each appending an AllBlocksCleared to the shared queue.
    _, index = _fed(batch(store([1, 2]), store([1, 2, 3], medium="CPU")),
                    batch(s.AllBlocksCleared(), s.AllBlocksCleared(), store([9])))
    assert index.export_state().blocks == {"w0": {"GPU": frozenset({9})}}
    # Clears apart (another event between) are each the GPU pool's.
    adapter = EventBatchAdapter()
    events = adapter.convert_events("w0", [s.AllBlocksCleared(), remove(5),
                                           s.AllBlocksCleared()])
    assert [e.tier for e in events if isinstance(e, AllBlocksCleared)] == ["GPU", "GPU"]


def test_a_medium_in_another_case_is_its_tier_not_an_unknown_one() -> None:
    # Before, "cpu" (vLLM's Mooncake store connector) was counted as an unknown medium
    # and, in the index, kept apart from "CPU" (OTHER).
    ing, index = _fed(batch(store([1, 2], medium="cpu"), store([3], parent=2, medium="Cpu"),
                            store([4], medium="gpu"), remove(1, medium="cpu")))
    assert index.export_state().blocks == {
        "w0": {"CPU": frozenset({2, 3}), "GPU": frozenset({4})}}
    assert ing.stats().adapter["unknown_medium_events"] == 0
    other, _ = _fed(batch(store([5], medium="nvme"), store([6], medium="NVMe")))
    assert other.stats().adapter["unknown_medium_events"] == 2  # each one counted


def test_the_adapter_remembers_a_bounded_number_of_spellings() -> None:
    adapter = EventBatchAdapter()
    spellings = ["".join(c.upper() if n >> i & 1 else c for i, c in enumerate("storage"))
                 for n in range(128)]
    events = adapter.convert_events("w0", [store([n], medium=m)
                                           for n, m in enumerate(spellings)])
    assert {e.tier for e in events} == {"STORAGE"}
    assert adapter.counters.unknown_medium_events == 0
    assert len(adapter._tiers) <= 5 + EventBatchAdapter._MAX_LEARNT_MEDIUMS  # noqa: SLF001


def test_a_batch_buffered_during_a_resync_is_read_by_the_group_its_headers_name() -> None:
    """A hybrid engine's batches name the KV-cache group to follow (Kvhint-Group). One
    that waits out a resync is applied later by its own header, not by group 0."""
    from ingest_fixtures import page

    index = InMemoryClusterKvIndex()
    ing = KvEventIngestor(index, Clock())

    def send(seq: int, *events: s.BlockStored | s.BlockRemoved) -> None:
        meta = s.EventBatchMeta("w0", "e1", seq, 5)
        ing.on_event_message(meta.to_headers(), batch(*events))

    send(1, store([1], group=0), store([1], group=5))
    send(3, store([3], parent=2, group=5), store([30], group=0))  # a gap: buffered
    send(4, remove(1), store([4], parent=3, group=5))  # remove(1) is group 0's
    assert index.export_state().blocks == {"w0": {"GPU": frozenset({1})}}
    ing.on_snapshot_page(page("w0", "e1", 2, [(1, None, "GPU"), (2, 1, "GPU")]))
    assert index.export_state().blocks == {"w0": {"GPU": frozenset({1, 2, 3, 4})}}
    assert ing.stats().adapter["other_group_events"] == 3
