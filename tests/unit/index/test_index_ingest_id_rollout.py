"""A surge rollout (Kubernetes' maxSurge: the new pod starts and heartbeats while the old
one drains, both under one worker id) is no worker id conflict; two servers heard side
by side for conflict_confirm_s (300 s) are; a server that stops and comes back at its own
address is no rollout's (router/kv_index/stream_sources.py).

Before, the old pod's beats alternating with the new one's for a few seconds were a
conflict at once: warned of, shown by kvhint_router_worker_id_conflict (so
KvhintWorkerIdConflict fired) and held for conflict_hold_s, 10 min, after the old pod
was last heard, through a normal rollout; and meanwhile the new server's own restart, or
the next rollout's pod, was refused until the engine followed had been silent for its
liveness window (the worker declared dead and purged first)."""

from __future__ import annotations

from ingest_fixtures import Clock, batch, headers, store
from ingest_fixtures import make_paging_ingestor as make
from test_index_ingest_id_conflict import (
    A1,
    A2,
    B1,
    B2,
    C1,
    URL_A,
    URL_B,
    URL_C,
    beat,
    both_beat,
)

from kvhint.router.kv_index import KvEventIngestor, WorkerIdConflict, WorkerPurgedNotice


def rolled_out() -> tuple[KvEventIngestor, Clock]:
    """The old pod (A1) runs; the new one (B1, at its own address) starts: taken as w0's
    restart (one purge), as without a conflict. Default settings (confirm 300 s)."""
    ing, _, clock = make()
    ing.on_status(beat(A1, URL_A))
    clock.now += 0.5
    assert [type(a) for a in ing.on_status(beat(B1, URL_B))] == [WorkerPurgedNotice]
    return ing, clock


def test_a_surge_rollouts_overlap_is_no_conflict() -> None:
    """The old pod drains for 60 s beside the new one (its beats refused, counted as
    before), then stops: nothing is reported, ever; the conflict found ends a liveness
    window after its last beat, counted as unconfirmed."""
    ing, clock = rolled_out()
    actions: list[object] = []
    for _ in range(6):
        actions += both_beat(ing, clock, (B1, URL_B), (A1, URL_A), 10)
        assert ing.conflicting_workers() == () and ing.worker_views()["w0"].conflict is None
    for _ in range(10):  # the old pod is gone
        clock.now += 1.0
        actions += ing.on_status(beat(B1, URL_B)) + ing.tick()
    assert actions == [] and ing.follows("w0", B1) and ing.live_workers() == ("w0",)
    stream = ing.stats().stream
    assert stream["id_conflicts"] == 0 and stream["id_conflicts_unconfirmed"] == 1
    assert stream["stale_status"] == 60 and stream["epoch_changes"] == 1
    assert stream["deaths"] == 0


def test_after_a_rollout_the_new_server_and_the_next_pod_are_taken_at_once() -> None:
    """Once the old pod is silent the new server owns the id outright: its own restart
    (B2, no address needed) and the next rollout's pod (C1) are each taken at their first
    heartbeat, not held off for conflict_hold_s nor until the engine followed is dead."""
    ing, clock = rolled_out()
    both_beat(ing, clock, (B1, URL_B), (A1, URL_A), 20)
    for _ in range(5):  # the old pod is gone
        clock.now += 1.0
        ing.on_status(beat(B1, URL_B))
        ing.tick()
    clock.now += 1.0
    assert [type(a) for a in ing.on_status(beat(B2, None))] == [WorkerPurgedNotice]
    assert ing.follows("w0", B2)
    clock.now += 1.0
    assert [type(a) for a in ing.on_status(beat(C1, URL_C))] == [WorkerPurgedNotice]
    assert ing.follows("w0", C1) and ing.stats().stream["deaths"] == 0
    assert ing.conflicting_workers() == ()


def test_two_servers_side_by_side_past_the_confirm_window_are_reported_once() -> None:
    """A misconfiguration: both servers keep running. Reported at the first alternation
    past conflict_confirm_s, once, naming both; the router kept to B from the first
    (A's beats refused), and the conflict is held as before."""
    ing, clock = rolled_out()
    confirm = ing.config.conflict_confirm_s
    assert confirm == 300.0
    actions = both_beat(ing, clock, (B1, URL_B), (A1, URL_A), int(confirm) - 2)
    assert actions == [] and ing.conflicting_workers() == ()
    actions = both_beat(ing, clock, (B1, URL_B), (A1, URL_A), 10)
    assert actions == [WorkerIdConflict("w0", B1, URL_B, A1, URL_A)]
    assert ing.conflicting_workers() == ("w0",)
    view = ing.worker_views()["w0"].conflict
    assert view is not None and view.found_s_ago > confirm
    stream = ing.stats().stream
    assert stream["id_conflicts"] == 1 and stream["id_conflicts_unconfirmed"] == 0
    assert stream["epoch_changes"] == 1


def test_a_server_that_comes_back_at_its_address_is_refused_and_reported() -> None:
    """A misconfigured server in a crash loop shorter than the confirm window: A1 stops
    after 60 s beside B, and the conflict found ends unreported; A's next engine (A2,
    newer than B1) starts at A's address a minute later. A rollout's old pod never comes
    back: this is a second server under w0. A2 is refused (B stays followed: no purge,
    no snapshot), its batches too, and the overlap counts on from when it was found: A
    is reported once it was found conflict_confirm_s ago, though it never stays up that
    long. Without it each restart of A swapped the engine followed, and a server that
    never stays up conflict_confirm_s was never reported."""
    ing, clock = rolled_out()
    found = clock.now
    both_beat(ing, clock, (B1, URL_B), (A1, URL_A), 60)
    for _ in range(60):  # A restarting
        clock.now += 1.0
        ing.on_status(beat(B1, URL_B))
        ing.tick()
    assert ing.stats().stream["id_conflicts_unconfirmed"] == 1
    clock.now += 0.5
    assert ing.on_status(beat(A2, URL_A)) == []  # refused: B1 followed, no purge
    clock.now += 0.1  # and so are its batches (they name no address)
    assert ing.on_event_message(headers("w0", A2, 1), batch(store([9]))) == []
    actions = both_beat(ing, clock, (B1, URL_B), (A2, URL_A), 3)
    assert actions == [] and ing.follows("w0", B1)
    while clock.now - found < ing.config.conflict_confirm_s - 1:
        assert both_beat(ing, clock, (B1, URL_B), (A2, URL_A), 1) == []
    actions = both_beat(ing, clock, (B1, URL_B), (A2, URL_A), 3)
    assert actions == [WorkerIdConflict("w0", B1, URL_B, A2, URL_A)]
    assert ing.follows("w0", B1) and ing.stats().stream["epoch_changes"] == 1
    assert ing.stats().stream["other_source_dropped"] > 2 * 60
    assert ing.index.stats().entries == 0


def test_a_rollouts_new_pod_restarting_before_it_is_ready_is_no_conflict() -> None:
    """A surge rollout whose new pod (B, at its own address) restarts once before it is
    ready: its container crashes 40 s in (w0 falls back to the old pod A, which serves
    until the new one is ready), starts again at the pod's address (B2) 20 s later, is
    ready a minute on, and A drains 30 s, then stops. Under 5 min side by side, no
    restart of a misconfigured server: nothing is reported, and w0 ends on B2. Before,
    B2 was read as a second server "that came back at its address" (B1 was the other
    source when the overlap ended unreported): refused, and reported at once, which
    paged KvhintWorkerIdConflict for 10 min after A was last heard."""
    ing, clock = rolled_out()
    actions = both_beat(ing, clock, (B1, URL_B), (A1, URL_A), 40)
    for _ in range(20):  # B's container restarting: A alone
        clock.now += 1.0
        actions += ing.on_status(beat(A1, URL_A)) + ing.tick()
    assert ing.follows("w0", A1)  # B1 declared dead: the old pod serves
    actions += both_beat(ing, clock, (A1, URL_A), (B2, URL_B), 90)  # ready, then A drains
    for _ in range(10):  # A is gone
        clock.now += 1.0
        actions += ing.on_status(beat(B2, URL_B)) + ing.tick()
        assert ing.conflicting_workers() == ()
    assert not [a for a in actions if isinstance(a, WorkerIdConflict)], actions
    assert ing.follows("w0", B2) and ing.stats().stream["id_conflicts"] == 0


def test_the_next_rollout_after_a_new_pods_restart_is_no_conflict() -> None:
    """A rollout whose new pod (B) crashes while the old one (A) drains: w0 falls back to
    A, which stops 20 s later; B's container starts again at the pod's address (B2) and
    is taken, w0 dead meanwhile. Then the next rollout, within conflict_hold_s: C, at its
    own address, while B2 drains. B2 is the engine followed, no server that left an
    overlap: nothing is reported. Before, B's address stayed recorded as the other
    source of the first overlap (B1 was, once A took over), so B2 draining beside C
    "came back" (and was reported at once; with the first overlap counted on, still
    reported, that one being found over 5 min before)."""
    ing, clock = rolled_out()
    actions = both_beat(ing, clock, (B1, URL_B), (A1, URL_A), 60)
    for _ in range(20):  # B1 crashed: A alone, draining
        clock.now += 1.0
        actions += ing.on_status(beat(A1, URL_A)) + ing.tick()
    assert ing.follows("w0", A1)
    for _ in range(30):  # A stopped; B's container restarting
        clock.now += 1.0
        actions += ing.tick()
    for _ in range(250):  # B2 alone
        clock.now += 1.0
        actions += ing.on_status(beat(B2, URL_B)) + ing.tick()
    assert ing.follows("w0", B2)
    clock.now += 1.0
    assert [type(a) for a in ing.on_status(beat(C1, URL_C))] == [WorkerPurgedNotice]
    actions += both_beat(ing, clock, (C1, URL_C), (B2, URL_B), 30)  # B2 drains
    for _ in range(10):
        clock.now += 1.0
        actions += ing.on_status(beat(C1, URL_C)) + ing.tick()
        assert ing.conflicting_workers() == ()
    assert not [a for a in actions if isinstance(a, WorkerIdConflict)], actions
    assert ing.follows("w0", C1) and ing.stats().stream["id_conflicts"] == 0
