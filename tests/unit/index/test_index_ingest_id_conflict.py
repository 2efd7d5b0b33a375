"""Two engines heartbeating under one worker id (the plugin's default ``w<rank>`` on two
single-rank servers, or one id configured twice): the ingestor finds it once, names both
engines, and sticks to the one it follows; a worker's own restart is still taken at once
(router/kv_index/stream_sources.py).

Before, nothing said so, and each restart of either server swapped the engine the index
followed (a purge and a snapshot each time); once the engine followed left for good, the
other's heartbeats (a retired epoch) stayed refused, the worker dead, until forgotten."""

from __future__ import annotations

import msgspec
import pytest
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
URL_C = "http://server-c:8000"
SERVICE = "http://vllm:8000"  # one address for both servers (a Kubernetes Service's)
# Engine starts (ms order): A's first engine, B's, then each one's restart, then C's.
A1, B1, A2, B2, B3, C1 = (s.new_epoch(t) for t in (1_000.0, 2_000.0, 3_000.0, 4_000.0,
                                                   5_000.0, 6_000.0))


def beat(epoch: str, url: str | None, last_seq: int = 0) -> s.WorkerStatus:
    return msgspec.structs.replace(status(epoch=epoch, last_seq=last_seq, interval_s=1.0),
                                   http_url=url)


def both_beat(ing: KvEventIngestor, clock: Clock, followed: tuple[str, str | None],
              other: tuple[str, str | None], rounds: int) -> list[object]:
    """``rounds`` heartbeat intervals of both servers; the actions they caused."""
    actions: list[object] = []
    for _ in range(rounds):
        clock.now += 0.5
        actions += ing.on_status(beat(*followed))
        clock.now += 0.5
        actions += ing.on_status(beat(*other))
        actions += ing.tick()
    return actions


def conflicted(url_a: str | None = URL_A, url_b: str | None = URL_B,
               **config: float) -> tuple[KvEventIngestor, Clock]:
    """A (A1) heard first, then B (B1) starts: taken as A's restart (one purge, the
    only one); A's next beats are refused, and the second, after B spoke again, finds
    the conflict. Reported at once (conflict_confirm_s 0) unless ``config`` says
    otherwise: these tests are about what a conflict held does; the confirm window's
    are below."""
    config.setdefault("conflict_confirm_s", 0.0)
    ing, _, clock = make(**config)
    ing.on_status(beat(A1, url_a))
    clock.now += 0.5
    assert [type(a) for a in ing.on_status(beat(B1, url_b))] == [WorkerPurgedNotice]
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


@pytest.mark.parametrize("url_a, url_b", [(None, None), (SERVICE, SERVICE)],
                         ids=["no-http-url", "one-service-url"])
def test_the_followed_engines_restart_waits_where_addresses_tell_nothing(
        url_a: str | None, url_b: str | None) -> None:
    """While a conflict is held and the heartbeats' addresses do not tell the two servers
    apart (none given, or both behind one Service URL), B's own restart (B2) cannot be
    told from A's: it waits until B1 is declared dead (a liveness window at most), then
    is taken; A stays refused."""
    ing, clock = conflicted(url_a, url_b)
    both_beat(ing, clock, (B1, url_b), (A1, url_a), 3)
    actions: list[object] = []
    for _ in range(5):  # B1 silent; B2 and A beat
        clock.now += 0.5
        actions += ing.on_status(beat(B2, url_b))
        clock.now += 0.5
        actions += ing.on_status(beat(A1, url_a))
        actions += ing.tick()
        if ing.follows("w0", B2):
            break
    assert ing.follows("w0", B2), ing.worker_views()["w0"]
    assert [type(a) for a in actions] == [WorkerDead, WorkerAlive]
    assert both_beat(ing, clock, (B2, url_b), (A1, url_a), 5) == []  # same conflict
    assert ing.stats().stream["id_conflicts"] == 1 and ing.follows("w0", B2)


def test_the_followed_servers_restart_is_taken_at_once_during_a_conflict() -> None:
    """B restarts while the conflict is held: B2's heartbeat names B1's address, one A
    does not share, so it is server B's own restart (one address, one process: B1 has
    stopped), taken at its first heartbeat as without a conflict: its seq 1 applies, no
    snapshot, no death. Before, B2 was refused until B1 had been silent a liveness
    window: w0 declared dead and purged, and B2's first batches dropped meanwhile. A,
    at its own address, stays refused; B1's late last beat changes nothing."""
    ing, clock = conflicted()
    both_beat(ing, clock, (B1, URL_B), (A1, URL_A), 3)
    clock.now += 0.5
    acts = ing.on_status(beat(B2, URL_B))
    assert [type(a) for a in acts] == [WorkerPurgedNotice] and ing.follows("w0", B2)
    clock.now += 0.1
    assert ing.on_status(beat(B1, URL_B)) == []  # B1's last beat, late
    assert ing.on_event_message(headers("w0", B2, 1), batch(store([7]))) == []
    assert both_beat(ing, clock, (B2, URL_B), (A1, URL_A), 10) == []
    assert ing.follows("w0", B2) and ing.live_workers() == ("w0",)
    assert ing.index.export_state().blocks == {"w0": {"GPU": frozenset({7})}}
    view = ing.worker_views()["w0"].conflict
    assert view is not None and (view.other_epoch, view.other_url) == (A1, URL_A), view
    stream = ing.stats().stream
    assert stream["deaths"] == 0 and stream["resyncs_started"] == 0
    assert stream["epoch_changes"] == 2 and stream["id_conflicts"] == 1
    # A's restart, at its own address, is still refused: no flip-flop.
    assert both_beat(ing, clock, (B2, URL_B), (A2, URL_A), 5) == []
    assert ing.follows("w0", B2) and ing.stats().stream["epoch_changes"] == 2


def test_an_address_two_engines_were_heard_at_names_no_restart() -> None:
    """Three engines under w0, two of them (B1, B2) at one address: once an engine at the
    followed one's address was heard beside it, that address tells nothing, even after
    A took the other engine's place in the record again. B1's restart (B3, newer than
    B2) then waits like any other engine's: without that, each restart at the shared
    address would swap the engine followed (a purge and a snapshot each time)."""
    ing, clock = conflicted()
    both_beat(ing, clock, (B1, URL_B), (A1, URL_A), 3)
    clock.now += 0.5
    ing.on_status(beat(B2, URL_B))  # taken: B's restart, as far as anyone can tell
    for _ in range(4):  # ... but B1 runs on, beside B2 and A1
        for epoch, url in ((B2, URL_B), (B1, URL_B), (B2, URL_B), (A1, URL_A)):
            clock.now += 0.25
            ing.on_status(beat(epoch, url))
    view = ing.worker_views()["w0"].conflict
    assert view is not None and view.other_epoch == A1  # A1 named again
    actions: list[object] = []
    for _ in range(5):  # B1 restarts as B3, at B's address
        for epoch, url in ((B2, URL_B), (B3, URL_B), (A1, URL_A)):
            clock.now += 0.3
            actions += ing.on_status(beat(epoch, url))
        actions += ing.tick()
    assert actions == [] and ing.follows("w0", B2)
    assert ing.stats().stream["epoch_changes"] == 2


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
    # That request got its one reply: it is asked again after snapshot_retry_s (1 s),
    # not after snapshot_timeout_s (10 s), and counted as no failure.
    clock.now += 0.5
    assert [type(a) for a in ing.tick()] == []
    clock.now += 0.6
    assert [type(a) for a in ing.tick()] == [RequestSnapshot]
    assert ing.stats().stream["snapshot_failures"] == 0


def test_the_followed_servers_own_restart_is_never_named_the_other_engine() -> None:
    """The conflict is being fixed: A left w0 (it stopped, or took its own id), and B
    restarts while the conflict is still held (B2 is refused until B1 is silent). Before,
    B2's refused beats took the place of A1 as "the other engine", and once B2 was taken
    the engine it replaced did: the conflict named server B's own dead engine as running
    beside it and was held conflict_hold_s from B1's last beat (from each restart, in a
    crash loop for ever), not from A's."""
    ing, clock = conflicted(conflict_hold_s=30.0)
    both_beat(ing, clock, (B1, URL_B), (A1, URL_A), 3)
    a_heard = clock.now
    for _ in range(10):  # A gone; B alone
        clock.now += 1.0
        ing.on_status(beat(B1, URL_B))
        ing.tick()
    for _ in range(10):  # B1 killed, B2 up: taken once B1 is silent for its window
        clock.now += 1.0
        ing.on_status(beat(B2, URL_B))
        ing.tick()
    assert ing.follows("w0", B2)
    view = ing.worker_views()["w0"].conflict
    assert view is not None and (view.other_epoch, view.other_url) == (A1, URL_A), view
    clock.now = a_heard + 30.5  # the hold runs from A's last beat
    ing.on_status(beat(B2, URL_B))
    ing.tick()
    assert ing.conflicting_workers() == () and ing.stats().stream["id_conflicts"] == 1


def test_a_snapshot_that_takes_the_id_moves_the_conflict_like_a_heartbeat() -> None:
    """B1 dies while it resyncs; A2's reply to the snapshot request comes once B1 is past
    its window, before the tick that declares it dead or any heartbeat of A2: the stream
    takes A2 from the snapshot (a restart, purged first). Before, the conflict record was
    not told, and named A2, the engine followed, as the other engine for conflict_hold_s."""
    ing, clock = conflicted()
    both_beat(ing, clock, (B1, URL_B), (A1, URL_A), 3)
    both_beat(ing, clock, (B1, URL_B), (A2, URL_A), 3)  # A restarted: A2 beside B1
    clock.now += 0.1  # B's batch 1 is lost: a gap
    assert [type(a) for a in ing.on_event_message(headers("w0", B1, 2),
                                                  batch(store([2])))] == [RequestSnapshot]
    clock.now += 3.5  # B1 silent past its window; no tick yet
    acts = ing.on_snapshot_page(page("w0", A2, 4, [(5, None, "GPU")]), cursor=0)
    assert [type(a) for a in acts] == [WorkerPurgedNotice] and ing.follows("w0", A2)
    view = ing.worker_views()["w0"].conflict
    assert view is not None and view.other_epoch == B1, view


def test_a_gone_engines_history_does_not_displace_the_engine_heard_now() -> None:
    """A router starts while A runs and B, the other server under w0, stopped a while
    ago: the replay holds both engines' batches. Before, B's (a newer epoch) were taken
    as w0's restart: A's view purged, B's old blocks routed on as exact, and A's beats
    refused (a retired epoch) until w0 was declared dead, a liveness window later."""
    ing, index, clock = make()
    ing.replay_started()
    assert ing.on_status(beat(A1, URL_A, last_seq=1)) == [WorkerAlive("w0", A1)]  # runs now
    ing.on_event_message(headers("w0", A1, 1), batch(store([1])), age_s=100.0)
    acts = ing.on_event_message(headers("w0", B1, 1), batch(store([9])), age_s=90.0)
    assert acts == [] and ing.follows("w0", A1)
    assert index.export_state().blocks == {"w0": {"GPU": frozenset({1})}}
    assert ing.stats().stream["stale_epoch"] == 1 and ing.view_exact("w0")
