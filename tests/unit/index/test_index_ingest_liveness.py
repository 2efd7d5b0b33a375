"""The ingestor's liveness and epoch bookkeeping: replayed batches (older than the liveness
window: the events stream's history at a router's start) are applied but prove nothing
about the worker; a resync that ends on a newer engine's snapshot is an engine restart like
any other; batches dropped because their worker is gone are counted as such."""

from __future__ import annotations

from ingest_fixtures import batch, headers, page, status, store, make_paging_ingestor as make

from kvhint.router.kv_index import (
    RequestSnapshot,
    WorkerAlive,
    WorkerDead,
    WorkerPurgedNotice,
)

# Default heartbeat interval 2 s, 3 misses: a 6 s liveness window.
OLD = 3_600.0  # a batch published an hour ago: a replay


def test_a_dead_workers_replayed_history_does_not_make_it_alive() -> None:
    ing, index, clock = make()
    for seq in range(1, 4):
        # The replay is applied (a live worker's heartbeat may yet come) ...
        acts = ing.on_event_message(headers("w0", "e1", seq), batch(store([seq])), age_s=OLD)
        assert acts == []  # ... but no WorkerAlive: before, the first one said alive
        clock.now += 1.0
    assert index.worker_block_counts("w0") == {"GPU": 3}
    assert not ing.view_exact("w0") and ing.worker_views()["w0"].last_heard is None
    # Dead one window after the first replayed batch, not after the last one.
    clock.now += 2.5
    assert ing.tick() == []
    clock.now += 1.0
    assert ing.tick() == [WorkerDead("w0", 6.5)]
    assert index.stats().entries == 0
    # The rest of the replay keeps it dead and out of the index (counted) ...
    acts = ing.on_event_message(headers("w0", "e1", 4), batch(store([4])), age_s=OLD)
    assert acts == [] and index.stats().entries == 0
    assert ing.stats().stream["dead_worker_dropped"] == 1
    assert ing.worker_views()["w0"].phase == "dead"
    # ... and it is remembered (its epoch, to refuse older engines) until forgotten.
    clock.now += 10.0
    ing.tick()
    assert "w0" in ing.worker_views()


def test_a_live_workers_heartbeat_during_its_replay_keeps_what_was_replayed() -> None:
    ing, index, clock = make()
    ing.on_event_message(headers("w0", "e1", 1), batch(store([1])), age_s=OLD)
    clock.now += 1.0
    acts = ing.on_status(status(last_seq=4, interval_s=2.0))
    assert acts == [WorkerAlive("w0", "e1")]  # alive: a heartbeat is heard live
    # The replay takes longer than the tail-gap grace (one interval, 2 s) but progresses:
    # no resync (before, the rest of the replay was buffered, then thrown away).
    for seq in (2, 3):
        clock.now += 1.5
        ing.on_event_message(headers("w0", "e1", seq), batch(store([seq], parent=seq - 1)),
                             age_s=OLD)
    clock.now += 0.5  # 3.5 s behind seq 4, 0.5 s after the replay's last progress
    assert ing.tick() == []
    assert ing.on_status(status(last_seq=4, interval_s=2.0)) == []
    clock.now += 1.0
    ing.on_event_message(headers("w0", "e1", 4), batch(store([4], parent=3)), age_s=10.0)
    assert index.worker_block_counts("w0") == {"GPU": 4} and ing.view_exact("w0")
    assert ing.stats().stream["resyncs_started"] == 0
    # Replayed batches never refreshed liveness; the heartbeats and a live batch did.
    clock.now += 5.0
    ing.on_event_message(headers("w0", "e1", 5), batch(store([5], parent=4)), age_s=0.2)
    clock.now += 5.0
    assert ing.tick() == []
    clock.now += 1.5
    assert [type(a) for a in ing.tick()] == [WorkerDead]


def test_a_stalled_replay_still_reveals_a_tail_gap() -> None:
    ing, _, clock = make()
    ing.on_status(status(last_seq=0, interval_s=1.0))
    ing.on_event_message(headers("w0", "e1", 1), batch(store([1])), age_s=OLD)
    ing.on_status(status(last_seq=3, interval_s=1.0))
    clock.now += 0.9
    ing.on_event_message(headers("w0", "e1", 2), batch(store([2], parent=1)), age_s=OLD)
    clock.now += 0.9
    assert ing.tick() == []  # progressed 0.9 s ago
    clock.now += 0.2
    acts = ing.tick()
    assert [type(a) for a in acts] == [RequestSnapshot]
    assert acts[0].reason == "tail gap: worker reported seq 3, applied 2"


def test_a_resync_ending_on_a_newer_engines_snapshot_is_an_engine_restart() -> None:
    ing, index, _ = make()
    ing.on_status(status(last_seq=0))
    ing.on_event_message(headers("w0", "e1", 1), batch(store([1], session="t/s")))
    ing.on_event_message(headers("w0", "e1", 3), batch(store([3])))  # gap: resync
    acts = ing.on_snapshot_page(page("w0", "e2", 1, [(42, None, "GPU")],
                                     sessions=[("t/new", [42])]))
    # As a live batch of the new epoch would: counted, and the purge noticed (before,
    # neither: the old engine's end went unseen by the owner and the metrics).
    reason = "engine restarted (epoch e1 -> e2)"
    assert acts == [WorkerPurgedNotice("w0", reason)]
    stream = ing.stats().stream
    assert stream["epoch_changes"] == 1 and stream["stale_epoch"] == 1
    # The purge came before the snapshot: what the snapshot holds stays.
    assert index.export_state().blocks == {"w0": {"GPU": frozenset({42})}}
    assert index.session_placements("t/s") == ()
    assert [p.worker_id for p in index.session_placements("t/new")] == ["w0"]
    assert index.stats().purged_workers == 1 and ing.live_workers() == ("w0",)


def test_a_newer_engines_snapshot_with_a_hole_after_it_purges_then_resyncs_again() -> None:
    ing, index, _ = make()
    ing.on_event_message(headers("w0", "e1", 1), batch(store([1])))
    ing.on_event_message(headers("w0", "e1", 3), batch(store([3])))
    acts = ing.on_snapshot_page(page("w0", "e2", 2, [(42, None, "GPU")]))
    assert [type(a) for a in acts] == [WorkerPurgedNotice]  # nothing of e2 buffered
    ing.on_event_message(headers("w0", "e2", 5), batch(store([5])))  # e2's 3-4 lost
    assert [type(a) for a in ing.on_event_message(headers("w0", "e2", 6), batch(
        store([6])))] == []
    assert ing.stats().stream["epoch_changes"] == 1
    assert index.has_block("w0", 42)


def test_a_dead_workers_buffered_batches_are_counted_as_gone_not_stale() -> None:
    ing, _, clock = make()
    ing.on_status(status(last_seq=0, interval_s=1.0))
    ing.on_event_message(headers("w0", "e1", 1), batch(store([1])))
    for seq in (3, 4, 5):  # a gap: resyncing, these wait in the buffer
        ing.on_event_message(headers("w0", "e1", seq), batch(store([seq])))
    clock.now += 4.0
    assert [type(a) for a in ing.tick()] == [WorkerDead]
    stream = ing.stats().stream
    # Before, these 3 were counted as stale_epoch: their epoch was the worker's current.
    assert stream["dead_worker_dropped"] == 3 and stream["stale_epoch"] == 0
    # A worker removed from the configuration while resyncing: the same.
    ing.on_status(status(worker="w1", last_seq=0))
    ing.on_event_message(headers("w1", "e1", 1), batch(store([1])))
    ing.on_event_message(headers("w1", "e1", 3), batch(store([3])))
    ing.forget_worker("w1")
    stream = ing.stats().stream
    assert stream["dead_worker_dropped"] == 4 and stream["stale_epoch"] == 0


def test_a_heartbeat_interval_out_of_the_plugins_bounds_is_taken_at_the_bound() -> None:
    """A status's interval_s sets the worker's liveness window (3 misses). Before, any
    positive value was taken: 1e-9 had a live worker dead between two of its beats (a
    purge, then a snapshot, each time), 1e9 kept a dead one's view trusted for good. Now
    it is taken within the bounds a plugin may be configured with (0.1 s .. 300 s),
    counted."""
    ing, index, clock = make()
    ing.on_status(status(interval_s=1e-9))
    ing.on_event_message(headers("w0", "e1", 1), batch(store([1])))
    clock.now += 0.2  # past 3 x 1e-9 s, within 3 x 0.1 s
    assert ing.tick() == [] and index.worker_block_counts("w0") == {"GPU": 1}
    clock.now += 0.2  # past 3 x 0.1 s: dead
    assert [type(a) for a in ing.tick()] == [WorkerDead] and index.stats().entries == 0
    assert ing.stats().stream["status_interval_bounded"] == 1
    ing, index, clock = make()
    ing.on_status(status(interval_s=1e9))
    clock.now += 3 * 300.0 + 1.0
    assert [type(a) for a in ing.tick()] == [WorkerDead]
    assert ing.stats().stream["status_interval_bounded"] == 1
