"""The store's ``response_sessions`` (revision 0005: the session each stored Responses API
response was made in, for every replica), on SQLite and PostgreSQL: a store of the release
before (0004) gains the table and keeps every row, whether one router migrates it or
several replicas start on it together; the router's writes land in it and read back for
the tenant; retention deletes the rows older than ``store_retention_s``, counted in
``kvhint_router_store_pruned_rows_total{table="response_sessions"}``, and nothing newer,
and those older than ``responses.session_retention_s`` (never kept past
``store_retention_s``)."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory

from kvhint.router.store.database import alembic_config, create_store_engine, migrate
from kvhint.router.store.models import Base, ResponseSessionRow, SessionRow, WorkerRow
from kvhint.router.store.reader import get_response_session
from kvhint.router.store.retention import prune

from conftest import migrate_together, router_settings, running_router, sample, scrape
from test_service_store_forgotten_workers import _worker_row
from test_service_store_session_worker import _insert, _session, _sessions


# The revision a migration to the head leaves (0005 or a later one).
HEAD = ScriptDirectory.from_config(alembic_config("sqlite://")).get_current_head()


def _revision(engine: sa.Engine) -> str:
    with engine.connect() as conn:
        return conn.execute(sa.text("SELECT version_num FROM alembic_version")).scalar_one()


def _response_sessions(engine: sa.Engine) -> dict[str, tuple[str, str, float]]:
    """Response id -> (tenant, session, created_at) as stored."""
    with engine.connect() as conn:
        return {row.response_id: (row.tenant, row.session_id, row.created_at)
                for row in conn.execute(sa.select(ResponseSessionRow.__table__))}


def test_a_store_of_the_release_before_gains_the_table_and_keeps_its_rows(
        database_url: str) -> None:
    """At 0004, with a worker and sessions: the upgrade adds ``response_sessions`` (its
    key, its index, as the models say) and changes no row; again, nothing. Rows written
    to it read back by their id."""
    engine = create_store_engine(database_url)
    try:
        migrate(engine, "0004")
        assert "response_sessions" not in sa.inspect(engine).get_table_names()
        sessions = [_session("on-w0", "w0"), _session("none", None)]
        _insert(engine, [_worker_row("w0", True)], sessions)
        assert migrate(engine) is True
        assert migrate(engine) is True  # idempotent
        assert _revision(engine) == HEAD
        assert _sessions(engine) == {row["session_id"]: row for row in sessions}
        inspector = sa.inspect(engine)
        assert inspector.get_pk_constraint("response_sessions")["constrained_columns"] == [
            "response_id"]
        assert [(i["name"], i["column_names"]) for i in inspector.get_indexes(
            "response_sessions")] == [("ix_response_sessions_created", ["created_at"])]
        with engine.connect() as conn:
            diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
        assert diff == [], f"models and migrations disagree: {diff}"
        with engine.begin() as conn:
            conn.execute(sa.insert(ResponseSessionRow), [
                {"response_id": "resp_w0_x", "tenant": "acme", "session_id": "s" * 256,
                 "created_at": 1.0}])
        assert get_response_session(engine, "resp_w0_x", 1.0) == ("acme", "s" * 256)
        assert get_response_session(engine, "resp_w0_y", 1.0) is None
    finally:
        engine.dispose()


def test_replicas_upgrading_a_store_of_the_release_before_together(
        replica_engines: list[sa.Engine]) -> None:
    """Three replicas start together on a 0004 store: one migrates, the others find it
    current; every row kept."""
    engine = replica_engines[0]
    migrate(engine, "0004")
    _insert(engine, [_worker_row("w0", True)], [_session("on-w0", "w0")])
    assert migrate_together(replica_engines) == [True, True, True]
    assert _revision(engine) == HEAD
    assert list(_sessions(engine)) == ["on-w0"]
    assert _response_sessions(engine) == {}


async def test_retention_deletes_the_response_sessions_past_the_window_counted(
        tmp_path: Path, database_url: str) -> None:
    """The router's hourly retention: the row of a response made before the window goes,
    counted by table; the newer one, and the rest of the store, stay."""
    settings = router_settings(tmp_path, [], database_url=database_url)
    async with running_router(settings) as router, httpx.AsyncClient(timeout=30) as client:
        runtime = router.runtime
        now = time.time()
        old = now - settings.store_retention_s - 60.0
        gateway = router.app.state.responses
        gateway.sessions.remember("resp_new", "default", "agent")
        await runtime.writer.flush()
        with runtime.engine.begin() as conn:
            conn.execute(sa.insert(ResponseSessionRow), [
                {"response_id": "resp_old", "tenant": "default", "session_id": "agent",
                 "created_at": old}])
            conn.execute(sa.insert(SessionRow), [_session("agent", None)])
            conn.execute(sa.insert(WorkerRow), [_worker_row("cfg", True, old)])
        await runtime._prune_store()
        assert set(_response_sessions(runtime.engine)) == {"resp_new"}
        assert _response_sessions(runtime.engine)["resp_new"][:2] == ("default", "agent")
        assert list(_sessions(runtime.engine)) == ["agent"]
        samples = await scrape(client, router.url)
        assert sample(samples, "kvhint_router_store_pruned_rows_total",
                      table="response_sessions") == 1
        await runtime._prune_store()  # nothing more
        samples = await scrape(client, router.url)
        assert sample(samples, "kvhint_router_store_pruned_rows_total",
                      table="response_sessions") == 1


async def test_response_sessions_are_kept_their_own_retention_counted(
        tmp_path: Path, database_url: str) -> None:
    """``responses.session_retention_s`` (an hour here; the rest of history 7 days): the
    row of a response made more than an hour ago goes at the hourly retention, counted
    by table, though well within ``store_retention_s``; a younger one, and the session
    row as old, stay."""
    settings = router_settings(tmp_path, [], database_url=database_url,
                               responses={"session_retention_s": 3600.0})
    async with running_router(settings) as router, httpx.AsyncClient(timeout=30) as client:
        runtime = router.runtime
        now = time.time()
        with runtime.engine.begin() as conn:
            conn.execute(sa.insert(ResponseSessionRow), [
                {"response_id": "resp_old", "tenant": "default", "session_id": "agent",
                 "created_at": now - 3600.0 - 60.0},
                {"response_id": "resp_young", "tenant": "default", "session_id": "agent",
                 "created_at": now - 3600.0 + 60.0}])
            session = _session("agent", None)
            session["last_activity"] = now - 3600.0 - 60.0
            conn.execute(sa.insert(SessionRow), [session])
        await runtime._prune_store()
        assert set(_response_sessions(runtime.engine)) == {"resp_young"}
        assert list(_sessions(runtime.engine)) == ["agent"]
        samples = await scrape(client, router.url)
        assert sample(samples, "kvhint_router_store_pruned_rows_total",
                      table="response_sessions") == 1


async def test_response_sessions_are_kept_no_longer_than_the_rest_of_history(
        tmp_path: Path, database_url: str) -> None:
    """``responses.session_retention_s`` over ``store_retention_s`` (10 days, 1 day): the
    rows go past ``store_retention_s`` as the rest of history does, no later."""
    settings = router_settings(tmp_path, [], database_url=database_url,
                               store_retention_s=86_400.0,
                               responses={"session_retention_s": 10 * 86_400.0})
    async with running_router(settings) as router:
        runtime = router.runtime
        now = time.time()
        with runtime.engine.begin() as conn:
            conn.execute(sa.insert(ResponseSessionRow), [
                {"response_id": "resp_old", "tenant": "default", "session_id": "agent",
                 "created_at": now - 2 * 86_400.0},
                {"response_id": "resp_young", "tenant": "default", "session_id": "agent",
                 "created_at": now - 43_200.0}])
        await runtime._prune_store()
        assert set(_response_sessions(runtime.engine)) == {"resp_young"}


def test_prune_takes_the_later_of_the_two_cutoffs(database_url: str) -> None:
    """store.retention.prune: response sessions go before ``responses_before`` or
    ``before``, whichever is later; without ``responses_before``, before ``before``."""
    engine = create_store_engine(database_url)
    try:
        migrate(engine)
        rows = [{"response_id": f"resp_{at}", "tenant": "t", "session_id": "s",
                 "created_at": float(at)} for at in (100, 200, 300, 400)]
        with engine.begin() as conn:
            conn.execute(sa.insert(ResponseSessionRow), rows)
        assert prune(engine, before=150.0, responses_before=250.0).deleted[
            "response_sessions"] == 2
        assert set(_response_sessions(engine)) == {"resp_300", "resp_400"}
        assert prune(engine, before=350.0, responses_before=50.0).deleted[
            "response_sessions"] == 1
        assert prune(engine, before=450.0).deleted["response_sessions"] == 1
        assert _response_sessions(engine) == {}
    finally:
        engine.dispose()
