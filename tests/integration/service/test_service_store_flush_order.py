"""The order of a flush's writes, on SQLite and PostgreSQL: a new worker's row and the
rows that name it (a session's first save, versioned; a hint action) queued between two
flushes are written in one batch, the worker's row first, whatever order they were
queued in; so the session keeps its worker and the action is stored. Before, the
versioned session rows went before every plain upsert: a session first saved in the same
batch as its worker's row found no row there and was written with no worker (the
writer's guard for a gone worker), and a restart restored it with ``worker_id`` None
(test_service_gateway_sessions.py::test_sessions_survive_a_restart, 1 run in 4). The
rows written one by one (a batch the database refused a row of) go in the same order."""

from __future__ import annotations

import asyncio
import time

import sqlalchemy as sa

from kvhint.router.service.sessions import SessionRegistry
from kvhint.router.store.database import create_store_engine, migrate
from kvhint.router.store.models import HintActionRow, SessionRow

from store_helpers import recording_writer
from test_service_store_forgotten_workers import _worker_row
from test_service_store_worker_actions import _action


def _stored(engine: sa.Engine) -> tuple[dict[str, str | None], dict[str, str]]:
    """Session id -> its worker; action id -> its worker."""
    with engine.connect() as conn:
        sessions = {r.session_id: r.worker_id
                    for r in conn.execute(sa.select(SessionRow.__table__))}
        actions = {r.action_id: r.worker_id
                   for r in conn.execute(sa.select(HintActionRow.__table__))}
    return sessions, actions


def _queue_new_worker(writer, registry: SessionRegistry, worker_id: str,
                      worker_first: bool) -> None:
    """A session's first turn on a worker the store has no row of yet (its first
    heartbeat, or a router's start), and a hint action sent to it: the session's save
    (versioned), the worker's row and the action's, queued in the order given."""
    record = registry.open("acme", f"on-{worker_id}", time.time())
    record.worker_id, record.turns = worker_id, 1
    if worker_first:
        writer.upsert("workers", (worker_id,), _worker_row(worker_id, False, time.time()))
    registry.save(record)
    writer.upsert("hint_actions", (f"a-{worker_id}",), _action(f"a-{worker_id}", worker_id))
    if not worker_first:
        writer.upsert("workers", (worker_id,), _worker_row(worker_id, False, time.time()))


def test_a_new_workers_row_is_written_before_the_rows_naming_it(database_url: str) -> None:
    engine = create_store_engine(database_url)
    drops: list[tuple[str, int]] = []
    try:
        migrate(engine)

        async def run() -> None:
            writer = recording_writer(engine, drops)
            registry = SessionRegistry(writer, 100)
            _queue_new_worker(writer, registry, "w-first", worker_first=True)
            _queue_new_worker(writer, registry, "w-last", worker_first=False)
            await writer.flush()
            assert (writer.flushes, writer.flush_errors, writer.queued) == (1, 0, 0)

        asyncio.run(run())
        assert _stored(engine) == (
            {"on-w-first": "w-first", "on-w-last": "w-last"},
            {"a-w-first": "w-first", "a-w-last": "w-last"})
        assert drops == []
    finally:
        engine.dispose()


def test_rows_written_one_by_one_go_in_the_same_order(database_url: str) -> None:
    """A batch with a row the database refuses (a cursor past BIGINT: sqlite3 cannot bind
    it, PostgreSQL refuses it) is written one row a transaction: that row is dropped and
    counted, and the new worker's row still goes before the session and the action
    queued ahead of it (written in queue order, the session lost its worker and the
    action was refused by its key, dropped)."""
    engine = create_store_engine(database_url)
    drops: list[tuple[str, int]] = []
    try:
        migrate(engine)

        async def run() -> None:
            writer = recording_writer(engine, drops)
            registry = SessionRegistry(writer, 100)
            writer.upsert("cursors", ("bad",), {"name": "bad", "value": 2 ** 70,
                                                "updated_at": time.time()})
            _queue_new_worker(writer, registry, "w-last", worker_first=False)
            await writer.flush()
            assert (writer.flush_errors, writer.queued) == (1, 0)

        asyncio.run(run())
        assert _stored(engine) == ({"on-w-last": "w-last"}, {"a-w-last": "w-last"})
        assert drops == [("store_row_rejected", 1)]
    finally:
        engine.dispose()
