"""The ingestor's stream rules: ordering, duplicates, gaps, epochs, resync through paged
snapshots, dead workers, tail gaps; and that every dropped message is counted."""

from __future__ import annotations

from ingest_fixtures import Clock, batch, headers, page, remove, status, store
from ingest_fixtures import make_paging_ingestor as make

from kvhint import schemas as s
from kvhint.router.kv_index import (
    KvEventIngestor,
    RequestSnapshot,
    StreamConfig,
    WorkerAlive,
    WorkerDead,
    WorkerOverlap,
    WorkerPurgedNotice,
)
from kvhint.schemas.events import HEADER_EPOCH, HEADER_SEQ



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
    assert acts == [RequestSnapshot("w0", 2, 2, "snapshot continues", seq=4)]
    acts = ing.on_snapshot_page(page("w0", "e1", 4, [(8, 7, "GPU"), (9, 8, "CPU")],
                                     sessions=[("t/s", [9])]))
    assert acts == []
    # The snapshot is of seq 4; batches 5 and 6 replayed on top.
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


def test_a_page_of_another_snapshot_restarts_the_paging() -> None:
    """A snapshot's cursors hold only within it: a page of a snapshot taken at another
    seq (a late reply to an earlier request, a snapshot the worker took again meanwhile)
    starts the paging over. Before, pages of two snapshots were joined at the lower seq,
    blocks between their cursors lost, and the stream reported live."""
    ing, index, _ = make()
    ing.on_event_message(headers("w0", "e1", 1), batch(store([1])))
    ing.on_event_message(headers("w0", "e1", 3), batch(store([3], parent=2)))
    ing.on_snapshot_page(page("w0", "e1", 3, [(1, None, "GPU"), (2, 1, "GPU")],
                              cursor_next=2))
    acts = ing.on_snapshot_page(page("w0", "e1", 4, [(4, 3, "GPU")]), cursor=2)
    assert acts == [RequestSnapshot("w0", 0, 2, "another snapshot's page; restarting")]
    assert ing.worker_views()["w0"].phase == "resyncing"
    ing.on_snapshot_page(page("w0", "e1", 3, [(1, None, "GPU"), (2, 1, "GPU")],
                              cursor_next=2))
    ing.on_snapshot_page(page("w0", "e1", 3, [(3, 2, "GPU")]), cursor=2)
    assert index.export_state().blocks == {"w0": {"GPU": frozenset({1, 2, 3})}}
    assert ing.live_workers() == ("w0",)


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


def test_a_worker_dead_past_the_forget_time_is_forgotten_and_its_counts_kept() -> None:
    """Worker ids come and go (pods): a stream dead longer than forget_dead_after_s is
    dropped, so the ingestor holds only workers heard lately; its counters stay in the
    totals (they are Prometheus counters), and a worker of that id heard later starts
    afresh. Before, every worker id ever heard stayed for good."""
    ing, index, clock = make()
    ing.on_status(status(interval_s=1.0))
    ing.on_event_message(headers("w0", "e1", 1), batch(store([1])))
    clock.now += 4.0
    assert [type(a) for a in ing.tick()] == [WorkerDead]
    clock.now += ing.config.forget_dead_after_s / 2
    ing.tick()
    assert "w0" in ing.worker_views()
    batches = ing.stats().stream["batches_applied"]
    clock.now += ing.config.forget_dead_after_s
    assert ing.tick() == []
    assert ing.worker_views() == {}
    assert ing.stats().stream["batches_applied"] == batches == 1
    assert ing.stats().stream["deaths"] == 1
    ing.on_status(status(epoch="e2"))
    assert ing.worker_views()["w0"].epoch == "e2"


def test_a_longer_memory_of_dead_workers_applies_to_streams_already_open() -> None:
    """The router follows the events stream's max_age once it has seen the stream (it
    may keep messages longer than the settings say): a worker already dead then is kept
    that long too, so its replayed batches are never taken for a new engine's."""
    ing, _index, clock = make()
    ing.on_status(status(interval_s=1.0))
    clock.now += 4.0
    assert [type(a) for a in ing.tick()] == [WorkerDead]
    forget_s = ing.config.forget_dead_after_s
    ing.remember_dead_for(forget_s * 3)
    clock.now += forget_s * 2
    ing.tick()
    assert "w0" in ing.worker_views()
    clock.now += forget_s
    ing.tick()
    assert ing.worker_views() == {}


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
    # A heartbeat too speaks only for the worker of its subject.
    assert ing.on_status_message(s.encode_status(status("w0")),
                                 subject="kvhint.v1.status.w1") == []
    assert ing.stats().subject_mismatches == 2 and ing.live_workers() == ()
    ing.on_status_message(s.encode_status(status("w0")), subject="kvhint.v1.status.w0")
    assert ing.live_workers() == ("w0",)


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


# Ordered epochs, as plugins name them (schemas.new_epoch): OLD's engine started first.
OLD, CUR = s.new_epoch(1_000.0), s.new_epoch(2_000.0)


def test_an_older_engines_replayed_batches_after_the_current_heartbeat_are_stale() -> None:
    """A router starting up hears the current engine's heartbeat, then JetStream replays
    the events history, which begins with an earlier engine's batches. They are stale,
    not a restart: before, the old epoch replaced the current one, whose every later
    message was then dropped as stale, and the worker was declared dead for good."""
    ing, index, clock = make()
    acts = ing.on_status(status(epoch=CUR, last_seq=2))
    assert [type(a) for a in acts] == [WorkerAlive, RequestSnapshot]
    for seq in (1, 2):
        assert ing.on_event_message(headers("w0", OLD, seq), batch(store([seq]))) == []
    for seq, block in ((1, 11), (2, 12)):
        ing.on_event_message(headers("w0", CUR, seq), batch(store([block])))
    ing.on_snapshot_page(page("w0", CUR, 0, []), cursor=0)
    assert index.export_state().blocks == {"w0": {"GPU": frozenset({11, 12})}}
    stream = ing.stats().stream
    assert stream["stale_epoch"] == 2 and stream["epoch_changes"] == 0
    clock.now += 1.0
    ing.on_status(status(epoch=CUR, last_seq=2))
    assert ing.tick() == [] and ing.live_workers() == ("w0",)


def test_an_older_engines_batches_first_then_the_current_one_restarts_the_stream() -> None:
    ing, index, _ = make()
    ing.on_event_message(headers("w0", OLD, 1), batch(store([1])))
    acts = ing.on_event_message(headers("w0", CUR, 1), batch(store([11])))
    assert [type(a) for a in acts] == [WorkerPurgedNotice]
    assert index.export_state().blocks == {"w0": {"GPU": frozenset({11})}}


def test_a_late_snapshot_reply_from_an_engine_we_moved_past_is_ignored() -> None:
    """A gap asks the engine for a snapshot; the engine restarts before the reply comes.
    The late reply (the old engine's blocks) is ignored: before, it brought the stream
    back to the old epoch and retired the current one."""
    ing, index, _ = make()
    ing.on_event_message(headers("w0", OLD, 1), batch(store([1])))
    assert [type(a) for a in ing.on_event_message(headers("w0", OLD, 3), batch(store([3])))] \
        == [RequestSnapshot]
    # The restarted engine's heartbeat: it has published, so a new resync (cursor 0).
    assert [type(a) for a in ing.on_status(status(epoch=CUR, last_seq=1))] == \
        [WorkerPurgedNotice, RequestSnapshot]
    assert ing.on_snapshot_page(page("w0", OLD, 3, [(1, None, "GPU")]), cursor=0) == []
    ing.on_snapshot_page(page("w0", CUR, 1, [(11, None, "GPU")]), cursor=0)
    ing.on_event_message(headers("w0", CUR, 2), batch(store([12], parent=11)))
    assert index.export_state().blocks == {"w0": {"GPU": frozenset({11, 12})}}
    assert ing.live_workers() == ("w0",)


def test_a_stale_message_to_a_dead_worker_does_not_bring_it_back() -> None:
    """A replayed batch of an older engine does not; a heartbeat of one does (see
    test_an_engine_started_after_a_clock_step_back_...): heartbeats are not replayed,
    so one says its engine runs now."""
    ing, _, clock = make()
    ing.on_status(status(epoch=CUR, interval_s=1.0))
    clock.now += 5
    assert [type(a) for a in ing.tick()] == [WorkerDead]
    assert ing.on_event_message(headers("w0", OLD, 1), batch(store([1]))) == []
    assert ing.live_workers() == ()


def test_epochs_order_by_the_engine_start_and_others_have_none() -> None:
    assert s.epoch_is_older(OLD, CUR) and not s.epoch_is_older(CUR, OLD)
    assert s.epoch_started_ms(OLD) == 1_000_000
    assert not s.epoch_is_older("e1", CUR) and not s.epoch_is_older(OLD, "0123456789abcdef")


def test_a_run_mixing_int_and_byte_hashes_reaches_the_index_as_ints() -> None:
    """Publishers send all ints or all bytes; a mixed run was passed on as it came when
    its first hash was an int, leaving a bytes key no later removal matched."""
    ing, index, _ = make()
    five = (5).to_bytes(32, "big")
    ing.on_event_message(headers("w0", "e1", 1), batch(store([1, five])))  # type: ignore[list-item]
    assert index.has_block("w0", 5)
    ing.on_event_message(headers("w0", "e1", 2), batch(s.BlockRemoved(
        block_hashes=[1, five], medium="GPU", group_idx=0)))  # type: ignore[list-item]
    assert index.stats().entries == 0


def test_a_residency_event_that_cannot_be_read_resyncs_its_worker() -> None:
    """A BlockRemoved whose hash is a float: skipping it, as an unknown event type is,
    would leave blocks 1-2 indexed for good (a false hit at every routing). Before, it
    was counted as an unknown type and the rest applied; now the batch is undecodable
    and the worker resyncs from a snapshot."""
    import msgspec

    ing, index, _ = make()
    ing.on_event_message(headers("w0", "e1", 1), batch(store([1, 2])))
    bad = msgspec.msgpack.encode([2.0, [
        {"type": "BlockRemoved", "block_hashes": [1.5], "medium": "GPU"}], None])
    actions = ing.on_event_message(headers("w0", "e1", 2), bad)
    assert actions == [RequestSnapshot("w0", 0, 2, "undecodable event batch")]
    assert ing.stats().adapter["unknown_events"] == 0
    assert ing.stats().adapter["decode_errors"] == 1
    assert ing.on_snapshot_page(page("w0", "e1", 2, [(2, None, "GPU")])) == []
    assert index.export_state().blocks == {"w0": {"GPU": frozenset({2})}}


def test_an_engine_started_after_a_clock_step_back_is_taken_once_the_old_one_is_dead(
        ) -> None:
    """The host's clock stepped back before the engine restarted: the new epoch's start
    sorts before the current one's. While the current engine may still be alive its
    messages are stale (they could be replayed history); once it is declared dead, the
    new engine is taken. Before, it was dropped as stale until the worker was
    forgotten, an hour later."""
    ing, index, clock = make()
    ing.on_status(status(epoch=CUR, last_seq=0))
    ing.on_event_message(headers("w0", CUR, 1), batch(store([1])))
    stepped_back = s.new_epoch(1_500.0)
    for _ in range(4):  # the restarted engine's heartbeats, 1 s apart
        clock.now += 1.0
        ing.on_status(status(epoch=stepped_back, last_seq=0))
        ing.tick()
    assert ing.live_workers() == ()  # the old engine fell silent: dead, purged
    clock.now += 1.0
    acts = ing.on_status(status(epoch=stepped_back, last_seq=1))
    assert [type(a) for a in acts] == [WorkerAlive, RequestSnapshot]
    ing.on_snapshot_page(page("w0", stepped_back, 1, [(7, None, "GPU")]))
    assert index.export_state().blocks == {"w0": {"GPU": frozenset({7})}}
    assert ing.live_workers() == ("w0",)


def test_a_batch_with_an_empty_epoch_or_seq_0_is_malformed_not_a_restart() -> None:
    ing, index, _ = make()
    ing.on_event_message(headers("w0", "e1", 1), batch(store([1])))
    for bad in ({**headers("w0", "e1", 2), HEADER_EPOCH: ""},
                {**headers("w0", "e1", 2), HEADER_SEQ: "0"}):
        assert ing.on_event_message(bad, batch(store([2]))) == []
    assert ing.stats().malformed_messages == 2
    assert ing.stats().stream["epoch_changes"] == 0
    assert index.export_state().blocks == {"w0": {"GPU": frozenset({1})}}


def test_a_batch_numbered_far_past_the_heartbeat_is_dropped_not_a_gap() -> None:
    """One batch with seq 10^12 (a publisher's bug, a corrupted header): before, it was a
    gap, and every snapshot after it ended in a "hole" before it, so the worker resynced
    forever and never came back live."""
    ing, index, clock = make()
    ing.on_status(status(epoch="e1", last_seq=0))
    ing.on_event_message(headers("w0", "e1", 1), batch(store([1])))
    clock.now += 1.0
    ing.on_status(status(epoch="e1", last_seq=1))
    assert ing.on_event_message(headers("w0", "e1", 10**12), batch(store([2]))) == []
    ing.on_event_message(headers("w0", "e1", 2), batch(store([3], parent=1)))
    assert ing.stats().stream["implausible_seq"] == 1
    assert ing.stats().stream["resyncs_started"] == 0
    assert index.export_state().blocks == {"w0": {"GPU": frozenset({1, 3})}}
    assert ing.live_workers() == ("w0",)


def test_a_resync_that_never_finishes_drops_the_stale_view_after_a_bound() -> None:
    """A gap, then every snapshot request fails while the worker keeps heartbeating (a
    broken snapshot handler, replies lost). For resync_view_trust_s the view from before
    the gap keeps answering, marked inexact; past it the view is purged once (counted,
    announced) and the resync goes on. Before, the pre-gap view answered routing for as
    long as the snapshots failed, with nothing to say it was stale."""
    ing, index, clock = make()
    ing.on_status(status(interval_s=1.0))
    ing.on_event_message(headers("w0", "e1", 1), batch(store([1, 2])))
    assert ing.view_exact("w0")
    acts = ing.on_event_message(headers("w0", "e1", 3), batch(remove(1)))
    assert [type(a) for a in acts] == [RequestSnapshot]
    assert index.match_prefix([1, 2]).of("w0") == WorkerOverlap(2, 0)  # the best estimate
    assert not ing.view_exact("w0")
    purges = []
    for _ in range(40):
        clock.now += 1.0
        ing.on_status(status(last_seq=3, interval_s=1.0))
        for action in ing.tick():
            if isinstance(action, RequestSnapshot):
                ing.on_snapshot_failed("w0", "timeout")
            elif isinstance(action, WorkerPurgedNotice):
                purges.append((clock.now, action))
        if clock.now - 1000.0 <= StreamConfig().resync_view_trust_s:
            assert index.has_block("w0", 1), clock.now
    assert [(at, a.reason.split(":")[0]) for at, a in purges] == [
        (1031.0, "resync stalled for 31.0s (sequence gap")]
    assert index.match_prefix([1, 2]).of("w0") == WorkerOverlap(0, 0)
    assert ing.stats().stream["stalled_resync_purges"] == 1
    assert not ing.view_exact("w0")
    # The snapshot finally answers: the view is the worker's again, and exact.
    ing.on_snapshot_page(page("w0", "e1", 3, [(2, None, "GPU")]), 0)
    assert index.match_prefix([2]).of("w0") == WorkerOverlap(1, 0)
    assert ing.view_exact("w0") and ing.live_workers() == ("w0",)


def test_a_view_is_exact_only_while_its_stream_is_live_and_heard() -> None:
    """Exact: LIVE and heard within exact_heartbeat_misses intervals. A worker never
    heard, one joining mid-stream (resyncing) or silent past one and a half heartbeats
    is not; a silent one is purged at heartbeat_misses, so its stale view never answers
    longer than that."""
    ing, index, clock = make()
    assert not ing.view_exact("w0")
    ing.on_status(status(interval_s=2.0))
    ing.on_event_message(headers("w0", "e1", 1), batch(store([1])))
    assert ing.view_exact("w0")
    clock.now += 3.0
    assert ing.view_exact("w0")
    clock.now += 0.5  # 3.5 s > 1.5 x 2 s: a heartbeat missed
    assert not ing.view_exact("w0") and index.has_block("w0", 1)
    clock.now += 3.0  # 6.5 s > 3 x 2 s: dead, purged
    assert [type(a) for a in ing.tick()] == [WorkerDead]
    assert not index.has_block("w0", 1) and not ing.view_exact("w0")
    ing.on_status(status(worker="w1", last_seq=4))  # joined mid-stream: resyncing
    assert not ing.view_exact("w1")
