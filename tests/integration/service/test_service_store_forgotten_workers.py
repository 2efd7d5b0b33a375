"""A forgotten worker's feedback row, and its row in ``workers``, leave the store with it,
on SQLite and PostgreSQL: forgotten at run time (the registry forgot it: silent for good),
found gone at a restart (dropped from the config) or pruned by retention. And the
writer's deletes keep their place in its queue among the writes to the same row."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from sqlalchemy import select

from kvhint.router.kv_index import InMemoryClusterKvIndex, KvEventIngestor
from kvhint.router.kv_index.stream import StreamConfig
from kvhint.router.policy import PlannerConfig
from kvhint.router.policy.feedback import WorkerFeedback
from kvhint.router.policy.tenant_feedback import SplitFeedback
from kvhint.router.service.cluster_feed import ClusterFeed
from kvhint.router.service.hint_dispatch import HintDispatcher
from kvhint.router.service.metrics import RouterMetrics
from kvhint.router.service.runtime import _restore_workers
from kvhint.router.service.workers import WorkerRegistry
from kvhint.router.store.database import create_store_engine, migrate
from kvhint.router.store.models import LearnedStatsRow, WorkerRow
from kvhint.router.store.reader import load_recovery
from kvhint.router.store.retention import prune_history
from kvhint.router.store.writer import StoreWriter
from kvhint.schemas import Budgets, Subjects, Usage, WorkerStatus

NOW = 1_700_000_000.0


def _feedback_rows(engine) -> dict[str, float]:
    """Worker id -> the pin_ask_scale its stored feedback row says (tenant default's)."""
    with engine.connect() as conn:
        return {row.data["worker_id"]: row.data.get("tenants", {}).get(
                    "default", row.data)["pin_ask_scale"]
                for row in conn.execute(select(LearnedStatsRow.__table__))
                if row.kind.startswith("feedback:")}


def _scaled(worker: str, scale: float) -> SplitFeedback:
    """Feedback of ``worker`` whose pin ask scale for tenant default is ``scale``."""
    return SplitFeedback(worker, tenants={"default": WorkerFeedback(worker, pin_ask_scale=scale)})


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
                hints.feedback[worker] = _scaled(worker, 0.5)
            hints.save_learned(NOW)
            await writer.flush()
            assert _feedback_rows(engine) == {"kept": 0.5, "dropped": 0.5, "gone": 0.5}
            # Its feedback changed since (saved in the same batch as it is forgotten):
            # the delete, queued after, wins.
            hints.feedback["gone"] = _scaled("gone", 0.25)
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
            assert hints.feedback["kept"].view("default").pin_ask_scale == 0.5
            await writer.close()

        asyncio.run(restart())
        assert _feedback_rows(engine) == {"kept": 0.5}
    finally:
        engine.dispose()


def test_retention_deletes_a_pruned_workers_feedback_row_with_its_row(
        database_url: str) -> None:
    """Retention prunes "pruned" (heard only by heartbeats, not since the window): its
    feedback row goes in the same transaction as its row, as when the router forgets a
    worker, and is counted. Before, it stayed until a router's next start found its worker
    gone. "live" (heard since), "cfg" (configured, never pruned) and "pruned_2" (a name
    whose "_" a LIKE would match with "pruned" ones) keep theirs, and so do the tenants'
    statistics."""
    engine = create_store_engine(database_url)
    try:
        migrate(engine)
        with engine.begin() as conn:
            conn.execute(WorkerRow.__table__.insert(), [
                _worker_row("pruned", False, NOW - 7200.0), _worker_row("live", False, NOW),
                _worker_row("cfg", True, NOW - 7200.0), _worker_row("pruned_2", False, NOW)])

        async def run() -> None:
            hints, writer = _router(engine, [("cfg", "http://c")])
            for worker in ("pruned", "live", "pruned_2"):
                hints._workers.ensure(worker, f"http://{worker}")  # learnt from heartbeats
            for worker in ("pruned", "live", "cfg", "pruned_2"):
                hints.feedback[worker] = _scaled(worker, 0.5)
            hints.save_learned(NOW)
            writer.upsert("learned_stats", ("acme", "tenant_gaps"), {
                "tenant": "acme", "kind": "tenant_gaps", "data": {}, "updated_at": NOW})
            await writer.close()

        asyncio.run(run())
        assert set(_feedback_rows(engine)) == {"pruned", "live", "cfg", "pruned_2"}
        assert prune_history(engine, before=NOW - 3600.0) == {
            "hint_actions": 0, "learned_stats": 1,
            "response_sessions": 0, "sessions": 0, "workers": 1}
        assert _feedback_rows(engine) == {"live": 0.5, "cfg": 0.5, "pruned_2": 0.5}
        assert _worker_rows(engine) == {"live", "cfg", "pruned_2"}
        with engine.connect() as conn:
            assert conn.execute(select(LearnedStatsRow.kind).where(
                LearnedStatsRow.tenant == "acme")).scalars().all() == ["tenant_gaps"]
        assert prune_history(engine, before=NOW - 3600.0)["learned_stats"] == 0
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


def _worker_rows(engine) -> set[str]:
    with engine.connect() as conn:
        return {row.worker_id for row in conn.execute(select(WorkerRow.__table__))}


def _worker_row(worker_id: str, from_config: bool, last_seen: float | None = None,
                epoch: str | None = None) -> dict:
    """A ``workers`` row as the router writes it (runtime.py at start; the feed's
    heartbeats add last_seen and epoch)."""
    return {"worker_id": worker_id, "url": f"http://{worker_id}", "from_config": from_config,
            "last_seen": last_seen, "epoch": epoch}


def _heartbeat(worker_id: str) -> WorkerStatus:
    return WorkerStatus(
        worker_id=worker_id, epoch="e1", model="tiny", cache_namespace="ns", block_size=4,
        hash_algo="sha256", none_hash_seed="vllm-none-hash", supported_actions={},
        budgets=Budgets(max_pinned_blocks=50, max_pin_ttl_s=600, max_retained_blocks=200,
                        max_retain_ttl_s=3600),
        usage=Usage(gpu_blocks_total=100, gpu_blocks_free=100, kv_usage=0.0),
        interval_s=1.0, at=time.time(), http_url=f"http://{worker_id}")


@dataclass
class _Unconnected:
    """What the feed's tick reads of its NATS link (not connected: NATS is not needed)."""

    subjects: Subjects
    connected: bool = False


def test_a_worker_the_feed_forgets_loses_its_row_and_is_not_restored(
        database_url: str) -> None:
    """"gone" and "here" heartbeated (their rows written); "gone" fell silent past
    forget_dead_after_s and the feed's tick forgot it. Before, its row stayed, and a
    router restarted with session_forget_s longer than forget_dead_after_s (sessions kept
    a day, the events stream an hour) restored it: routed to, probed, listed again."""
    engine = create_store_engine(database_url)
    try:
        migrate(engine)

        async def run() -> None:
            subjects, registry, metrics = Subjects("t"), WorkerRegistry([]), RouterMetrics()
            writer = StoreWriter(engine, flush_interval_s=10, queue_max=100,
                                 on_drop=lambda *_: None)
            hints = HintDispatcher(None, subjects, registry, writer, metrics, PlannerConfig(),
                                   seed=1)
            ingestor = KvEventIngestor(InMemoryClusterKvIndex(), clock=time.monotonic,
                                       config=StreamConfig(forget_dead_after_s=60.0))
            feed = ClusterFeed(_Unconnected(subjects), ingestor, registry,  # type: ignore[arg-type]
                               hints, metrics, writer, None, None, snapshot_timeout_s=5.0,
                               on_hint_outcome=lambda _sent, _outcome: None,
                               on_hold_released=lambda _release: None)
            now = time.monotonic()
            for worker, heard in (("gone", now - 120.0), ("here", now)):
                registry.on_heartbeat(_heartbeat(worker), now=heard)
                writer.upsert("workers", (worker,), _worker_row(worker, False, time.time()))
            await writer.flush()
            assert _worker_rows(engine) == {"gone", "here"}
            feed.tick()
            assert registry.get("gone") is None and registry.get("here") is not None
            await writer.close()

        asyncio.run(run())
        assert _worker_rows(engine) == {"here"}
        registry = WorkerRegistry([])
        writer = StoreWriter(engine, flush_interval_s=10, queue_max=100,
                             on_drop=lambda *_: None)
        _restore_workers(registry, load_recovery(engine, 0.0, 10).workers, time.time(),
                         forget_s=86_400.0, writer=writer)
        assert [w.worker_id for w in registry.all()] == ["here"]
    finally:
        engine.dispose()


def test_a_restart_deletes_the_rows_of_workers_it_does_not_restore(database_url: str) -> None:
    """At a restart the registry holds the configured workers and those learned from
    heartbeats heard within session_forget_s; the rows of the others go: "dropped" (left
    out of the config: before, a configured worker's row stayed for good, retention
    prunes only heartbeat-learned ones) and "old" (silent too long to come back)."""
    engine = create_store_engine(database_url)
    now = time.time()
    try:
        migrate(engine)

        async def restart() -> WorkerRegistry:
            writer = StoreWriter(engine, flush_interval_s=10, queue_max=100,
                                 on_drop=lambda *_: None)
            for row in (_worker_row("kept", True, now - 5.0, "k1"),
                        _worker_row("dropped", True, now - 5.0),
                        _worker_row("recent", False, now - 60.0, "e7"),
                        _worker_row("old", False, now - 7200.0)):
                writer.upsert("workers", (row["worker_id"],), row)
            await writer.flush()
            assert _worker_rows(engine) == {"kept", "dropped", "recent", "old"}
            registry = WorkerRegistry([("kept", "http://kept")])
            _restore_workers(registry, load_recovery(engine, 0.0, 10).workers, now,
                             forget_s=3600.0, writer=writer)
            await writer.close()
            return registry

        registry = asyncio.run(restart())
        assert {w.worker_id: w.epoch for w in registry.all()} == {"kept": "k1", "recent": "e7"}
        assert _worker_rows(engine) == {"kept", "recent"}
    finally:
        engine.dispose()
