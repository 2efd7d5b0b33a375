"""A worker's outcome feedback after retention pruned the worker, on SQLite and
PostgreSQL: the router that pruned it lets go of it in memory too, and a feedback row
another replica writes afterwards for it (a row without its worker's) is deleted by the
next prune, counted. Before, the pruning router kept the feedback and wrote it back at
its next change, and such rows stayed until a router's next start found their worker
gone."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import sqlalchemy as sa

from kvhint.router.policy import PlannerConfig
from kvhint.router.service.hint_dispatch import HintDispatcher
from kvhint.router.service.metrics import RouterMetrics
from kvhint.router.service.workers import WorkerRegistry
from kvhint.router.store.database import create_store_engine, migrate
from kvhint.router.store.models import FEEDBACK_KIND_PREFIX, LearnedStatsRow, WorkerRow
from kvhint.router.store.retention import prune_history
from kvhint.router.store.writer import StoreWriter
from kvhint.schemas import Subjects

from conftest import router_settings, running_router
from test_service_store_forgotten_workers import _worker_row

WEEK_S = 7 * 86_400.0


def _feedback_rows(engine: sa.Engine) -> set[str]:
    """The workers with a stored feedback row."""
    with engine.connect() as conn:
        return {kind[len(FEEDBACK_KIND_PREFIX):] for kind in conn.execute(
            sa.select(LearnedStatsRow.kind)).scalars() if kind.startswith(FEEDBACK_KIND_PREFIX)}


async def test_the_router_that_prunes_a_worker_lets_go_of_its_feedback(
        tmp_path: Path, database_url: str) -> None:
    """The router's hourly retention prunes "pruned" (not heard for over the window);
    "live" stays. Both had taught it (feedback in memory, saved). After the prune,
    "pruned"'s feedback is gone from memory as from the store, and the next save writes
    no row for it. Before, it stayed in memory, to be written back at its next change."""
    settings = router_settings(tmp_path, [], database_url=database_url)
    async with running_router(settings) as router:
        runtime = router.runtime
        now = time.time()
        with runtime.engine.begin() as conn:
            conn.execute(sa.insert(WorkerRow), [
                _worker_row("pruned", False, now - settings.store_retention_s - 3600.0),
                _worker_row("live", False, now)])
        for worker in ("pruned", "live"):
            runtime.hints.reset_worker(worker)  # as a new engine's first heartbeat does
        runtime.hints.save_learned(now)
        await runtime.writer.flush()
        assert _feedback_rows(runtime.engine) == {"pruned", "live"}
        await runtime._prune_store()
        assert _feedback_rows(runtime.engine) == {"live"}
        assert set(runtime.hints.feedback) == {"live"}
        runtime.hints.save_learned(time.time())
        await runtime.writer.flush()
        assert _feedback_rows(runtime.engine) == {"live"}


def test_a_feedback_row_written_for_a_pruned_worker_goes_at_the_next_prune(
        database_url: str) -> None:
    """Replica A prunes "pruned"; replica B, which still remembers what "pruned" taught
    it, saves that afterwards: a feedback row without its worker's. A's next prune
    deletes it, counted with the learned_stats rows; "live"'s feedback, and the tenant's
    statistics, stay. Before, it stayed until a router's next start."""
    engine = create_store_engine(database_url)
    now = time.time()
    try:
        migrate(engine)
        with engine.begin() as conn:
            conn.execute(sa.insert(WorkerRow), [_worker_row("pruned", False, now - 2 * WEEK_S),
                                                _worker_row("live", False, now)])
            conn.execute(sa.insert(LearnedStatsRow).values(
                tenant="acme", kind="tenant_gaps", data={}, updated_at=now))

        async def replica_b_saves() -> None:
            writer = StoreWriter(engine, flush_interval_s=10, queue_max=100,
                                 on_drop=lambda *_: None)
            hints = HintDispatcher(None, Subjects("t"), WorkerRegistry([]), writer,
                                   RouterMetrics(), PlannerConfig(), seed=1)
            for worker in ("pruned", "live"):
                hints.reset_worker(worker)
            hints.save_learned(now)
            await writer.close()

        assert prune_history(engine, before=now - WEEK_S) == {
            "hint_actions": 0, "learned_stats": 0,
            "response_sessions": 0, "sessions": 0, "workers": 1}
        asyncio.run(replica_b_saves())
        assert _feedback_rows(engine) == {"pruned", "live"}
        assert prune_history(engine, before=now - WEEK_S) == {
            "hint_actions": 0, "learned_stats": 1,
            "response_sessions": 0, "sessions": 0, "workers": 0}
        assert _feedback_rows(engine) == {"live"}
        with engine.connect() as conn:
            assert conn.execute(sa.select(LearnedStatsRow.kind).where(
                LearnedStatsRow.tenant == "acme")).scalars().all() == ["tenant_gaps"]
    finally:
        engine.dispose()
