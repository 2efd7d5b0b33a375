"""What a router lets go of when a worker's engine restarts (a heartbeat of a new epoch,
over a real NATS) or the registry forgets the worker (silent for good), on SQLite and
PostgreSQL, counted as the prune does (test_service_store_pruned_hints.py):
``drops_total{what="hint_dropped:worker_restarted"}`` (its holdings, one each: its holds
went with the old engine) and ``{what="hint_dropped:worker_forgotten"}`` (its actions,
held or waiting, one each). Before, both went silently. Its tenant's budget counts drop by
exactly the worker's share (blocks named on two workers count once on each), its agent
runtime's API holdings on it go too, and another worker's stay whole."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import nats
import pytest
import sqlalchemy as sa

from conftest import StubWorker, router_settings, running_router
from feed_helpers import publish_accepted, status, until
from kvhint.router.policy import Holdings
from kvhint.router.store.database import create_store_engine, migrate
from kvhint.router.store.models import HintActionRow
from kvhint.schemas import Subjects
from test_service_store_forgotten_workers import _worker_row
from test_service_store_worker_actions import _action, _insert

pytestmark = pytest.mark.usefixtures("throwaway_streams")

NAMED = list(range(1, 9))  # block hashes a Retain on each worker names (counted per worker)


def _named(action_id: str, worker_id: str, action_type: str, hashes: list[int],
           source: str = "planner") -> dict:
    """An accepted action whose target names its blocks (``block_hashes``)."""
    row = _action(action_id, worker_id)
    row.update(action_type=action_type, source=source, scope=f"acme/{action_id}",
               payload={"target": {"block_hashes": hashes}, "ttl_s": 600.0},
               requested_blocks=len(hashes), applied_blocks=len(hashes))
    return row


def _store_rows(engine: sa.Engine, w1_configured: bool) -> None:
    """w0 (heard by heartbeats, engine e1): a held Retain of a session (8 blocks of its
    own), one waiting for its outcome (8), a held Retain naming blocks 1-8 and an agent
    runtime's API Pin of blocks 1-4 (which pins 4 of them: 4 pinned, 4 more retained).
    w1: a held Retain naming the same blocks 1-8 (w1's own) and one waiting (8)."""
    now = time.time()
    _insert(engine, [_worker_row("w0", False, now, "e1"),
                     _worker_row("w1", w1_configured, now, "e1")],
            [_action("w0-held", "w0"), _action("w0-pending", "w0", "pending"),
             _named("w0-named", "w0", "kv.retain", NAMED),
             _named("w0-api", "w0", "kv.pin", NAMED[:4], source="api"),
             _named("w1-named", "w1", "kv.retain", NAMED),
             _action("w1-pending", "w1", "pending")])


async def _until_heard(publish: Callable[[], Awaitable[None]],
                       heard: Callable[[], bool]) -> None:
    """Publish again every 0.2 s until ``heard``: the router's subscriptions (heartbeats,
    then the outcome stream's consumer) come up after its link does. A repeat is
    harmless here (a heartbeat of the same engine; an answer taken once)."""
    deadline = time.monotonic() + 10.0
    while True:
        await publish()
        for _ in range(4):
            if heard():
                return
            await asyncio.sleep(0.05)
        assert time.monotonic() < deadline, "not heard in time"


def _assert_restored(holdings) -> None:  # noqa: ANN001 - a HoldingsLedger
    assert holdings.worker("w0") == Holdings(4, 20)
    assert holdings.worker("w1") == Holdings(0, 16)
    assert holdings.tenant("acme") == Holdings(4, 36)
    assert holdings.api_on_worker("acme", "w0") == Holdings(4, 0)


def _assert_w0_let_go(holdings) -> None:  # noqa: ANN001 - a HoldingsLedger
    assert holdings.worker("w0") == Holdings()
    assert holdings.api_on_worker("acme", "w0") == Holdings()
    assert holdings.worker("w1") == Holdings(0, 16)
    assert holdings.tenant("acme") == Holdings(0, 16)  # w1's share, exactly
    assert len(holdings) == 2


async def test_a_restarted_engines_holdings_leave_the_budgets_counted(
        tmp_path: Path, database_url: str, nats_url: str, subject_prefix: str) -> None:
    """The router restores w0's and w1's actions from the store; w0's engine (e1)
    heartbeats, then restarts: its first heartbeat of epoch e2 lets its 4 holdings go,
    counted once each. Its waiting action keeps waiting (the old engine may have answered
    before it went); its answer, when it comes, brings no holding back. A further
    heartbeat of e2 counts nothing more."""
    subjects = Subjects(subject_prefix)
    engine = create_store_engine(database_url)
    nc = await nats.connect(nats_url)
    try:
        migrate(engine)
        _store_rows(engine, w1_configured=False)
        settings = router_settings(tmp_path, [], database_url=database_url,
                                   nats_url=nats_url, subject_prefix=subject_prefix,
                                   hints={"tick_s": 3600.0})
        async with running_router(settings) as router:
            runtime = router.runtime
            hints, metrics = runtime.hints, runtime.metrics
            restarted = metrics.drops.labels("hint_dropped:worker_restarted")
            beat_e1, beat_e2 = status("w0", "e1", 0), status("w0", "e2", 0)
            assert await runtime.link.wait_connected(10)
            _assert_restored(hints.holdings)
            await _until_heard(lambda: nc.publish(subjects.status("w0"), beat_e1),
                               lambda: runtime.workers.get("w0").plugin_alive)
            _assert_restored(hints.holdings)  # the same engine: it holds them still
            assert restarted._value.get() == 0

            await _until_heard(lambda: nc.publish(subjects.status("w0"), beat_e2),
                               lambda: runtime.workers.get("w0").epoch == "e2")
            _assert_w0_let_go(hints.holdings)
            assert restarted._value.get() == 4
            assert hints.pending["w0-pending"].status == "pending"
            assert set(hints.pending) == {"w0-pending", "w1-pending"}
            assert metrics.hints.labels("kv.retain", "expired", "planner")._value.get() == 0

            # The old engine's answer to the waiting Retain: taken, nothing held again.
            await _until_heard(lambda: publish_accepted(nc, subjects, "m1", "w0-pending",
                                                        "kv.retain", 8),
                               lambda: "w0-pending" not in hints.pending)
            _assert_w0_let_go(hints.holdings)
            heard = runtime.workers.get("w0").status
            await nc.publish(subjects.status("w0"), beat_e2)
            await until(lambda: runtime.workers.get("w0").status is not heard)
            assert restarted._value.get() == 4
            assert metrics.drops.labels("hint_dropped:worker_forgotten")._value.get() == 0
    finally:
        await nc.drain()
        engine.dispose()


async def test_a_forgotten_workers_actions_are_let_go_counted(
        tmp_path: Path, database_url: str, nats_url: str, subject_prefix: str,
        stub_workers: list[StubWorker]) -> None:
    """The router restores w0's (heard by heartbeats) and w1's (configured) actions;
    w0 stays silent past the time dead workers are kept, and the feed's tick forgets it:
    its 4 actions go, counted once each (its waiting Retain is held too), the waiting one
    ended expired and saved before its row went with the worker's. w1 keeps its own."""
    engine = create_store_engine(database_url)
    try:
        migrate(engine)
        _store_rows(engine, w1_configured=True)
        settings = router_settings(tmp_path, [("w1", stub_workers[0].url)],
                                   database_url=database_url, nats_url=nats_url,
                                   subject_prefix=subject_prefix, hints={"tick_s": 3600.0})
        async with running_router(settings) as router:
            runtime = router.runtime
            hints, metrics = runtime.hints, runtime.metrics
            assert await runtime.link.wait_connected(10)
            _assert_restored(hints.holdings)
            waiting = hints.pending["w0-pending"]
            # Dead workers kept half a second, not an hour: set again at every look, as
            # the feed's stream check (on_connected, maybe not run yet) raises it to the
            # events stream's max age.
            await until(lambda: runtime.ingestor.remember_dead_for(0.5)
                        or runtime.workers.get("w0") is None)
            _assert_w0_let_go(hints.holdings)
            assert metrics.drops.labels("hint_dropped:worker_forgotten")._value.get() == 4
            assert metrics.drops.labels("hint_dropped:worker_restarted")._value.get() == 0
            assert set(hints.pending) == {"w1-pending"}
            assert (waiting.status, waiting.reason) == ("expired", "worker forgotten")
            assert metrics.hints.labels("kv.retain", "expired", "planner")._value.get() == 1
            await runtime.writer.flush()
            assert metrics.drops.labels("store_row_rejected")._value.get() == 0
            with engine.connect() as conn:
                assert set(conn.execute(sa.select(HintActionRow.action_id)).scalars()) == {
                    "w1-named", "w1-pending"}
    finally:
        engine.dispose()
