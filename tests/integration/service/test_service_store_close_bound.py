"""The store's last flush at shutdown ends within its retry time though another connection
holds the lock it needs: a flush waits database.WRITE_LOCK_WAIT_S at most for a lock,
close()'s own no longer than its deadline. Before, SQLite's busy timeout (30 s) held the
router's stop past its supervisor's patience, and PostgreSQL's lock wait had no bound."""

from __future__ import annotations

import asyncio
import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from sqlalchemy import Engine, text

from kvhint.router.store import database
from kvhint.router.store.database import create_store_engine, migrate
from kvhint.router.store.writer import StoreWriter

pytestmark = pytest.mark.integration


@contextmanager
def tenants_locked(engine: Engine, url: str) -> Iterator[None]:
    """Another connection holds the lock a write of the tenants table needs."""
    if url.startswith("sqlite"):
        locker = sqlite3.connect(url.removeprefix("sqlite:///"), isolation_level=None)
        locker.execute("BEGIN IMMEDIATE")  # SQLite's write lock
        try:
            yield
        finally:
            locker.rollback()
            locker.close()
        return
    with engine.connect() as conn, conn.begin():
        conn.execute(text("LOCK TABLE tenants IN ACCESS EXCLUSIVE MODE"))
        yield


def test_closing_on_a_locked_store_ends_within_its_retry_time_and_counts_the_drop(
        database_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(database, "WRITE_LOCK_WAIT_S", 0.5)  # the test's own, shorter
    engine = create_store_engine(database_url)
    migrate(engine)
    drops: list[tuple[str, int]] = []

    async def scenario() -> float:
        writer = StoreWriter(engine, flush_interval_s=0.01, queue_max=100,
                             on_drop=lambda what, n: drops.append((what, n)))
        writer.start()
        writer.upsert("tenants", ("acme",), {"name": "acme", "cache_salt": None,
                                             "created_at": 1.0})
        await asyncio.sleep(0.2)  # the loop's flush is waiting for the lock
        started = time.monotonic()
        await writer.close(retry_for_s=1.0)
        return time.monotonic() - started

    try:
        with tenants_locked(engine, database_url):
            took = asyncio.run(scenario())
        # The flush in progress (0.5 s), then close()'s tries for 1 s; before: 30 s on
        # SQLite (its busy timeout), on PostgreSQL until the lock was let go.
        assert took < 4.0, took
        assert drops == [("store_write", 1)]
        with engine.connect() as conn:
            assert conn.execute(text("SELECT count(*) FROM tenants")).scalar_one() == 0
    finally:
        engine.dispose()
