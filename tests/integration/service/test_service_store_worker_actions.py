"""A worker's hint actions leave the store with its row, on SQLite and PostgreSQL: the
foreign key (revision 0003, ON DELETE CASCADE) for every way a worker's row is deleted
(the feed forgets it, a restart finds it gone, retention prunes it), the rows a store of
the release before was left with deleted by the migration, and the router's memory
agreeing (a forgotten worker's waiting actions expire with it, a gone worker's actions
are not restored). Before, the action rows stayed for good: a restart restored the gone
worker's holds against its tenant's budget."""

from __future__ import annotations

import asyncio
import concurrent.futures
import time

import sqlalchemy as sa

from kvhint.router.kv_index import InMemoryClusterKvIndex, KvEventIngestor
from kvhint.router.kv_index.stream import StreamConfig
from kvhint.router.policy import Holdings, PlannerConfig
from kvhint.router.service.cluster_feed import ClusterFeed
from kvhint.router.service.hint_dispatch import OUTCOME_DEADLINE_S, HintDispatcher
from kvhint.router.service.metrics import RouterMetrics
from kvhint.router.service.runtime import _restore_workers
from kvhint.router.service.workers import WorkerRegistry
from kvhint.router.store.database import create_store_engine, migrate
from kvhint.router.store.models import (
    FEEDBACK_KIND_PREFIX,
    FEEDBACK_TENANT,
    HintActionRow,
    LearnedStatsRow,
    WorkerRow,
)
from kvhint.router.store.reader import load_recovery, query_hints
from kvhint.router.store.retention import prune_history
from kvhint.router.store.writer import StoreWriter
from kvhint.schemas import Subjects

from conftest import migrate_together
from store_helpers import forget_then_restart, insert_rows, recording_writer
from test_service_store_forgotten_workers import _heartbeat, _Unconnected, _worker_row

NOW = time.time()


def _action(action_id: str, worker_id: str, status: str = "accepted") -> dict:
    """A Retain of 600 s sent 10 s ago (held until 590 s from now), as the router stores
    it. Now is read at the call, not at import: a router a test starts expires holds by
    the real clock, and a full suite reaches some tests more than 590 s after importing
    this module (a clean-clone CI run: the pruned-worker test restored expired Retains)."""
    now = time.time()
    scope = f"acme/{action_id}"
    return {"action_id": action_id, "message_id": "m1", "tenant": "acme",
            "session_id": action_id, "worker_id": worker_id, "action_type": "kv.retain",
            "source": "planner", "trigger": "gap",
            "payload": {"target": {"session_id": scope}, "ttl_s": 600.0}, "status": status,
            "reason": "", "requested_blocks": 8, "requested_tokens": 0,
            "applied_blocks": 8 if status == "accepted" else 0, "applied_tokens": 0,
            "created_at": now - 10, "updated_at": now - 10, "scope": scope,
            "expires_at": now + 590}


def _insert(engine: sa.Engine, workers: list[dict], actions: list[dict]) -> None:
    """Rows as the store's tables are at the engine's revision (reflected)."""
    insert_rows(engine, workers=workers, hint_actions=actions)


def _action_workers(engine: sa.Engine) -> dict[str, str]:
    """Action id -> its worker, of every stored action."""
    return {row["action_id"]: row["worker_id"] for row in query_hints(engine, limit=1000)}


def _orphans(engine: sa.Engine) -> int:
    """Action rows whose worker has no row."""
    actions, workers = HintActionRow.__table__, WorkerRow.__table__
    with engine.connect() as conn:
        return conn.execute(sa.select(sa.func.count()).select_from(actions).where(
            ~sa.exists().where(workers.c.worker_id == actions.c.worker_id))).scalar_one()


def test_a_store_of_the_release_before_keeps_every_row_but_gone_workers_actions(
        database_url: str) -> None:
    """A store at 0002 whose worker "gone" was deleted, its actions left behind: the
    upgrade deletes those (the constraint could not hold otherwise) and keeps every
    other row as it was; then deleting a worker deletes its actions. Migrating again
    changes nothing."""
    engine = create_store_engine(database_url)
    try:
        migrate(engine, "0002")
        kept = [_action("a-w0", "w0") | {"release_reason": "displaced",
                                         "released_at": NOW - 1,
                                         "held_after_release_blocks": 3},
                _action("a-w1", "w1", "pending")]
        _insert(engine, [_worker_row("w0", True), _worker_row("w1", False, NOW - 5, "e1")],
                kept + [_action("left-behind", "gone")])
        assert _orphans(engine) == 1
        migrate(engine)
        migrate(engine)  # idempotent
        assert _orphans(engine) == 0
        rows = {row["action_id"]: row for row in query_hints(engine)}
        assert {r["action_id"]: {k: rows[r["action_id"]][k] for k in r} for r in kept} == {
            r["action_id"]: r for r in kept}
        assert set(rows) == {"a-w0", "a-w1"}
        (key,) = sa.inspect(engine).get_foreign_keys("hint_actions")
        assert (key["constrained_columns"], key["referred_table"], key["options"]) == (
            ["worker_id"], "workers", {"ondelete": "CASCADE"})
        with engine.begin() as conn:
            conn.execute(sa.delete(WorkerRow).where(WorkerRow.worker_id == "w1"))
        assert _action_workers(engine) == {"a-w0": "w0"}
    finally:
        engine.dispose()


def test_replicas_upgrading_a_store_together_migrate_it_once(
        replica_engines: list[sa.Engine]) -> None:
    """Three replicas of the new release start together on a 0002 store with rows left
    behind: one migrates (deleting them, adding the key), the others find it current."""
    engine = replica_engines[0]
    migrate(engine, "0002")
    _insert(engine, [_worker_row("w0", True)],
            [_action("a-w0", "w0"), _action("left-behind", "gone")])
    assert migrate_together(replica_engines) == [True, True, True]
    assert _action_workers(engine) == {"a-w0": "w0"}
    assert len(sa.inspect(engine).get_foreign_keys("hint_actions")) == 1


def test_every_connection_to_a_sqlite_store_enforces_the_key(tmp_path) -> None:  # noqa: ANN001
    """SQLite enforces foreign keys only on a connection that turns them on: each one
    the store opens does (two at once: the writer's thread and an admin read), and the
    one a migration used (off while migrating) is back on."""
    engine = create_store_engine(f"sqlite:///{tmp_path / 'kvhint.db'}")
    try:
        migrate(engine)
        with engine.connect() as first, engine.connect() as second:
            assert [conn.exec_driver_sql("PRAGMA foreign_keys").scalar()
                    for conn in (first, second)] == [1, 1]
    finally:
        engine.dispose()


def test_each_way_a_workers_row_goes_takes_its_actions(database_url: str) -> None:
    """"forgotten" (the writer's delete: the feed forgot it), "dropped" (a restart's
    registry does not hold it) and "pruned" (retention: not heard within the window)
    lose their actions with their rows, pending and held alike; "kept" keeps its own.
    Retention counts the actions it deleted with the workers."""
    engine = create_store_engine(database_url)
    drops: list[tuple[str, int]] = []
    try:
        migrate(engine)
        _insert(engine, [_worker_row("kept", True, NOW), _worker_row("forgotten", False, NOW),
                         _worker_row("dropped", True, NOW),
                         _worker_row("pruned", False, NOW - 7200.0)],
                [_action(f"{worker}-{status}", worker, status)
                 for worker in ("kept", "forgotten", "dropped", "pruned")
                 for status in ("accepted", "pending")])
        forget_then_restart(engine, drops, NOW)
        assert set(_action_workers(engine).values()) == {"kept", "pruned"}
        assert prune_history(engine, before=NOW - 3600) == {
            "hint_actions": 2, "learned_stats": 0,
            "response_sessions": 0, "sessions": 0, "workers": 1}
        assert _action_workers(engine) == {"kept-accepted": "kept", "kept-pending": "kept"}
        assert _orphans(engine) == 0 and drops == []
    finally:
        engine.dispose()


def _waiting_for_a_lock(engine: sa.Engine) -> int:
    """PostgreSQL sessions of this database waiting for a lock (a row another holds)."""
    with engine.connect() as conn:
        return conn.execute(sa.text(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND wait_event_type = 'Lock'")).scalar_one()


def test_a_worker_heard_while_retention_prunes_it_keeps_its_actions_and_feedback(
        database_url: str) -> None:
    """Retention finds "heard" not heard within the window while a heartbeat's update of
    its last_seen is written, not yet committed. Before, on PostgreSQL (READ COMMITTED),
    its actions and feedback row were deleted (each delete chose "not heard since"
    anew, and only its row's delete waited for the heartbeat), and its row was kept:
    heard, with neither. Now the prune waits for the heartbeat, finds the worker heard
    and deletes none of the three; "silent" goes with its action and feedback, counted
    as before."""
    engine = create_store_engine(database_url)
    try:
        migrate(engine)
        _insert(engine, [_worker_row("heard", False, NOW - 7200.0),
                         _worker_row("silent", False, NOW - 7200.0)],
                [_action("heard-held", "heard"), _action("heard-pending", "heard", "pending"),
                 _action("silent-held", "silent")])
        with engine.begin() as conn:
            conn.execute(LearnedStatsRow.__table__.insert(), [
                {"tenant": FEEDBACK_TENANT, "kind": FEEDBACK_KIND_PREFIX + worker,
                 "data": {"worker_id": worker}, "updated_at": NOW}
                for worker in ("heard", "silent")])
        # The heartbeat's connection closes (rolling back) before the pool waits for the
        # prune, should an assertion fail while the prune waits for it.
        with concurrent.futures.ThreadPoolExecutor(1) as pool, engine.connect() as beat:
            # Written, not committed: holds the worker's row (PostgreSQL) or the database's
            # write lock (SQLite: the prune then waits whatever it does first).
            beat.execute(sa.update(WorkerRow).where(WorkerRow.worker_id == "heard")
                         .values(last_seen=NOW))
            pruned = pool.submit(prune_history, engine, NOW - 3600.0)
            if database_url.startswith("postgresql"):
                deadline = time.monotonic() + 10.0
                while not _waiting_for_a_lock(engine):
                    assert time.monotonic() < deadline, "the prune never waited for the row"
                    assert not pruned.done(), pruned.result()
                    time.sleep(0.02)
            else:
                time.sleep(0.2)  # most likely waiting by now; the outcome is the same if not
            beat.commit()
            counts = pruned.result(timeout=60)
        assert counts == {"hint_actions": 1, "learned_stats": 1,
                          "response_sessions": 0, "sessions": 0, "workers": 1}
        assert _action_workers(engine) == {"heard-held": "heard", "heard-pending": "heard"}
        with engine.connect() as conn:
            assert conn.execute(sa.select(LearnedStatsRow.kind)).scalars().all() == [
                FEEDBACK_KIND_PREFIX + "heard"]
            assert conn.execute(sa.select(WorkerRow.worker_id)).scalars().all() == ["heard"]
    finally:
        engine.dispose()


def _dispatcher(engine: sa.Engine, registry: WorkerRegistry, metrics: RouterMetrics,
                drops: list[tuple[str, int]]) -> tuple[HintDispatcher, StoreWriter]:
    writer = recording_writer(engine, drops)
    return HintDispatcher(None, Subjects("t"), registry, writer, metrics, PlannerConfig(),
                          seed=1, tenants=("acme",)), writer


def test_a_forgotten_workers_waiting_actions_expire_with_it(database_url: str) -> None:
    """The feed forgets "gone" while an action it was sent waits for its answer: the
    action expires at once, saved in the batch that deletes the worker's row (and so
    its actions'). Before, it expired later, and its save (the row re-written after its
    worker's was deleted) was refused by the foreign key: dropped, logged, counted."""
    engine = create_store_engine(database_url)
    drops: list[tuple[str, int]] = []
    try:
        migrate(engine)
        _insert(engine, [_worker_row("gone", False, NOW), _worker_row("here", False, NOW)],
                [_action("waiting", "gone", "pending"), _action("answered", "here")])

        async def run() -> None:
            registry, metrics = WorkerRegistry([]), RouterMetrics()
            hints, writer = _dispatcher(engine, registry, metrics, drops)
            ingestor = KvEventIngestor(InMemoryClusterKvIndex(), clock=time.monotonic,
                                       config=StreamConfig(forget_dead_after_s=60.0))
            feed = ClusterFeed(_Unconnected(Subjects("t")), ingestor,  # type: ignore[arg-type]
                               registry, hints, metrics, writer, None, None,
                               snapshot_timeout_s=5.0,
                               on_hint_outcome=lambda _sent, _outcome: None,
                               on_hold_released=lambda _release: None)
            now = time.monotonic()
            for worker, heard in (("gone", now - 120.0), ("here", now)):
                registry.on_heartbeat(_heartbeat(worker), now=heard)
            recovery = load_recovery(engine, 0.0, 10, now=NOW)
            hints.restore([], recovery.pending_actions, recovery.held_actions)
            record = hints.pending["waiting"]
            feed.tick()  # forgets "gone"
            assert registry.get("gone") is None and not hints.pending
            assert (record.status, record.reason) == ("expired", "worker forgotten")
            await writer.flush()
            assert hints.expire(time.time() + OUTCOME_DEADLINE_S + 1) == 0
            await writer.close()
            assert metrics.hints.labels("kv.retain", "expired", "planner")._value.get() == 1

        asyncio.run(run())
        assert _action_workers(engine) == {"answered": "here"}
        assert drops == []
    finally:
        engine.dispose()


def test_a_restart_restores_no_action_of_a_worker_it_does_not_hold(
        database_url: str) -> None:
    """"dropped" left the config: at the restart its row goes, with its actions, and the
    router does not restore them either. Before, its held Retain counted against the
    tenant's budget until its TTL ended, and its pending one waited for an answer.
    Each action not restored is counted (drops_total what="hint_not_restored:..."):
    "dropped"'s two, and "kept"'s held Retain whose row does not say what it protects
    (its holding cannot be rebuilt). Before, none was."""
    engine = create_store_engine(database_url)
    drops: list[tuple[str, int]] = []
    metrics = RouterMetrics()
    try:
        migrate(engine)
        _insert(engine, [_worker_row("kept", True, NOW), _worker_row("dropped", True, NOW)],
                [_action("kept-held", "kept"), _action("dropped-held", "dropped"),
                 _action("dropped-pending", "dropped", "pending"),
                 _action("kept-unscoped", "kept") | {"scope": None}])

        async def restart() -> HintDispatcher:
            registry = WorkerRegistry([("kept", "http://kept")])
            hints, writer = _dispatcher(engine, registry, metrics, drops)
            recovery = load_recovery(engine, 0.0, 10, now=NOW)
            _restore_workers(registry, recovery.workers, NOW, forget_s=86_400.0,
                             writer=writer)
            hints.restore(recovery.learned, recovery.pending_actions, recovery.held_actions)
            await writer.close()
            return hints

        hints = asyncio.run(restart())
        assert hints.holdings.tenant("acme") == Holdings(0, 8)
        assert hints.holdings.worker("dropped") == Holdings(0, 0)
        assert not hints.pending
        assert _action_workers(engine) == {"kept-held": "kept", "kept-unscoped": "kept"}
        assert drops == []
        assert {what: metrics.drops.labels(what)._value.get() for what in (
            "hint_not_restored:worker_gone", "hint_not_restored:unscoped")} == {
            "hint_not_restored:worker_gone": 2, "hint_not_restored:unscoped": 1}
    finally:
        engine.dispose()
