"""Two engines heartbeating under one worker id (the plugin's default ``w<rank>`` on two
single-rank servers, or one id configured twice): the ingestor finds it once, names both
engines, and sticks to the one it follows; a worker's own restart is still taken at once
(router/kv_index/stream_sources.py).

Before, nothing said so, and each restart of either server swapped the engine the index
followed (a purge and a snapshot each time); once the engine followed left for good, the
other's heartbeats (a retired epoch) stayed refused, the worker dead, until forgotten."""

from __future__ import annotations

import msgspec
from ingest_fixtures import Clock, batch, headers, page, status, store
from ingest_fixtures import make_paging_ingestor as make

from kvhint import schemas as s
from kvhint.router.kv_index import (
    KvEventIngestor,
    RequestSnapshot,
    WorkerAlive,
    WorkerDead,
    WorkerIdConflict,
    WorkerPurgedNotice,
)

URL_A, URL_B = "http://server-a:8000", "http://server-b:8000"
# Engine starts (ms order): A's first engine, B's, then each one's restart.
A1, B1, A2, B2 = (s.new_epoch(t) for t in (1_000.0, 2_000.0, 3_000.0, 4_000.0))


def beat(epoch: str, url: str, last_seq: int = 0) -> s.WorkerStatus:
    return msgspec.structs.replace(status(epoch=epoch, last_seq=last_seq, interval_s=1.0),
                                   http_url=url)


def both_beat(ing: KvEventIngestor, clock: Clock, followed: tuple[str, str],
              other: tuple[str, str], rounds: int) -> list[object]:
    """``rounds`` heartbeat intervals of both servers; the actions they caused."""
    actions: list[object] = []
    for _ in range(rounds):
        clock.now += 0.5
        actions += ing.on_status(beat(*followed))
        clock.now += 0.5
        actions += ing.on_status(beat(*other))
        actions += ing.tick()
    return actions


def conflicted(**config: float) -> tuple[KvEventIngestor, Clock]:
    """A (A1) heard first, then B (B1) starts: taken as A's restart (one purge, the
    only one); A's next beats are refused, and the second, after B spoke again, finds
    the conflict."""
    ing, _, clock = make(**config)
    ing.on_status(beat(A1, URL_A))
    clock.now += 0.5
    assert [type(a) for a in ing.on_status(beat(B1, URL_B))] == [WorkerPurgedNotice]
    return ing, clock


def test_two_engines_under_one_id_are_found_once_naming_both() -> None:
    ing, clock = conflicted()
    actions = both_beat(ing, clock, (B1, URL_B), (A1, URL_A), 10)
    assert actions == [WorkerIdConflict("w0", B1, URL_B, A1, URL_A)]  # once, not per beat
    assert ing.conflicting_workers() == ("w0",)
    view = ing.worker_views()["w0"]
    assert view.epoch == B1 and view.conflict is not None
    assert (view.conflict.other_epoch, view.conflict.other_url) == (A1, URL_A)
    assert view.conflict.other_heard_s_ago <= 1.0
    stream = ing.stats().stream
    assert stream["id_conflicts"] == 1 and stream["epoch_changes"] == 1
    assert stream["stale_status"] == 10  # A's beats, counted as before
    assert ing.follows("w0", B1) and not ing.follows("w0", A1)


def test_the_other_servers_restart_does_not_swap_the_engine_followed() -> None:
    """A restarts with an epoch newer than B's: before, taken as w0's restart (purge,
    snapshot), and B's next beats refused; B's restart then swapped back, and so on."""
    ing, clock = conflicted()
    both_beat(ing, clock, (B1, URL_B), (A1, URL_A), 3)
    actions = both_beat(ing, clock, (B1, URL_B), (A2, URL_A), 10)
    for seq in (1, 2):  # A2's events are refused too
        clock.now += 0.1
        actions += ing.on_event_message(headers("w0", A2, seq), batch(store([seq])))
    assert actions == [] and ing.follows("w0", B1)
    stream = ing.stats().stream
    assert stream["epoch_changes"] == 1 and stream["resyncs_started"] == 0
    assert stream["other_source_dropped"] == 12 and stream["id_conflicts"] == 1
    assert ing.worker_views()["w0"].conflict.other_epoch == A2  # type: ignore[union-attr]
    assert ing.index.stats().entries == 0


def test_a_restart_without_a_conflict_is_taken_at_once() -> None:
    """The engine restarts (its old one's last beat arrives late): the new epoch is
    taken at its first message, no conflict is found, and its seq 1 needs no snapshot."""
    ing, index, clock = make()
    ing.on_status(beat(A1, URL_A))
    ing.on_event_message(headers("w0", A1, 1), batch(store([1])))
    clock.now += 1.0
    assert [type(a) for a in ing.on_status(beat(A2, URL_A))] == [WorkerPurgedNotice]
    clock.now += 0.1
    assert ing.on_status(beat(A1, URL_A)) == []  # the old engine's last beat, late
    assert ing.on_event_message(headers("w0", A2, 1), batch(store([7]))) == []
    for _ in range(10):
        clock.now += 1.0
        assert ing.on_status(beat(A2, URL_A, last_seq=1)) == [] and ing.tick() == []
    assert index.export_state().blocks == {"w0": {"GPU": frozenset({7})}}
    assert ing.conflicting_workers() == () and ing.stats().stream["id_conflicts"] == 0
    assert ing.stats().stream["resyncs_started"] == 0


def test_the_followed_engines_restart_is_taken_once_it_is_silent() -> None:
    """While a conflict is held, B's own restart (B2) waits until B1 is declared dead
    (a liveness window at most), then is taken; A stays refused."""
    ing, clock = conflicted()
    both_beat(ing, clock, (B1, URL_B), (A1, URL_A), 3)
    actions: list[object] = []
    for _ in range(5):  # B1 silent; B2 and A beat
        clock.now += 0.5
        actions += ing.on_status(beat(B2, URL_B))
        clock.now += 0.5
        actions += ing.on_status(beat(A1, URL_A))
        actions += ing.tick()
        if ing.follows("w0", B2):
            break
    assert ing.follows("w0", B2), ing.worker_views()["w0"]
    assert [type(a) for a in actions] == [WorkerDead, WorkerAlive]
    assert both_beat(ing, clock, (B2, URL_B), (A1, URL_A), 5) == []  # same conflict
    assert ing.stats().stream["id_conflicts"] == 1 and ing.follows("w0", B2)


def test_the_other_engine_takes_the_id_once_the_followed_one_left() -> None:
    """B is stopped for good: A's heartbeat (a retired epoch) is taken once B is dead.
    Before, it stayed refused and w0 dead until its stream was forgotten, an hour on."""
    ing, clock = conflicted()
    both_beat(ing, clock, (B1, URL_B), (A1, URL_A), 3)
    actions: list[object] = []
    for _ in range(6):
        clock.now += 1.0
        actions += ing.on_status(beat(A1, URL_A))
        actions += ing.tick()
    assert ing.follows("w0", A1) and ing.live_workers() == ("w0",)
    assert [type(a) for a in actions] == [WorkerDead, WorkerAlive]
    # B left: the conflict ends conflict_hold_s after it was last heard.
    clock.now += ing.config.conflict_hold_s
    ing.on_status(beat(A1, URL_A))
    ing.tick()
    assert ing.conflicting_workers() == ()


def test_a_conflict_past_its_hold_is_forgotten_and_a_new_one_found_again() -> None:
    ing, clock = conflicted(conflict_hold_s=30.0)
    assert len(both_beat(ing, clock, (B1, URL_B), (A1, URL_A), 3)) == 1
    for _ in range(31):  # A stopped; B alone
        clock.now += 1.0
        ing.on_status(beat(B1, URL_B))
        ing.tick()
    assert ing.conflicting_workers() == ()
    # A's next engine is a restart of w0 as far as anyone can tell, then found again.
    actions = both_beat(ing, clock, (B1, URL_B), (A2, URL_A), 3)
    assert [type(a) for a in actions] == [WorkerPurgedNotice, WorkerIdConflict]
    assert actions[-1] == WorkerIdConflict("w0", A2, URL_A, B1, URL_B)
    assert ing.stats().stream["id_conflicts"] == 2


def test_the_other_engines_snapshot_reply_is_ignored() -> None:
    """Both engines answer w0's snapshot subject: a reply of the one refused (a newer
    epoch) is ignored, not loaded as w0's restart."""
    ing, clock = conflicted()
    both_beat(ing, clock, (B1, URL_B), (A1, URL_A), 3)
    both_beat(ing, clock, (B1, URL_B), (A2, URL_A), 3)
    clock.now += 0.1  # B's batch 1 is lost: a gap
    acts = ing.on_event_message(headers("w0", B1, 2), batch(store([2])))
    assert [type(a) for a in acts] == [RequestSnapshot]
    assert ing.on_snapshot_page(page("w0", A2, 2, [(5, None, "GPU")]), cursor=0) == []
    assert ing.follows("w0", B1) and ing.stats().stream["snapshot_pages_ignored"] == 1
