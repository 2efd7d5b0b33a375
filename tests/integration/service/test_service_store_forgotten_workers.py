"""A forgotten worker's feedback row leaves the store with it, on SQLite and PostgreSQL:
forgotten at run time (the registry forgot it: silent for good) or found gone at a
restart (dropped from the config). And the writer's deletes keep their place in its
queue among the writes to the same row."""

from __future__ import annotations

import asyncio

from sqlalchemy import select

from kvhint.router.policy import PlannerConfig
from kvhint.router.policy.feedback import WorkerFeedback
from kvhint.router.service.hint_dispatch import HintDispatcher
from kvhint.router.service.metrics import RouterMetrics
from kvhint.router.service.workers import WorkerRegistry
from kvhint.router.store.database import create_store_engine, migrate
from kvhint.router.store.models import LearnedStatsRow
from kvhint.router.store.reader import load_recovery
from kvhint.router.store.writer import StoreWriter
from kvhint.schemas import Subjects

NOW = 1_700_000_000.0


def _feedback_rows(engine) -> dict[str, float]:
    """Worker id -> the pin_ask_scale its stored feedback row says."""
    with engine.connect() as conn:
        return {row.data["worker_id"]: row.data["pin_ask_scale"]
                for row in conn.execute(select(LearnedStatsRow.__table__))
                if row.kind.startswith("feedback:")}


def _router(engine, configured: list[tuple[str, str]]) -> tuple[HintDispatcher, StoreWriter]:
    writer = StoreWriter(engine, flush_interval_s=10, queue_max=100, on_drop=lambda *_: None)
    hints = HintDispatcher(None, Subjects("t"), WorkerRegistry(configured), writer,
                           RouterMetrics(), PlannerConfig(), seed=1)
    return hints, writer


def test_a_forgotten_workers_feedback_row_is_deleted_and_not_read_back(
        database_url: str) -> None:
    """Three workers taught the planner (pin_ask_scale 0.5, saved): "gone" (heard only by
    heartbeats) is forgotten while the router runs, "dropped" is left out of the config
    at the next start, "kept" stays. Before, both rows stayed in the store and the
    restarted router read them back (one per pod ever seen, for good)."""
    engine = create_store_engine(database_url)
    try:
        migrate(engine)

        async def first_run() -> None:
            hints, writer = _router(engine, [("kept", "http://k"), ("dropped", "http://d")])
            hints._workers.ensure("gone", "http://g")  # learnt from its heartbeat
            for worker in ("kept", "dropped", "gone"):
                hints.feedback[worker] = WorkerFeedback(worker, pin_ask_scale=0.5)
            hints.save_learned(NOW)
            await writer.flush()
            assert _feedback_rows(engine) == {"kept": 0.5, "dropped": 0.5, "gone": 0.5}
            # Its feedback changed since (saved in the same batch as it is forgotten):
            # the delete, queued after, wins.
            hints.feedback["gone"] = WorkerFeedback("gone", pin_ask_scale=0.25)
            hints.save_learned(NOW + 1)
            hints._workers.forget_silent(float("inf"), after_s=0.0)  # as the feed's tick
            hints.forget_worker("gone")
            await writer.close()

        asyncio.run(first_run())
        assert _feedback_rows(engine) == {"kept": 0.5, "dropped": 0.5}

        async def restart() -> None:
            hints, writer = _router(engine, [("kept", "http://k")])
            hints.restore(load_recovery(engine, active_since=0.0, max_sessions=10).learned, [])
            assert set(hints.feedback) == {"kept"}
            assert hints.feedback["kept"].pin_ask_scale == 0.5
            await writer.close()

        asyncio.run(restart())
        assert _feedback_rows(engine) == {"kept": 0.5}
    finally:
        engine.dispose()


def test_deletes_and_writes_of_one_row_land_in_the_order_queued(database_url: str) -> None:
    """Per row, the last of the queued writes and deletes decides, within one batch and
    across a batch kept for retry: a write after a delete writes the row afresh (a
    forgotten worker heard again), an update of a deleted row finds none."""
    engine = create_store_engine(database_url)
    key = ("*", "feedback:w")

    def row(scale: float) -> dict:
        return {"tenant": "*", "kind": "feedback:w", "updated_at": NOW,
                "data": {"worker_id": "w", "pin_ask_scale": scale}}

    try:
        migrate(engine)

        async def scenario() -> None:
            writer = StoreWriter(engine, flush_interval_s=10, queue_max=100,
                                 on_drop=lambda *_: None)
            writer.upsert("learned_stats", key, row(0.5))
            await writer.flush()
            writer.delete("learned_stats", key)
            writer.upsert("learned_stats", key, row(0.75))  # heard again
            await writer.flush()
            assert _feedback_rows(engine) == {"w": 0.75}
            writer.delete("learned_stats", key)
            writer.update("learned_stats", key, {**row(0.9)})  # finds no row
            assert writer.queued == 1
            await writer.flush()
            assert _feedback_rows(engine) == {}
            # A batch kept for retry (the store away) under a newer write of the row.
            writer.upsert("learned_stats", key, row(0.5))
            await writer.flush()
            writer.delete("learned_stats", key)
            batch, writer._pending = writer._pending, {}
            writer.upsert("learned_stats", key, row(0.6))
            writer._requeue(batch)
            await writer.flush()
            assert _feedback_rows(engine) == {"w": 0.6}
            writer.upsert("learned_stats", key, row(0.7))
            batch, writer._pending = writer._pending, {}
            writer.delete("learned_stats", key)
            writer._requeue(batch)
            await writer.close()

        asyncio.run(scenario())
        assert _feedback_rows(engine) == {}
    finally:
        engine.dispose()
