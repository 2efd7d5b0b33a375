"""A rolling upgrade on PostgreSQL: a router of the release before revision 0006 saves a
session with a plain upsert that leaves ``sessions.revision`` as it is. Revision 0007's
trigger moves the revision on for such a save, so this release's replicas see it as
another replica's save: their own save merges it (a conflict) instead of writing over
the older router's turns, and their read before a turn merges it too. A worker row's
deletion (the foreign key's SET NULL) is not a save and moves nothing.

Before 0007, the newer replica's save found the row still at the revision it had read
and wrote its record over the older router's turns (here: 2 turns stored, not 4).

PostgreSQL only: replicas share a store there; a SQLite file is one router's own, and
its batch alterations would drop a trigger (the migration's docstring)."""

from __future__ import annotations

import asyncio
import time

import pytest
import sqlalchemy as sa

from kvhint.router.service.sessions import SessionRegistry
from kvhint.router.store.database import create_store_engine, migrate
from kvhint.router.store.models import SessionRow, WorkerRow
from kvhint.router.store.writer import StoreWriter

from store_helpers import insert_rows
from test_service_store_forgotten_workers import _worker_row
from test_service_store_session_worker import _session


@pytest.fixture
def engine(database_url: str):  # noqa: ANN201 - a fixture
    if not database_url.startswith("postgresql"):
        pytest.skip("routers share a PostgreSQL store; a SQLite file is one router's own")
    engine = create_store_engine(database_url)
    try:
        migrate(engine)
        yield engine
    finally:
        engine.dispose()


def _stored(engine: sa.Engine, session_id: str) -> dict:
    with engine.connect() as conn:
        return dict(conn.execute(sa.select(SessionRow.__table__).where(
            SessionRow.session_id == session_id)).mappings().one())


def _writer(engine: sa.Engine) -> StoreWriter:
    return StoreWriter(engine, flush_interval_s=3600, queue_max=100,
                       on_drop=lambda what, n: None)


async def _old_release_save(engine: sa.Engine, row: dict) -> None:
    """As the release before 0006 saved a session: the whole row, a plain upsert."""
    old = _writer(engine)
    old.upsert("sessions", (row["tenant"], row["session_id"]), row)
    await old.flush()


def test_a_save_of_the_release_before_is_merged_by_the_next_save(
        engine: sa.Engine) -> None:
    async def run() -> list[str]:
        conflicts: list[str] = []
        writer = _writer(engine)
        registry = SessionRegistry(writer, 100, on_conflict=conflicts.append)
        record = registry.open("acme", "s", time.time())
        record.turns = 1
        registry.save(record)
        await writer.flush()
        assert _stored(engine, "s")["revision"] == 0
        # The older router served turns 2 and 3 from the row it read (its own record).
        older = _stored(engine, "s") | {"turns": 3, "prompt_tokens": 300}
        await _old_release_save(engine, {k: v for k, v in older.items() if k != "revision"})
        assert _stored(engine, "s")["revision"] == 1
        # This replica's next turn, saved from its record of turn 1: merged, not written
        # over the older router's turns.
        record.turns += 1
        record.prompt_tokens += 100
        registry.save(record)
        await writer.flush()
        stored = _stored(engine, "s")
        assert (stored["turns"], stored["prompt_tokens"], stored["revision"]) == (4, 400, 2)
        assert record.turns == 4 and record.revision == 2
        return conflicts

    assert asyncio.run(run()) == ["merged"]


def test_the_read_before_a_turn_merges_a_save_of_the_release_before(
        engine: sa.Engine) -> None:
    async def run() -> None:
        writer = _writer(engine)
        registry = SessionRegistry(writer, 100)
        record = registry.open("acme", "r", time.time())
        record.turns = 2
        registry.save(record)
        await writer.flush()
        older = _stored(engine, "r") | {"turns": 5}
        await _old_release_save(engine, {k: v for k, v in older.items() if k != "revision"})
        assert registry.refresh(record, _stored(engine, "r")) is True
        assert record.turns == 5

    asyncio.run(run())


def test_a_save_that_changes_nothing_and_a_workers_deletion_move_no_revision(
        engine: sa.Engine) -> None:
    """The same row written again is no save of anything new; SET NULL of a deleted
    worker's sessions is not a save (a conflict per session would re-read rows that
    hold nothing new)."""
    insert_rows(engine, workers=[_worker_row("w0", True)],
                sessions=[_session("on-w0", "w0")])

    async def same_again() -> None:
        await _old_release_save(engine, _session("on-w0", "w0"))

    asyncio.run(same_again())
    assert _stored(engine, "on-w0")["revision"] == 0
    with engine.begin() as conn:
        conn.execute(sa.delete(WorkerRow).where(WorkerRow.worker_id == "w0"))
    stored = _stored(engine, "on-w0")
    assert (stored["worker_id"], stored["revision"]) == (None, 0)
