"""The ingestor's stream rules: ordering, duplicates, gaps, epochs, resync through paged
snapshots, dead workers, tail gaps; and that every dropped message is counted."""

from __future__ import annotations

from kvhint import schemas as s
from kvhint.router.kv_index import (
    InMemoryClusterKvIndex,
    KvEventIngestor,
    RequestSnapshot,
    StreamConfig,
    WorkerAlive,
    WorkerDead,
    WorkerOverlap,
    WorkerPurgedNotice,
)
from kvhint.schemas.snapshot import SnapshotBlock as WireBlock
from kvhint.schemas.snapshot import SnapshotSession


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def batch(*events: s.BlockStored | s.BlockRemoved | s.AllBlocksCleared) -> bytes:
    return s.encode_event_batch(s.KVEventBatch(ts=1.0, events=list(events)))


def store(hashes: list[int], parent: int | None = None, medium: str | None = "GPU",
          session: str | None = None, group: int | None = 0) -> s.BlockStored:
    return s.BlockStored(block_hashes=hashes, parent_block_hash=parent,
                         token_ids=list(range(32 * len(hashes))), block_size=32, lora_id=None,
                         medium=medium, lora_name=None, group_idx=group, session_id=session)


def remove(h: int, medium: str | None = "GPU") -> s.BlockRemoved:
    return s.BlockRemoved(block_hashes=[h], medium=medium, group_idx=0)


def headers(worker: str, epoch: str, seq: int) -> dict[str, str]:
    return s.EventBatchMeta(worker, epoch, seq).to_headers()


def status(worker: str = "w0", epoch: str = "e1", last_seq: int = 0,
           interval_s: float = 1.0) -> s.WorkerStatus:
    return s.WorkerStatus(
        worker_id=worker, epoch=epoch, model="tiny", cache_namespace="ns", block_size=32,
        hash_algo="sha256", none_hash_seed="vllm-none-hash", supported_actions={},
        budgets=s.Budgets(max_pinned_blocks=0, max_pin_ttl_s=0, max_retained_blocks=0,
                          max_retain_ttl_s=0),
        usage=s.Usage(gpu_blocks_total=10, gpu_blocks_free=10, kv_usage=0.0),
        last_event_seq=last_seq, interval_s=interval_s, at=0.0)


def page(worker: str, epoch: str, seq: int, blocks: list[tuple[int, int | None, str]],
         cursor_next: int | None = None, sessions: list[tuple[str, list[int]]] = ()
         ) -> s.WorkerSnapshot:
    return s.WorkerSnapshot(
        worker_id=worker, epoch=epoch, seq=seq, block_size=32,
        blocks=[WireBlock(h, p, m) for h, p, m in blocks],
        sessions=[SnapshotSession(sid, f) for sid, f in sessions], next_cursor=cursor_next)


def make() -> tuple[KvEventIngestor, InMemoryClusterKvIndex, Clock]:
    clock = Clock()
    index = InMemoryClusterKvIndex()
    return KvEventIngestor(index, clock, StreamConfig(snapshot_page_limit=2)), index, clock


def test_in_order_batches_from_seq_1_are_applied() -> None:
    ing, index, _ = make()
    acts = ing.on_event_message(headers("w0", "e1", 1), batch(store([1, 2], session="t/s")))
    assert acts == [WorkerAlive("w0", "e1")]
    assert ing.on_event_message(headers("w0", "e1", 2),
                                batch(store([3], parent=2), remove(1), remove(2))) == []
    assert index.match_prefix([3]).of("w0") == WorkerOverlap(1, 0)
    assert not index.has_block("w0", 1)
    assert index.session_placements("t/s")[0].frontiers == (2,)
    assert ing.live_workers() == ("w0",)
    stats = ing.stats()
    assert stats.stream["batches_applied"] == 2 and stats.adapter["events"] == 4


def test_duplicates_and_stale_epochs_are_dropped_and_counted() -> None:
    ing, index, _ = make()
    ing.on_event_message(headers("w0", "e1", 1), batch(store([1])))
    ing.on_event_message(headers("w0", "e1", 1), batch(store([99])))
    assert not index.has_block("w0", 99)
    ing.on_event_message(headers("w0", "e2", 1), batch(store([5])))  # restart
    ing.on_event_message(headers("w0", "e1", 2), batch(store([77])))  # late, old epoch
    assert not index.has_block("w0", 77) and not index.has_block("w0", 1)
    stream = ing.stats().stream
    assert stream["duplicates"] == 1 and stream["stale_epoch"] == 1
    assert stream["epoch_changes"] == 1


def test_new_epoch_purges_and_continues_from_seq_1() -> None:
    ing, index, _ = make()
    ing.on_event_message(headers("w0", "e1", 1), batch(store([1, 2], session="x")))
    acts = ing.on_event_message(headers("w0", "e2", 1), batch(store([3])))
    assert [type(a) for a in acts] == [WorkerPurgedNotice]
    assert index.export_state().blocks == {"w0": {"GPU": frozenset({3})}}
    assert index.session_placements("x") == ()


def test_gap_buffers_then_resyncs_from_paged_snapshot() -> None:
    ing, index, _ = make()
    ing.on_event_message(headers("w0", "e1", 1), batch(store([1, 2])))
    acts = ing.on_event_message(headers("w0", "e1", 4), batch(store([9], parent=8)))
    assert acts == [RequestSnapshot("w0", 0, 2, "sequence gap: expected 2, got 4")]
    # While resyncing, the old state keeps answering and new batches wait.
    assert index.has_block("w0", 1)
    ing.on_event_message(headers("w0", "e1", 5), batch(remove(1)))
    ing.on_event_message(headers("w0", "e1", 6), batch(store([10], parent=9)))
    assert not index.has_block("w0", 10)
    acts = ing.on_snapshot_page(page("w0", "e1", 4, [(1, None, "GPU"), (7, 1, "GPU")],
                                     cursor_next=2))
    assert acts == [RequestSnapshot("w0", 2, 2, "snapshot continues")]
    acts = ing.on_snapshot_page(page("w0", "e1", 5, [(8, 7, "GPU"), (9, 8, "CPU")],
                                     sessions=[("t/s", [9])]))
    assert acts == []
    # Pages joined at seq 4 (min over pages); batches 5 and 6 replayed on top.
    assert index.export_state().blocks == {
        "w0": {"GPU": frozenset({7, 8, 10}), "CPU": frozenset({9})}}
    assert index.session_placements("t/s")[0].frontiers == (9,)
    assert ing.live_workers() == ("w0",)
    stream = ing.stats().stream
    assert stream["gaps"] == 1 and stream["missing_batches"] == 2
    assert stream["covered_by_snapshot"] == 1  # seq 4 was inside the snapshot
    assert stream["resyncs_completed"] == 1
    ing.on_event_message(headers("w0", "e1", 7), batch(store([11], parent=10)))
    assert index.has_block("w0", 11)


def test_router_joining_mid_stream_resyncs_first() -> None:
    ing, index, _ = make()
    acts = ing.on_event_message(headers("w0", "e1", 40), batch(store([5])))
    assert [type(a) for a in acts] == [WorkerAlive, RequestSnapshot]
    assert index.stats().entries == 0
    ing.on_snapshot_page(page("w0", "e1", 39, [(1, None, "GPU")]))
    assert index.export_state().blocks == {"w0": {"GPU": frozenset({1, 5})}}


def test_hole_after_snapshot_starts_another_resync() -> None:
    ing, _, _ = make()
    ing.on_event_message(headers("w0", "e1", 1), batch(store([1])))
    ing.on_event_message(headers("w0", "e1", 3), batch(store([3])))
    ing.on_event_message(headers("w0", "e1", 9), batch(store([9])))
    acts = ing.on_snapshot_page(page("w0", "e1", 3, []))
    assert [type(a) for a in acts] == [RequestSnapshot]
    assert "hole after snapshot" in acts[0].reason
    acts = ing.on_snapshot_page(page("w0", "e1", 8, [(1, None, "GPU")]))
    assert acts == [] and ing.live_workers() == ("w0",)


def test_snapshot_from_a_newer_epoch_drops_the_buffer() -> None:
    ing, index, _ = make()
    ing.on_event_message(headers("w0", "e1", 1), batch(store([1])))
    ing.on_event_message(headers("w0", "e1", 3), batch(store([3])))
    ing.on_snapshot_page(page("w0", "e2", 0, [(42, None, "GPU")]))
    assert index.export_state().blocks == {"w0": {"GPU": frozenset({42})}}
    ing.on_event_message(headers("w0", "e1", 4), batch(store([4])))  # old epoch: stale
    ing.on_event_message(headers("w0", "e2", 1), batch(store([43], parent=42)))
    assert index.export_state().blocks == {"w0": {"GPU": frozenset({42, 43})}}
    assert ing.stats().stream["stale_epoch"] == 2


def test_failed_snapshot_is_retried_from_tick() -> None:
    ing, _, clock = make()
    ing.on_status(status(last_seq=5, interval_s=100.0))
    assert ing.on_snapshot_failed("w0", "timeout") == []
    assert ing.tick() == []
    clock.now += 1.5
    acts = ing.tick()
    assert acts == [RequestSnapshot("w0", 0, 2, "retrying snapshot")]
    clock.now += 11  # no answer at all: re-asked after snapshot_timeout_s
    assert [type(a) for a in ing.tick()] == [RequestSnapshot]
    assert ing.stats().stream["snapshot_failures"] == 2


def test_silent_worker_is_declared_dead_and_purged() -> None:
    ing, index, clock = make()
    ing.on_status(status(interval_s=1.0))
    ing.on_event_message(headers("w0", "e1", 1), batch(store([1])))
    clock.now += 2.5
    assert ing.tick() == []
    clock.now += 1.0
    acts = ing.tick()
    assert acts == [WorkerDead("w0", 3.5)]
    assert index.stats().entries == 0 and ing.live_workers() == ()
    # Heard again with the same epoch: its cache is unknown now, so resync.
    acts = ing.on_status(status(last_seq=1))
    assert [type(a) for a in acts] == [WorkerAlive, RequestSnapshot]
    assert ing.stats().stream["deaths"] == 1


def test_heartbeat_reveals_lost_trailing_batches() -> None:
    ing, _, clock = make()
    ing.on_status(status(last_seq=0, interval_s=1.0))
    ing.on_event_message(headers("w0", "e1", 1), batch(store([1])))
    assert ing.on_status(status(last_seq=2)) == []  # batch 2 may still be in flight
    clock.now += 0.5
    ing.on_event_message(headers("w0", "e1", 2), batch(store([2], parent=1)))
    assert ing.on_status(status(last_seq=3)) == []
    clock.now += 1.1  # batch 3 never comes
    acts = ing.on_status(status(last_seq=3))
    assert [type(a) for a in acts] == [RequestSnapshot]
    assert acts[0].reason == "tail gap: worker reported seq 3, applied 2"


def test_status_with_new_epoch_and_nothing_published_just_purges() -> None:
    ing, index, _ = make()
    ing.on_event_message(headers("w0", "e1", 1), batch(store([1])))
    acts = ing.on_status(status(epoch="e2", last_seq=0))
    assert [type(a) for a in acts] == [WorkerPurgedNotice]
    assert index.stats().entries == 0 and ing.live_workers() == ("w0",)
    ing.on_event_message(headers("w0", "e2", 1), batch(store([2])))
    assert index.has_block("w0", 2)


def test_malformed_messages_change_nothing_and_are_counted() -> None:
    ing, index, _ = make()
    ing.on_event_message(None, batch(store([1])))
    ing.on_event_message({"Kvhint-Worker": "w0"}, batch(store([1])))
    ing.on_status_message(b"{not json")
    assert ing.stats().malformed_messages == 3
    ing = KvEventIngestor(index, Clock(), subjects=s.Subjects("kvhint"))
    ing.on_event_message(headers("w0", "e1", 1), batch(store([1])),
                         subject="kvhint.v1.events.w1")
    assert index.stats().entries == 0
    assert ing.stats().subject_mismatches == 1


def test_undecodable_batch_in_sequence_forces_resync() -> None:
    ing, index, _ = make()
    ing.on_event_message(headers("w0", "e1", 1), batch(store([1])))
    acts = ing.on_event_message(headers("w0", "e1", 2), b"\x93garbage")
    assert [type(a) for a in acts] == [RequestSnapshot]
    assert acts[0].reason == "undecodable event batch"
    assert ing.stats().adapter["decode_errors"] == 1
    assert index.has_block("w0", 1)


def test_adapter_counts_other_groups_and_unknown_media() -> None:
    ing, index, _ = make()
    ing.on_event_message(headers("w0", "e1", 1), batch(
        store([1], group=1), store([2], medium=None), store([3], medium="nvme"),
        s.BlockStored(block_hashes=[b"\x00" * 24 + (7).to_bytes(8, "big")],
                      parent_block_hash=None, token_ids=[], block_size=32, lora_id=None,
                      medium="CPU", lora_name=None)))
    assert index.export_state().blocks == {
        "w0": {"GPU": frozenset({2}), "OTHER": frozenset({3}), "CPU": frozenset({7})}}
    adapter = ing.stats().adapter
    assert adapter["other_group_events"] == 1 and adapter["unknown_medium_events"] == 1


def test_unrequested_snapshot_pages_are_ignored() -> None:
    ing, index, _ = make()
    assert ing.on_snapshot_page(page("ghost", "e1", 1, [(1, None, "GPU")])) == []
    ing.on_event_message(headers("w0", "e1", 1), batch(store([1])))
    assert ing.on_snapshot_page(page("w0", "e1", 1, [(5, None, "GPU")])) == []
    assert not index.has_block("w0", 5)
    assert ing.stats().unknown_worker_pages == 1
    assert ing.stats().stream["snapshot_pages_ignored"] == 1
    # A late reply to an earlier request (cursor 0) while cursor 2 is awaited.
    ing.on_event_message(headers("w0", "e1", 5), batch(store([5])))
    ing.on_snapshot_page(page("w0", "e1", 4, [(1, None, "GPU")], cursor_next=2), cursor=0)
    assert ing.on_snapshot_page(page("w0", "e1", 4, [(9, None, "GPU")]), cursor=0) == []
    assert ing.stats().stream["snapshot_pages_ignored"] == 2
    ing.on_snapshot_page(page("w0", "e1", 4, [(2, 1, "GPU")]), cursor=2)
    assert index.export_state().blocks == {"w0": {"GPU": frozenset({1, 2, 5})}}


def test_unknown_event_types_are_counted_and_the_rest_applied() -> None:
    import msgspec

    ing, index, _ = make()
    known = msgspec.to_builtins(store([1, 2]))
    payload = msgspec.msgpack.encode([1.0, [known, {"type": "BlockPinned", "x": 1}], None])
    ing.on_event_message(headers("w0", "e1", 1), payload)
    assert index.export_state().blocks == {"w0": {"GPU": frozenset({1, 2})}}
    assert ing.stats().adapter["unknown_events"] == 1
