"""The router store on SQLite and PostgreSQL: migrations, batched writes, recovery."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
import time

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import Engine, inspect, text

from kvhint.router.store.database import create_store_engine, migrate
from kvhint.router.store.models import Base, HintActionRow, WorkerRow
from kvhint.router.store.reader import count_hints_by_status, load_recovery, query_hints
from kvhint.router.store.writer import StoreWriter

from conftest import migrate_together


def test_migrations_build_exactly_the_models(database_url: str) -> None:
    engine = create_store_engine(database_url)
    try:
        migrate(engine)
        migrate(engine)  # idempotent
        assert set(inspect(engine).get_table_names()) >= {
            "tenants", "workers", "sessions", "learned_stats", "hint_actions", "cursors",
            "alembic_version"}
        with engine.connect() as conn:
            diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
        assert diff == [], f"models and migrations disagree: {diff}"
    finally:
        engine.dispose()


def test_a_database_a_newer_router_migrated_is_used_as_it_is(
        database_url: str, caplog: pytest.LogCaptureFixture) -> None:
    """During a rolling upgrade (or a rollback) an older router restarts on a database a
    newer one migrated ahead. Before, alembic refused the unknown revision and the router
    crash-looped; now it runs on the newer schema (migrations only add)."""
    engine = create_store_engine(database_url)
    try:
        migrate(engine)
        with engine.begin() as conn:  # what a router with a revision 0099 leaves
            conn.execute(text("UPDATE alembic_version SET version_num = '0099'"))
        assert migrate(engine) is False
        assert any("newer than this router's" in r.getMessage() for r in caplog.records)
        with engine.connect() as conn:
            assert conn.execute(text("SELECT version_num FROM alembic_version")).scalar() == "0099"
        now = time.time()

        async def write() -> None:
            writer = StoreWriter(engine, flush_interval_s=0.01, queue_max=10,
                                 on_drop=lambda what, n: None)
            writer.start()
            writer.upsert("sessions", ("acme", "s1"), _session("s1", now, 1))
            await writer.close()

        asyncio.run(write())
        state = load_recovery(engine, active_since=now - 60, max_sessions=10)
        assert [s["turns"] for s in state.sessions] == [1]
    finally:
        engine.dispose()


def test_routers_starting_together_migrate_a_fresh_database_once(
        replica_engines: list[Engine]) -> None:
    """Replicas starting together on a fresh database: one migrates, the others find the
    schema current. Before, on PostgreSQL all but one failed on a duplicate key (or
    hung). Replicas share a PostgreSQL store; a SQLite file is one router's own."""
    migrate_together(replica_engines)
    assert "hint_actions" in inspect(replica_engines[0]).get_table_names()


def test_a_store_made_before_hold_releases_keeps_its_rows(database_url: str) -> None:
    """A router upgraded in place: its store at revision 0001 gains the release columns
    (0002), every row kept, the new columns empty until a worker reports a release."""
    engine = create_store_engine(database_url)
    try:
        migrate(engine, "0001")
        _add_worker(engine)
        with engine.begin() as conn:
            conn.execute(HintActionRow.__table__.insert().values(
                _action("old", "accepted", 1.0)))
        migrate(engine)
        (row,) = query_hints(engine)
        assert row["action_id"] == "old" and row["status"] == "accepted"
        assert (row["release_reason"], row["released_at"], row["held_after_release_blocks"]) \
            == (None, None, None)
    finally:
        engine.dispose()


def _action(action_id: str, status: str, at: float) -> dict:
    return {"action_id": action_id, "message_id": "m1", "tenant": "acme", "session_id": "s1",
            "worker_id": "w0", "action_type": "kv.pin", "source": "planner",
            "trigger": "gap:search:pin", "payload": {"ttl_s": 30.0}, "status": status,
            "reason": "", "requested_blocks": 4, "requested_tokens": 0, "applied_blocks": 0,
            "applied_tokens": 0, "created_at": at, "updated_at": at}


def _session(session_id: str, at: float, turns: int) -> dict:
    return {"tenant": "acme", "session_id": session_id, "worker_id": "w0", "turns": turns,
            "created_at": at, "last_activity": at, "ended_at": None, "state": "active",
            "open_gap": {"tools": ["search"], "started_at": at, "worker_id": "w0"},
            "tool_gap_stats": {"gaps": []}, "plan": None, "prompt_tokens": 10,
            "cached_tokens": 5, "predicted_cached_tokens": 4}


def _add_worker(engine, worker_id: str = "w0") -> None:  # noqa: ANN001 - an Engine
    """The row of the (configured) worker the test's actions went to: an action's row
    needs its worker's (revision 0003's foreign key)."""
    with engine.begin() as conn:
        conn.execute(WorkerRow.__table__.insert().values(
            worker_id=worker_id, url=f"http://{worker_id}", from_config=True))


def test_batched_writes_collapse_and_recover(database_url: str) -> None:
    engine = create_store_engine(database_url)
    drops: list[str] = []
    try:
        migrate(engine)
        _add_worker(engine)

        async def scenario() -> None:
            writer = StoreWriter(engine, flush_interval_s=0.05, queue_max=3,
                                 on_drop=lambda what, n: drops.append(what))
            writer.start()
            now = time.time()
            for turn in range(1, 6):  # five updates of one row: one row write
                writer.upsert("sessions", ("acme", "s1"), _session("s1", now, turn))
            writer.upsert("hint_actions", ("a1",), _action("a1", "pending", now))
            writer.upsert("hint_actions", ("a2",), _action("a2", "pending", now))
            assert writer.queued == 3
            writer.upsert("hint_actions", ("a3",), _action("a3", "pending", now))  # dropped
            await asyncio.sleep(0.3)
            assert writer.queued == 0 and writer.rows_written == 3
            # An outcome updates only some columns of an existing row.
            writer.update("hint_actions", ("a2",), {"action_id": "a2", "status": "accepted",
                                                    "applied_blocks": 4, "updated_at": now + 1})
            await writer.close()

        asyncio.run(scenario())
        assert drops == ["store_write"]
        state = load_recovery(engine, active_since=time.time() - 60, max_sessions=10)
        assert [s["turns"] for s in state.sessions] == [5]
        assert state.sessions[0]["open_gap"]["tools"] == ["search"]
        assert [a["action_id"] for a in state.pending_actions] == ["a1"]
        accepted = query_hints(engine, status="accepted")
        assert accepted[0]["applied_blocks"] == 4 and accepted[0]["requested_blocks"] == 4
        assert count_hints_by_status(engine) == {"pending": 1, "accepted": 1}
    finally:
        engine.dispose()


def test_a_row_the_database_refuses_is_dropped_and_the_rest_written(
        database_url: str) -> None:
    """A row the database refuses (here NULL in a NOT NULL column; on PostgreSQL also an
    id longer than its column) is dropped and counted; the rows beside it, and every
    later write, still land. Before, the batch was retried whole forever. So is a row
    whose value cannot even be serialised. Before, on SQLite (a StatementError) it too
    held every later write back; on PostgreSQL psycopg's TypeError ended the writer's
    loop, so nothing was written again."""
    engine = create_store_engine(database_url)
    drops: list[tuple[str, int]] = []
    try:
        migrate(engine)
        _add_worker(engine)
        long_id = "x" * 200  # the column is 128 characters; SQLite does not enforce it
        refused = 4 if engine.dialect.name == "postgresql" else 3

        async def scenario() -> None:
            writer = StoreWriter(engine, flush_interval_s=0.05, queue_max=100,
                                 on_drop=lambda what, n: drops.append((what, n)))
            now = time.time()
            writer.upsert("hint_actions", ("good",), _action("good", "pending", now))
            writer.upsert("hint_actions", ("null",),
                          {**_action("null", "pending", now), "message_id": None})
            writer.upsert("hint_actions", (long_id,), _action(long_id, "pending", now))
            writer.upsert("hint_actions", ("set",),
                          {**_action("set", "pending", now), "payload": {"ids": {1, 2}}})
            # An int past 64 bits (a worker's outcome can carry one): sqlite3 raises
            # OverflowError, which ended the writer's loop.
            writer.upsert("hint_actions", ("huge",),
                          {**_action("huge", "pending", now), "applied_tokens": 2**63})
            writer.upsert("sessions", ("acme", "s1"), _session("s1", now, 1))
            await writer.flush()
            assert writer.queued == 0 and writer.rows_written == 6 - refused
            writer.upsert("hint_actions", ("later",), _action("later", "pending", now))
            await writer.flush()
            assert writer.queued == 0 and writer.rows_written == 7 - refused

        asyncio.run(scenario())
        assert drops == [("store_row_rejected", refused)]
        ids = {row["action_id"] for row in query_hints(engine)}
        assert {"good", "later"} <= ids and "null" not in ids
        state = load_recovery(engine, active_since=time.time() - 60, max_sessions=10)
        assert [s["session_id"] for s in state.sessions] == ["s1"]
    finally:
        engine.dispose()


def test_rows_the_schema_cannot_take_are_kept_until_it_can(database_url: str) -> None:
    """A column the router writes is missing (a schema not migrated to this release,
    one dropped by hand): every row fails the same way until the store is fixed, then
    all pass, so the batch is kept for retry, nothing dropped. Before, on PostgreSQL (an
    UndefinedColumn, a ProgrammingError) each row was written alone, logged and dropped
    at once; SQLite's (an OperationalError) was kept."""
    engine = create_store_engine(database_url)
    drops: list[tuple[str, int]] = []
    try:
        migrate(engine)
        with engine.begin() as conn:
            conn.execute(text("ALTER TABLE sessions RENAME COLUMN plan TO plan_gone"))

        async def scenario() -> None:
            writer = StoreWriter(engine, flush_interval_s=10, queue_max=100,
                                 on_drop=lambda what, n: drops.append((what, n)))
            for session_id in ("s1", "s2"):
                writer.upsert("sessions", ("acme", session_id), _session(session_id, 1.0, 1))
            await writer.flush()
            assert writer.queued == 2 and writer.flush_errors == 1
            with engine.begin() as conn:  # the operator fixes the schema
                conn.execute(text("ALTER TABLE sessions RENAME COLUMN plan_gone TO plan"))
            await writer.close()
            assert writer.rows_written == 2

        asyncio.run(scenario())
        assert drops == []
        state = load_recovery(engine, active_since=0.0, max_sessions=10)
        assert sorted(s["session_id"] for s in state.sessions) == ["s1", "s2"]
    finally:
        engine.dispose()


def test_recovery_loads_the_holds_still_live_oldest_first(database_url: str) -> None:
    engine = create_store_engine(database_url)
    try:
        migrate(engine)
        _add_worker(engine)
        rows = [  # (id, status, type, expires_at, created_at)
            ("live-retain", "accepted", "kv.retain", 200.0, 2.0),
            ("live-pin", "clipped", "kv.pin", 150.0, 1.0),
            ("over", "accepted", "kv.retain", 90.0, 3.0),  # TTL over at 100
            ("refused", "rejected", "kv.pin", 200.0, 4.0),
            ("demote", "accepted", "kv.demote", 200.0, 5.0),
            ("waiting", "pending", "kv.retain", 200.0, 6.0),
            ("old-row", "accepted", "kv.retain", None, 7.0),  # from before expires_at
        ]
        with engine.begin() as conn:
            for action_id, status, type_, expires_at, at in rows:
                conn.execute(HintActionRow.__table__.insert().values(
                    _action(action_id, status, at) | {"action_type": type_,
                                                      "expires_at": expires_at}))
        state = load_recovery(engine, active_since=0.0, max_sessions=10, now=100.0)
        assert [a["action_id"] for a in state.held_actions] == ["live-pin", "live-retain"]
        assert [a["action_id"] for a in state.pending_actions] == ["waiting"]
        assert load_recovery(engine, active_since=0.0, max_sessions=10).held_actions == []
    finally:
        engine.dispose()


def test_failed_flush_keeps_the_batch(tmp_path) -> None:
    engine = create_store_engine(f"sqlite:///{tmp_path / 'not-migrated.db'}")

    async def scenario() -> StoreWriter:
        writer = StoreWriter(engine, flush_interval_s=10, queue_max=100, on_drop=lambda *_: None)
        writer.upsert("hint_actions", ("a1",), _action("a1", "pending", 1.0))
        await writer.flush()  # no tables yet: fails, keeps the row
        assert writer.flush_errors == 1 and writer.queued == 1
        migrate(engine)
        _add_worker(engine)
        await writer.flush()
        assert writer.queued == 0 and writer.rows_written == 1
        return writer

    try:
        asyncio.run(scenario())
    finally:
        engine.dispose()


@pytest.mark.parametrize("url", ["postgresql://postgres@127.0.0.1/x", "postgres://u@h/d"])
def test_plain_postgres_urls_use_psycopg(url: str) -> None:
    from kvhint.router.service.settings import RouterSettings

    assert RouterSettings(database_url=url).database_url.startswith("postgresql+psycopg://")


def test_closing_waits_for_a_flush_in_progress_so_the_newest_row_wins(tmp_path) -> None:
    """A flush blocked in its thread (another connection holds SQLite's write lock) when
    the router shuts down: close() lets it finish, then writes the newer value. Before,
    close() cancelled the flush while its thread went on, and the older batch committed
    after the newer one (10 times out of 10)."""
    path = tmp_path / "kvhint.db"
    engine = create_store_engine(f"sqlite:///{path}")
    migrate(engine)

    async def scenario() -> None:
        writer = StoreWriter(engine, flush_interval_s=0.01, queue_max=100,
                             on_drop=lambda *_: None)
        locker = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        locker.execute("BEGIN IMMEDIATE")
        writer.start()
        writer.upsert("sessions", ("acme", "s1"), _session("s1", 1.0, 1))
        await asyncio.sleep(0.2)  # the loop took turn 1 and is blocked writing it
        assert writer.queued == 0
        writer.upsert("sessions", ("acme", "s1"), _session("s1", 1.0, 2))
        threading.Timer(0.5, locker.rollback).start()
        await writer.close()

    try:
        asyncio.run(scenario())
        state = load_recovery(engine, active_since=0.0, max_sessions=10)
        assert [s["turns"] for s in state.sessions] == [2]
    finally:
        engine.dispose()


def test_closing_retries_a_store_that_is_away_then_counts_what_it_drops(tmp_path) -> None:
    """At shutdown the store is briefly away (here: its tables are not there yet): close()
    retries until it is back. One that stays away past the retry time has its rows
    dropped and counted (before: dropped silently, logged as 'kept for retry')."""
    engine = create_store_engine(f"sqlite:///{tmp_path / 'late.db'}")
    drops: list[tuple[str, int]] = []

    async def scenario() -> None:
        writer = StoreWriter(engine, flush_interval_s=10, queue_max=100,
                             on_drop=lambda what, n: drops.append((what, n)))
        writer.upsert("hint_actions", ("a1",), _action("a1", "pending", 1.0))
        loop = asyncio.get_running_loop()
        loop.call_later(0.3, lambda: (migrate(engine), _add_worker(engine)))  # it is back
        await writer.close()
        assert writer.queued == 0 and writer.rows_written == 1 and writer.flush_errors >= 1
        gone = StoreWriter(create_store_engine(f"sqlite:///{tmp_path / 'gone.db'}"),
                           flush_interval_s=10, queue_max=100,
                           on_drop=lambda what, n: drops.append((what, n)))
        gone.upsert("hint_actions", ("a2",), _action("a2", "pending", 1.0))
        gone.upsert("hint_actions", ("a3",), _action("a3", "pending", 1.0))
        await gone.close(retry_for_s=0.5)
        assert gone.queued == 0

    try:
        asyncio.run(scenario())
        assert [a["action_id"] for a in query_hints(engine)] == ["a1"]
        assert drops == [("store_write", 2)]
    finally:
        engine.dispose()


def test_an_answer_to_another_replicas_action_lands_in_its_row(database_url: str) -> None:
    """Replicas share the outcome stream and its stored cursor: while replica A is down,
    replica B reads the answer to A's pending action and moves the cursor past it. B now
    writes that answer to the action's row, so A restarted finds it answered instead of
    waiting for it until it expires. An answer to an action no replica stored writes
    nothing."""
    from kvhint.router.policy import PlannerConfig
    from kvhint.router.service.hint_dispatch import HintDispatcher
    from kvhint.router.service.metrics import RouterMetrics
    from kvhint.router.service.workers import WorkerRegistry
    from kvhint.schemas import Amount, HintOutcome, OutcomeStatus, Subjects

    engine = create_store_engine(database_url)
    try:
        migrate(engine)
        _add_worker(engine)
        with engine.begin() as conn:  # replica A's action, sent before it went down
            conn.execute(HintActionRow.__table__.insert().values(
                _action("a-pin", "pending", time.time())))

        async def replica_b() -> None:
            writer = StoreWriter(engine, flush_interval_s=10, queue_max=100,
                                 on_drop=lambda *_: None)
            hints = HintDispatcher(None, Subjects("t"), WorkerRegistry([]), writer,
                                   RouterMetrics(), PlannerConfig(), seed=1)
            for action_id in ("a-pin", "nobody's"):
                assert hints.on_outcome(HintOutcome(
                    message_id="m1", action_id=action_id, action_type="kv.pin",
                    worker_id="w0", status=OutcomeStatus.CLIPPED, reason="budget",
                    requested=Amount(blocks=4), applied=Amount(blocks=2),
                    at=time.time())) is None
            await writer.close()

        asyncio.run(replica_b())
        (row,) = query_hints(engine)
        assert (row["action_id"], row["status"], row["reason"], row["applied_blocks"]) == (
            "a-pin", "clipped", "budget", 2)
        state = load_recovery(engine, active_since=0.0, max_sessions=10)
        assert state.pending_actions == []
    finally:
        engine.dispose()


def test_history_past_the_retention_window_is_deleted_and_nothing_else(
        database_url: str) -> None:
    """Only history goes: answered actions created before the window (not one pending,
    nor a hold whose TTL is not over), sessions idle since before it, heartbeat-learned
    workers not heard since; configured workers and everything newer stay."""
    from kvhint.router.store.models import SessionRow
    from kvhint.router.store.retention import prune_history

    engine = create_store_engine(database_url)
    try:
        migrate(engine)
        _add_worker(engine)
        old, new = 100.0, 10_000.0
        with engine.begin() as conn:
            insert = HintActionRow.__table__.insert()
            conn.execute(insert.values(_action("old-done", "accepted", old)
                                       | {"expires_at": old + 60}))
            conn.execute(insert.values(_action("old-pending", "pending", old)))
            conn.execute(insert.values(_action("old-still-held", "accepted", old)
                                       | {"expires_at": new + 60}))
            conn.execute(insert.values(_action("old-no-expiry", "rejected", old)))
            conn.execute(insert.values(_action("new-done", "accepted", new)))
            conn.execute(SessionRow.__table__.insert().values(_session("old-s", old, 3)))
            conn.execute(SessionRow.__table__.insert().values(_session("new-s", new, 3)))
            for worker_id, configured, heard in (("gone", False, old), ("cfg", True, old),
                                                 ("live", False, new)):
                conn.execute(WorkerRow.__table__.insert().values(
                    worker_id=worker_id, url="http://x:1", from_config=configured,
                    last_seen=heard))
        assert prune_history(engine, before=5_000.0) == {
            "hint_actions": 2, "learned_stats": 0,
            "response_sessions": 0, "sessions": 1, "workers": 1}
        assert sorted(a["action_id"] for a in query_hints(engine)) == [
            "new-done", "old-pending", "old-still-held"]
        state = load_recovery(engine, active_since=0.0, max_sessions=10)
        assert [s["session_id"] for s in state.sessions] == ["new-s"]
        assert sorted(w["worker_id"] for w in state.workers) == ["cfg", "live", "w0"]
        assert prune_history(engine, before=5_000.0) == {
            "hint_actions": 0, "learned_stats": 0,
            "response_sessions": 0, "sessions": 0, "workers": 0}
    finally:
        engine.dispose()


def test_a_postgresql_that_does_not_answer_fails_after_the_connect_timeout() -> None:
    """A server that accepts the TCP connection and never answers (a stalled host, a
    proxy with nothing behind it): the connection attempt fails after the store's
    connect timeout. Before, there was none and libpq waited forever, so the router's
    start (migrations, recovery) hung with it. A local listener stands in for the stalled
    server: a real PostgreSQL cannot be made to stall on cue."""
    import socket

    from sqlalchemy.exc import OperationalError

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    port = listener.getsockname()[1]
    engine = create_store_engine(f"postgresql+psycopg://kvhint@127.0.0.1:{port}/test",
                                 connect_timeout_s=2)
    outcome: list[BaseException | None] = []

    def connect() -> None:
        try:
            engine.connect().close()
            outcome.append(None)
        except OperationalError as exc:
            outcome.append(exc)

    started = time.monotonic()
    thread = threading.Thread(target=connect, daemon=True)
    thread.start()
    thread.join(30)
    try:
        assert outcome, "the connection attempt still waits after 30 s"
        assert isinstance(outcome[0], OperationalError)
        assert time.monotonic() - started < 15
    finally:
        listener.close()
        engine.dispose()
