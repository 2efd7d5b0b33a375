"""A tick's due idle reviews read the store once (their rows' revisions), not once per
session: a session's row is read whole only where another replica saved it since the
record's revision (idle_reviews.py). Real router, real store (SQLite file, PostgreSQL),
real NATS, w0's plugin played by the test (every hint accepted); the statements are
counted with SQLAlchemy's own event hook on the router's engine.

Before, each due review read its session's row, one after another in the tick: on a
local PostgreSQL 300 due reviews took a tick from 17 ms to 1.5 s."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from pathlib import Path
from typing import Any

import httpx
import nats
import pytest
from conftest import StubWorker, router_settings, running_router
from feed_helpers import ACTIONS_WITH_OWNER, AcceptingPlugin, plugin_registered, status
from sqlalchemy import event

from kvhint.schemas import Subjects

pytestmark = pytest.mark.usefixtures("throwaway_streams")

SESSIONS = 20


async def test_a_tick_reads_its_due_reviews_rows_once(
        tmp_path: Path, nats_url: str, subject_prefix: str, database_url: str,
        stub_workers: list[StubWorker]) -> None:
    """20 sessions in a tool gap, all due for review, none saved by another replica:
    the tick reviews all 20 with one read of the sessions table (was 20); a row another
    replica saved since (its revision moved on in the store) is still read whole and
    merged in."""
    stub = stub_workers[0]
    stub.finish_reason, stub.tool_names = "tool_calls", ["search"]
    subjects = Subjects(subject_prefix)
    nc = await nats.connect(nats_url)
    plugin = AcceptingPlugin(nc, subjects)
    await nc.subscribe(subjects.hints("w0"), cb=plugin.on_hints)
    settings = router_settings(tmp_path, [("w0", stub.url)], nats_url=nats_url,
                               subject_prefix=subject_prefix, database_url=database_url,
                               store_flush_interval_s=3600.0, hints={"tick_s": 3600.0},
                               routing={"session_refresh": True})
    beating = None
    try:
        async with running_router(settings) as router, httpx.AsyncClient(timeout=30) as client:
            runtime = router.runtime
            await plugin_registered(runtime, nc, subjects, ACTIONS_WITH_OWNER)

            async def heartbeats() -> None:
                for seq in range(2, 1_000_000):
                    await asyncio.sleep(0.25)
                    await nc.publish(subjects.status("w0"),
                                     status("w0", "e1", seq, actions=ACTIONS_WITH_OWNER))

            beating = asyncio.create_task(heartbeats())
            runtime.hints.planner_config = dataclasses.replace(
                runtime.hints.planner_config, idle_review_first_s=0.5,
                return_window_s=600.0, abandon_after_s=3600.0)
            for i in range(SESSIONS):
                response = await client.post(f"{router.url}/v1/chat/completions", json={
                    "model": "stub", "session_id": f"s{i}",
                    "messages": [{"role": "user", "content": f"s{i}: " + "x" * 400}]})
                assert response.status_code == 200, response.text
            await runtime.writer.flush()
            # Another replica's save of s0 since this router's (its revision moved on).
            await asyncio.to_thread(_bump_revision, runtime.engine, "default", "s0")
            statements: list[str] = []

            def seen(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
                if "FROM sessions" in statement:
                    statements.append(statement)

            await asyncio.sleep(0.6)  # every session's first review due
            event.listen(runtime.engine, "before_cursor_execute", seen)
            try:
                started = time.monotonic()
                await runtime.lifecycle.tick()
                took = time.monotonic() - started
            finally:
                event.remove(runtime.engine, "before_cursor_execute", seen)
            records = [runtime.sessions.get("default", f"s{i}") for i in range(SESSIONS)]
            assert all(r is not None and r.idle_reviewed_at is not None for r in records)
            # One read of all the revisions, one of s0's row (saved elsewhere).
            assert len(statements) == 2, (took, statements)
            assert records[0].revision == _stored_revision(runtime.engine, "default", "s0")
    finally:
        if beating is not None:
            beating.cancel()
        await nc.drain()


def _bump_revision(engine: Any, tenant: str, session_id: str) -> None:
    from sqlalchemy import update

    from kvhint.router.store.models import SessionRow

    with engine.begin() as conn:
        conn.execute(update(SessionRow).where(SessionRow.tenant == tenant,
                                              SessionRow.session_id == session_id)
                     .values(revision=SessionRow.revision + 1))


def _stored_revision(engine: Any, tenant: str, session_id: str) -> int:
    from sqlalchemy import select

    from kvhint.router.store.models import SessionRow

    with engine.connect() as conn:
        return conn.execute(select(SessionRow.revision).where(
            SessionRow.tenant == tenant, SessionRow.session_id == session_id)).scalar_one()


def test_the_revisions_read_spans_tenants_and_chunks(database_url: str) -> None:
    """1,200 sessions of two tenants (more than one statement's 500 ids each), one with
    no row: each stored row's revision, under its own tenant only."""
    from sqlalchemy import insert

    from kvhint.router.store.database import create_store_engine, migrate
    from kvhint.router.store.models import SessionRow
    from kvhint.router.store.reader import session_revisions_within

    engine = create_store_engine(database_url)
    try:
        migrate(engine)
        rows = [{"tenant": tenant, "session_id": f"s{i}", "created_at": 1.0,
                 "last_activity": 1.0, "revision": i % 7}
                for tenant in ("a", "b") for i in range(600)]
        with engine.begin() as conn:
            conn.execute(insert(SessionRow), rows)
        keys = [(tenant, f"s{i}") for tenant in ("a", "b") for i in range(600)]
        keys += [("a", "missing"), ("c", "s1")]
        found = session_revisions_within(engine, keys, 5.0)
        assert len(found) == 1_200
        assert all(found[(t, f"s{i}")] == i % 7 for t in ("a", "b") for i in range(600))
    finally:
        engine.dispose()
