"""Helpers for the store tests (test_service_store_*.py): rows put straight into a
store's tables, a writer that records what it drops, and two of the ways a worker's row
goes as the router takes them."""

from __future__ import annotations

import asyncio

import sqlalchemy as sa

from kvhint.router.service.runtime import _restore_workers
from kvhint.router.service.workers import WorkerRegistry
from kvhint.router.store.reader import load_recovery
from kvhint.router.store.writer import StoreWriter


def insert_rows(engine: sa.Engine, **rows: list[dict]) -> None:
    """Rows into the tables named, as the tables are at the engine's revision (reflected),
    table after table in the order given (workers first: the other tables' keys name
    them), in one transaction."""
    meta = sa.MetaData()
    tables = {name: sa.Table(name, meta, autoload_with=engine) for name in rows}
    with engine.begin() as conn:
        for name, table_rows in rows.items():
            for row in table_rows:
                conn.execute(tables[name].insert().values(row))


def recording_writer(engine: sa.Engine, drops: list[tuple[str, int]]) -> StoreWriter:
    """A writer that flushes only when told (every 10 s) and appends each drop to
    ``drops`` as (what, how many)."""
    return StoreWriter(engine, flush_interval_s=10, queue_max=100,
                       on_drop=lambda what, n: drops.append((what, n)))


def forget_then_restart(engine: sa.Engine, drops: list[tuple[str, int]], now: float) -> None:
    """The feed forgets worker "forgotten" (the writer's delete); then a router whose
    configuration names only "kept" restores the workers the store holds at ``now``
    (forget_s a day: a worker configured no longer, as "dropped", is not restored and its
    row is deleted), through the same writer, closed at the end."""

    async def run() -> None:
        writer = recording_writer(engine, drops)
        writer.delete("workers", ("forgotten",))
        registry = WorkerRegistry([("kept", "http://kept")])
        _restore_workers(registry, load_recovery(engine, 0.0, 10).workers, now,
                         forget_s=86_400.0, writer=writer)
        await writer.close()

    asyncio.run(run())
