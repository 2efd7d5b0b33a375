"""A worker's hint actions in the router's memory after store retention pruned the worker,
on SQLite and PostgreSQL: the router that prunes it lets go of its pending actions (ended
expired, not saved: their rows went with the worker's) and its holdings, counted
(``drops_total{what="hint_dropped:worker_pruned"}``), with its feedback. Before, they
stayed until their deadline and TTL, or until the registry forgot the worker, counting
against its tenant's budget. A worker not pruned keeps them, and so does one whose row
was pruned but which this router heard within the retention (a heartbeat the store had
not had yet, a plugin clock behind the router's): it is live."""

from __future__ import annotations

import time
from pathlib import Path

import sqlalchemy as sa

from kvhint.router.policy import Holdings, SplitFeedback
from kvhint.router.store.database import create_store_engine, migrate
from kvhint.router.store.models import (
    FEEDBACK_KIND_PREFIX,
    FEEDBACK_TENANT,
    HintActionRow,
    LearnedStatsRow,
    WorkerRow,
)

from conftest import router_settings, running_router
from test_service_store_forgotten_workers import _heartbeat, _worker_row
from test_service_store_worker_actions import _action, _insert

RETENTION_S = 600.0
WORKERS = ("pruned", "heard", "live")


def _stored_workers(engine: sa.Engine) -> set[str]:
    with engine.connect() as conn:
        return set(conn.execute(sa.select(WorkerRow.worker_id)).scalars())


def _stored_actions(engine: sa.Engine) -> set[str]:
    with engine.connect() as conn:
        return set(conn.execute(sa.select(HintActionRow.action_id)).scalars())


async def test_the_router_that_prunes_a_worker_lets_go_of_its_actions(
        tmp_path: Path, database_url: str) -> None:
    """The store holds three heartbeat-learned workers, each with a held Retain, one
    waiting for its outcome and its feedback, which the router restores at its start (heard within
    session_forget_s). "pruned" and "heard" were last heard, by the store, past the
    retention; "live" just now. The router hears "heard" (its heartbeat not written
    yet). The prune deletes both stale rows; the router lets go of "pruned"'s two
    actions (counted once each, its waiting one ended expired, not saved) and its
    feedback, and keeps "heard"'s and "live"'s."""
    now = time.time()
    stale = now - RETENTION_S - 300.0
    engine = create_store_engine(database_url)
    try:
        migrate(engine)
        _insert(engine, [_worker_row("pruned", False, stale), _worker_row("heard", False, stale),
                         _worker_row("live", False, now)],
                [_action(f"{worker}-{status}", worker, status)
                 for worker in WORKERS for status in ("accepted", "pending")])
        with engine.begin() as conn:  # what each taught (let go of since the last stop)
            conn.execute(sa.insert(LearnedStatsRow), [
                {"tenant": FEEDBACK_TENANT, "kind": FEEDBACK_KIND_PREFIX + worker,
                 "data": SplitFeedback(worker).to_dict(), "updated_at": now}
                for worker in WORKERS])
        settings = router_settings(tmp_path, [], database_url=database_url,
                                   store_retention_s=RETENTION_S)
        async with running_router(settings) as router:
            runtime = router.runtime
            hints = runtime.hints
            assert set(hints.pending) == {f"{worker}-pending" for worker in WORKERS}
            assert {w: hints.holdings.worker(w) for w in WORKERS} == {
                w: Holdings(0, 16) for w in WORKERS}
            assert hints.holdings.tenant("acme") == Holdings(0, 48)
            assert set(hints.feedback) == set(WORKERS)
            runtime.workers.on_heartbeat(_heartbeat("heard"))
            waiting = hints.pending["pruned-pending"]
            await runtime.writer.flush()  # the start's writes (each worker's row) first
            await runtime._prune_store()

            assert _stored_workers(engine) == {"live"}
            assert _stored_actions(engine) == {"live-accepted", "live-pending"}
            assert set(hints.pending) == {"heard-pending", "live-pending"}
            assert hints.holdings.worker("pruned") == Holdings(0, 0)
            assert {w: hints.holdings.worker(w) for w in ("heard", "live")} == {
                w: Holdings(0, 16) for w in ("heard", "live")}
            assert hints.holdings.tenant("acme") == Holdings(0, 32)
            assert set(hints.feedback) == {"heard", "live"}
            assert (waiting.status, waiting.reason) == (
                "expired", "worker pruned by store retention")
            metrics = runtime.metrics
            assert metrics.drops.labels("hint_dropped:worker_pruned")._value.get() == 2
            assert metrics.hints.labels("kv.retain", "expired", "planner")._value.get() == 1
            await runtime.writer.flush()
            # Not saved: a row of a worker the store no longer holds would be refused.
            assert metrics.drops.labels("store_row_rejected")._value.get() == 0
            assert _stored_actions(engine) == {"live-accepted", "live-pending"}
    finally:
        engine.dispose()
