"""A heartbeat heard while the feed replays the events stream's history waits for its
worker's replayed batches instead of asking for a snapshot.

Before, a worker whose heartbeat came before its first replayed batch "joined
mid-stream": a snapshot (its plugin copies its whole index on vLLM's scheduler thread),
and the replay that followed was buffered, then thrown away as covered. At a router's
start nearly every worker's heartbeat beats its replay: a snapshot from every worker at
once. Now the owner says when the replay runs (``replay_started``) and ends
(``replay_caught_up``, or ``replay_wait_s`` later); a live router (no replay) resyncs at
once, as before."""

from __future__ import annotations

from ingest_fixtures import batch, headers, status, store, make_ingestor as make

from kvhint.router.kv_index import (
    KvEventIngestor,
    RequestSnapshot,
    WorkerAlive,
    WorkerDead,
)
from kvhint.schemas.status import new_epoch

OLD = 3_600.0  # published an hour ago: the stream's history



def replay(ing: KvEventIngestor, worker: str, epoch: str, seqs: range,
           age_s: float = OLD) -> list[object]:
    """``worker``'s batches ``seqs`` (block ``seq`` chained on ``seq - 1``) as replayed."""
    actions: list[object] = []
    for seq in seqs:
        actions += ing.on_event_message(
            headers(worker, epoch, seq),
            batch(store([seq], parent=seq - 1 if seq > 1 else None)), age_s=age_s)
    return actions


def snapshots(actions: list[object]) -> list[RequestSnapshot]:
    return [a for a in actions if isinstance(a, RequestSnapshot)]


def test_a_heartbeat_before_its_replay_from_seq_1_takes_no_snapshot() -> None:
    ing, index, clock = make()
    ing.replay_started()
    acts = ing.on_status(status(last_seq=5, interval_s=1.0))
    # Alive (a heartbeat proves it) but waiting: no snapshot, no view yet.
    assert acts == [WorkerAlive("w0", "e1")]
    view = ing.worker_views()["w0"]
    assert view.phase == "awaiting_replay" and not ing.view_exact("w0")
    assert ing.live_workers() == ()
    clock.now += 0.5
    assert ing.tick() == []
    acts = replay(ing, "w0", "e1", range(1, 6))
    assert acts == [] and ing.worker_views()["w0"].phase == "live"
    assert ing.replay_caught_up() == []
    # The view is the stream's: what an ingestor fed the batches alone holds.
    reference, ref_index, _ = make()
    replay(reference, "w0", "e1", range(1, 6))
    assert index.export_state().blocks == ref_index.export_state().blocks
    assert index.worker_block_counts("w0") == {"GPU": 5} and ing.view_exact("w0")
    stream = ing.stats().stream
    assert stream["resyncs_started"] == 0 and stream["covered_by_snapshot"] == 0
    assert stream["resyncs_deferred"] == 1 and stream["resyncs_avoided"] == 1


def test_a_sparse_replay_reveals_no_tail_gap_until_it_is_over() -> None:
    """A worker's batches far apart in the history (an idle spell) with other workers'
    between them: the replay takes longer than the tail-gap grace between two of its
    batches. Before, a tail-gap resync (and a snapshot) came all the same."""
    ing, index, clock = make()
    ing.replay_started()
    ing.on_status(status(last_seq=3, interval_s=1.0))
    replay(ing, "w0", "e1", range(1, 2))
    for _ in range(5):  # 5 s of other workers' history
        clock.now += 1.0
        replay(ing, "w1", "e1", range(1, 2))
        assert snapshots(ing.tick()) == []
        assert snapshots(ing.on_status(status(last_seq=3, interval_s=1.0))) == []
    replay(ing, "w0", "e1", range(2, 4))
    assert ing.replay_caught_up() == []
    assert index.worker_block_counts("w0") == {"GPU": 3}
    assert ing.stats().stream["resyncs_started"] == 0


def test_a_tail_the_replay_did_not_bring_is_a_gap_one_grace_after_it() -> None:
    ing, _, clock = make()
    ing.replay_started()
    ing.on_status(status(last_seq=4, interval_s=1.0))
    replay(ing, "w0", "e1", range(1, 3))  # seq 3 and 4 never published (lost)
    for _ in range(5):  # not judged while the replay runs
        clock.now += 1.0
        assert ing.on_status(status(last_seq=4, interval_s=1.0)) == []
        assert ing.tick() == []
    assert ing.replay_caught_up() == []
    clock.now += 0.9
    assert ing.tick() == []  # the grace (one interval) runs from the replay's end
    clock.now += 0.2
    (request,) = snapshots(ing.tick())
    assert request.reason == "tail gap: worker reported seq 4, applied 2"


def test_a_waiting_worker_the_replay_does_not_reach_resyncs_at_its_end() -> None:
    ing, index, clock = make()
    ing.replay_started()
    ing.on_status(status(last_seq=7, interval_s=1.0))
    for _ in range(3):  # others' history; its own was trimmed
        clock.now += 0.5
        replay(ing, "w1", "e1", range(1, 2))
        assert ing.tick() == []
    (request,) = snapshots(ing.replay_caught_up())
    assert request.worker_id == "w0" and request.cursor == 0
    assert request.reason == ("joined mid-stream (worker at seq 7): the replay held none "
                              "of its batches")
    assert ing.worker_views()["w0"].phase == "resyncing"
    assert ing.replay_caught_up() == []  # once
    stream = ing.stats().stream
    assert stream["resyncs_deferred"] == 1 and stream["resyncs_avoided"] == 0
    assert stream["resyncs_started"] == 1 and index.worker_block_counts("w0") == {}


def test_a_replay_starting_mid_epoch_resyncs_as_before() -> None:
    """The stream's history no longer reaches back to seq 1: the snapshot is needed."""
    ing, _, _ = make()
    ing.replay_started()
    ing.on_status(status(last_seq=9, interval_s=1.0))
    (request,) = snapshots(replay(ing, "w0", "e1", range(4, 5)))
    assert request.reason == "joined mid-stream at seq 4"
    replay(ing, "w0", "e1", range(5, 10))  # buffered until the snapshot is in
    assert ing.replay_caught_up() == []
    stream = ing.stats().stream
    assert stream["resyncs_started"] == 1 and stream["buffered"] == 6
    assert stream["resyncs_avoided"] == 0


def test_an_older_engines_history_is_passed_over_while_waiting() -> None:
    """The history holds the worker's previous engine, then its current one from seq 1."""
    old, new = new_epoch(1_000.0), new_epoch(2_000.0)
    ing, index, _ = make()
    ing.replay_started()
    ing.on_status(status(epoch=new, last_seq=2, interval_s=1.0))
    replay(ing, "w0", old, range(1, 4))
    assert ing.worker_views()["w0"].phase == "awaiting_replay"
    assert snapshots(replay(ing, "w0", new, range(1, 3))) == []
    assert index.worker_block_counts("w0") == {"GPU": 2}
    stream = ing.stats().stream
    assert stream["stale_epoch"] == 3 and stream["resyncs_started"] == 0


def test_a_replay_that_never_ends_is_given_up_after_replay_wait_s() -> None:
    ing, _, clock = make(replay_wait_s=20.0)
    ing.replay_started()
    for _ in range(20):  # heartbeating all along: alive, waiting
        ing.on_status(status(last_seq=3, interval_s=1.0))
        assert snapshots(ing.tick()) == []
        clock.now += 1.0
    clock.now += 0.5
    ing.on_status(status(last_seq=3, interval_s=1.0))
    (request,) = snapshots(ing.tick())
    assert request.reason == ("joined mid-stream (worker at seq 3): the replay was not "
                              "over after 20s")
    assert not ing.replaying and ing.stats().stream["replay_waits_expired"] == 1
    # Taken as over: a worker heard from now on resyncs at once.
    assert len(snapshots(ing.on_status(status("w1", last_seq=2, interval_s=1.0)))) == 1


def test_a_waiting_worker_that_falls_silent_dies_as_before() -> None:
    ing, index, clock = make()
    ing.replay_started()
    ing.on_status(status(last_seq=3, interval_s=1.0))  # liveness window: 3 s
    clock.now += 3.5
    assert ing.tick() == [WorkerDead("w0", 3.5)]
    # Dead, not waiting: the replay's end asks it for nothing.
    assert ing.replay_caught_up() == []
    assert ing.worker_views()["w0"].phase == "dead" and index.stats().entries == 0


def test_without_a_replay_a_heartbeat_resyncs_at_once_as_before() -> None:
    ing, _, _ = make()
    assert not ing.replaying
    acts = ing.on_status(status(last_seq=5, interval_s=1.0))
    assert acts[0] == WorkerAlive("w0", "e1")
    (request,) = snapshots(acts)
    assert request.reason == "joined mid-stream (worker at seq 5)"
    # Nor once a replay is over.
    ing.replay_started()
    assert ing.replay_caught_up() == []
    assert len(snapshots(ing.on_status(status("w1", last_seq=2, interval_s=1.0)))) == 1
    assert ing.stats().stream["resyncs_deferred"] == 0
