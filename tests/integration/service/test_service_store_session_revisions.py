"""``sessions.revision`` (revision 0006), on SQLite and PostgreSQL: a store of the release
before (0005) gains it, every row kept at revision 0; that release's save (a plain
upsert, as its SessionRegistry.save wrote) still writes on the new schema, leaving the
revision as it is (on SQLite; on PostgreSQL revision 0007 moves it on:
test_service_store_rolling_upgrade_saves); this release's save writes only over the revision its record was
made from, and a record that never saw the row stored (a first-sight read that failed)
merges with the row it finds instead of writing over it."""

from __future__ import annotations

import asyncio
import time

import sqlalchemy as sa

from kvhint.router.service.sessions import SessionRecord, SessionRegistry
from kvhint.router.store.database import create_store_engine, migrate
from kvhint.router.store.models import SessionRow
from kvhint.router.store.writer import NOT_STORED, StoreWriter

from store_helpers import insert_rows
from test_service_store_forgotten_workers import _worker_row
from test_service_store_session_worker import _session


def _stored(engine: sa.Engine, session_id: str) -> dict:
    with engine.connect() as conn:
        return dict(conn.execute(sa.select(SessionRow.__table__).where(
            SessionRow.session_id == session_id)).mappings().one())


def test_a_store_of_the_release_before_gains_revisions_and_keeps_its_rows(
        database_url: str) -> None:
    engine = create_store_engine(database_url)
    try:
        migrate(engine, "0005")
        rows = [_session("old", "w0"), _session("none", None)]
        insert_rows(engine, workers=[_worker_row("w0", True)], sessions=rows)
        assert migrate(engine) is True
        assert migrate(engine) is True  # idempotent
        for row in rows:
            assert _stored(engine, row["session_id"]) == row | {"revision": 0,
                                                                "latest_replica": None}

        async def saves() -> list[str]:
            conflicts: list[str] = []
            writer = StoreWriter(engine, flush_interval_s=3600, queue_max=100,
                                 on_drop=lambda what, n: None)
            # The release before's save: written over the row, the revision left as it is
            # on SQLite; on PostgreSQL revision 0007's trigger moves it on (a save).
            writer.upsert("sessions", ("acme", "old"), _session("old", "w0") | {"turns": 4})
            await writer.flush()
            moved = 1 if engine.dialect.name == "postgresql" else 0
            assert _stored(engine, "old")["turns"] == 4
            assert _stored(engine, "old")["revision"] == moved
            registry = SessionRegistry(writer, 100, on_conflict=conflicts.append)
            # Read at that revision (a first-sight read): saved over it, one revision on.
            adopted = registry.adopt(_stored(engine, "old"))
            assert adopted.revision == moved
            adopted.turns += 1
            registry.save(adopted)
            await writer.flush()
            assert (_stored(engine, "old")["turns"], _stored(engine, "old")["revision"]) == (
                5, moved + 1)
            assert adopted.revision == moved + 1 and adopted.base.turns == 5
            # A record that never saw the row (its first-sight read failed: a record of
            # its own) with 2 turns: merged with the stored 3, not written over them.
            blank = SessionRecord.from_row(_session("none", None) | {"turns": 2})
            blank.revision, blank.base = NOT_STORED, None
            blank.prompt_tokens, blank.cached_tokens = 30, 10
            registry.save(blank)
            await writer.flush()
            stored = _stored(engine, "none")
            assert (stored["turns"], stored["prompt_tokens"], stored["cached_tokens"],
                    stored["revision"]) == (5, 130, 50, 1)
            assert blank.turns == 5 and blank.revision == 1
            return conflicts

        assert asyncio.run(saves()) == ["merged"]
    finally:
        engine.dispose()


def test_a_new_session_is_inserted_once_and_saved_revision_by_revision(
        database_url: str) -> None:
    """A session no row holds yet: inserted at revision 0, then each save one revision
    on; nothing conflicts."""
    engine = create_store_engine(database_url)
    try:
        migrate(engine)

        async def saves() -> list[str]:
            conflicts: list[str] = []
            writer = StoreWriter(engine, flush_interval_s=3600, queue_max=100,
                                 on_drop=lambda what, n: None)
            registry = SessionRegistry(writer, 100, on_conflict=conflicts.append)
            record = registry.open("acme", "fresh", time.time())
            assert record.revision == NOT_STORED
            for turns in (1, 2, 3):
                record.turns = turns
                registry.save(record)
                await writer.flush()
                assert (_stored(engine, "fresh")["turns"],
                        _stored(engine, "fresh")["revision"]) == (turns, turns - 1)
            return conflicts

        assert asyncio.run(saves()) == []
    finally:
        engine.dispose()


def test_a_conflict_among_many_rows_is_told_for_its_row_alone(database_url: str) -> None:
    """250 sessions in one flush (several statements of rows), one of them saved by
    another replica since: that one is merged, the other 249 written."""
    engine = create_store_engine(database_url)
    try:
        migrate(engine)

        async def saves() -> list[str]:
            conflicts: list[str] = []
            writer = StoreWriter(engine, flush_interval_s=3600, queue_max=1000,
                                 on_drop=lambda what, n: None)
            registry = SessionRegistry(writer, 1000, on_conflict=conflicts.append)
            records = [registry.open("acme", f"s{i}", time.time()) for i in range(250)]
            for record in records:
                record.turns = 1
                registry.save(record)
            await writer.flush()
            # Another replica's save of s137 (from revision 0, two turns more).
            other = StoreWriter(engine, flush_interval_s=3600, queue_max=10,
                                on_drop=lambda what, n: None)
            theirs = SessionRegistry(other, 10).adopt(_stored(engine, "s137"))
            theirs.turns += 2
            SessionRegistry(other, 10).save(theirs)
            await other.flush()
            for record in records:
                record.turns += 1
                registry.save(record)
            await writer.flush()
            turns = {r["session_id"]: (r["turns"], r["revision"]) for r in _all(engine)}
            assert turns.pop("s137") == (4, 2)  # 3 theirs + 1 this replica's, merged
            assert set(turns.values()) == {(2, 1)}
            return conflicts

        assert asyncio.run(saves()) == ["merged"]
    finally:
        engine.dispose()


def _all(engine: sa.Engine) -> list[dict]:
    with engine.connect() as conn:
        return [dict(r) for r in conn.execute(sa.select(SessionRow.__table__)).mappings()]
