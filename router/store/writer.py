"""Batched, off-request-path writes.

The request path calls :meth:`StoreWriter.upsert` (a dict update, no I/O). A background
task flushes whatever accumulated every ``flush_interval_s`` in one transaction, in a
worker thread. Writes to the same row between flushes collapse into one (later values
win, columns merge), so a busy session costs one row write per interval, not per turn.

If a flush fails (database down), the batch is kept under newer writes and retried on the
next tick; once more than ``queue_max`` distinct rows wait, new ones are dropped and
counted (``on_drop``), never silently. If the database refuses the batch's *data* (a value
too long for its column, a constraint, a value that cannot be serialised), the rows are written one transaction each and
those it refuses are dropped and counted (``store_row_rejected``): one bad row must not
hold every later write back forever.

A whole-row write (upsert) of a column that references a row deleted with SET NULL (a
session's worker, models.SessionRow) writes the referenced key only while its row exists,
else NULL: what the delete leaves when it comes after the write. Refused instead, the
whole row (a session's turns and state) would be dropped for one column that names a
worker the store no longer holds (forgotten, pruned by another replica).

A row may also be queued for deletion (:meth:`StoreWriter.delete`), in the same queue and
order as the writes: a delete replaces what was queued for its row (none of it is
written), a whole-row write (upsert) queued after it writes the row again, and an update
queued after it finds no row.

A versioned whole-row write (:meth:`StoreWriter.upsert_versioned`, a session's row) is
written only where the row is still at the revision its owner last read or wrote (or,
for a row its owner never saw stored, only where there is none): replicas share the
store, and one must not silently write over another's newer save of the same row. The
row it finds instead is read in the same transaction and handed to the owner
(:meth:`VersionedSave.conflicted`), which merges and saves again.

A flush writes its tables in the order of their foreign keys (:func:`.write_order`): the
whole-row writes (versioned or not) and updates of a referenced table (a worker's row)
before those of the tables naming it (sessions, hint actions), deletes last, the naming
tables' first; the rows written one by one likewise. A session first saved in the same
batch as its worker's row so keeps its worker; written before it (versioned rows went
first), the guard above found no row and wrote NULL.

This module queues, batches, retries and answers the versioned rows' owners; the SQL of
each batch is :mod:`.write_statements` (:class:`BatchStatements`, a part of
:class:`StoreWriter`), where the row kinds and key are defined (exported here too).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

from sqlalchemy import Engine
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.exc import (DataError, DBAPIError, IntegrityError, ProgrammingError,
                            SQLAlchemyError, StatementError)

from kvhint.router.store.db_errors import SCHEMA_SQLSTATES, sqlstate
from kvhint.router.store.models import TABLES
from kvhint.router.store.write_statements import (
    DELETE,
    UPDATE,
    UPSERT,
    BatchStatements,
    Conflicts,
    RowKey,
    write_order,
)

log = logging.getLogger(__name__)

# What the database says of the data, not of itself: retrying the same rows cannot help.
_DATABASE_ROW_ERRORS = (DataError, IntegrityError, ProgrammingError)


# What a write can raise: the database's errors, and a value the driver cannot serialise
# or bind (psycopg's JSON dumper raises TypeError/ValueError as they are, sqlite3 an
# OverflowError for an int past 64 bits; SQLite's JSON path wraps them in a
# StatementError).
_VALUE_ERRORS = (TypeError, ValueError, ArithmeticError)
_WRITE_ERRORS = (SQLAlchemyError, *_VALUE_ERRORS)


def _is_row_error(exc: Exception) -> bool:
    """Whether ``exc`` is about the rows, not the database: the database refused their
    data, or they failed before reaching it (a value that cannot be bound or serialised).
    Retrying such rows fails the same way, so retrying the whole batch would hold every
    later write back forever.

    Not a row error: a table or column missing, or no right to write it (its SQLSTATE,
    :data:`SCHEMA_SQLSTATES`): every row fails so until the store is fixed, then all
    pass; kept for retry (within ``queue_max``), as SQLite's "no such table/column" (an
    OperationalError) always was. Before, PostgreSQL's (a ProgrammingError) had every
    row written one by one, logged and dropped at once."""
    if isinstance(exc, DBAPIError) and sqlstate(exc.orig) in SCHEMA_SQLSTATES:
        return False
    if isinstance(exc, (*_DATABASE_ROW_ERRORS, *_VALUE_ERRORS)):
        return True
    return isinstance(exc, StatementError) and not isinstance(exc, DBAPIError)


# The revision of a row its owner never saw stored: written only where there is none.
NOT_STORED = -1
# Writes in one flush at most: the batch, then (twice at most) the versioned rows merged
# after a conflict, with whatever was queued meanwhile.
_CONFLICT_ROUNDS = 3


class VersionedSave(Protocol):
    """The owner of a versioned row (:meth:`StoreWriter.upsert_versioned`), asked in
    the loop thread only."""

    def expected_revision(self) -> int:
        """The revision the row is at as its owner last read or wrote it (NOT_STORED:
        none), asked when its flush begins."""
        ...

    def written(self, revision: int, values: dict[str, Any]) -> None:
        """``values`` (the whole row) were written, the row now at ``revision``."""
        ...

    def conflicted(self, stored: dict[str, Any] | None) -> None:
        """Not written: the row was at another revision, ``stored`` as it is now (None:
        deleted since). The owner merges and saves again."""
        ...


class StoreWriter(BatchStatements):
    def __init__(self, engine: Engine, flush_interval_s: float, queue_max: int,
                 on_drop: Callable[[str, int], None]) -> None:
        self._engine = engine
        self._interval = flush_interval_s
        self._queue_max = queue_max
        self._on_drop = on_drop
        # row -> [kind, values]; kind is UPSERT (a whole row) or UPDATE (some columns of
        # a row that already exists).
        self._pending: dict[RowKey, list[Any]] = {}
        # The owners of the versioned rows queued or being written.
        self._versioned: dict[RowKey, VersionedSave] = {}
        # The rows of the flush in progress (its transaction may have committed already).
        self._writing: frozenset[RowKey] = frozenset()
        self._task: asyncio.Task[None] | None = None
        self._flush_lock = asyncio.Lock()
        # close()'s deadline (time.monotonic()): its flushes wait for the database no
        # longer (database.bound_write_waits).
        self._close_by: float | None = None
        self.flushes = 0
        self.flush_errors = 0
        self.rows_written = 0
        self.last_error = ""
        insert = pg_insert if engine.dialect.name == "postgresql" else sqlite_insert
        self._insert = insert

    @property
    def queued(self) -> int:
        return len(self._pending)

    def upsert(self, table: str, key: tuple[Any, ...], values: dict[str, Any]) -> None:
        """Queue a whole-row write (insert or replace the given columns). ``values`` holds
        every non-null column and the primary key."""
        self._queue(UPSERT, table, key, values)

    def upsert_versioned(self, table: str, key: tuple[Any, ...], values: dict[str, Any],
                         owner: VersionedSave) -> None:
        """Queue a whole-row write of a table with a ``revision`` column, written only
        over the revision ``owner`` expects when the flush begins (module docstring)."""
        self._queue(UPSERT, table, key, values)
        row_key = (table, key)
        if row_key in self._pending:  # else dropped, counted
            self._versioned[row_key] = owner

    def writing(self, table: str, key: tuple[Any, ...]) -> bool:
        """Whether the row is in the flush in progress: a read of it meanwhile may find
        this writer's own write, its owner not yet told (``VersionedSave.written``)."""
        return (table, key) in self._writing

    def update(self, table: str, key: tuple[Any, ...], values: dict[str, Any]) -> None:
        """Queue an update of some columns of a row that exists (or is queued)."""
        self._queue(UPDATE, table, key, values)

    def delete(self, table: str, key: tuple[Any, ...]) -> None:
        """Queue the deletion of a row (``key``: its primary key, in the table's column
        order); a no-op for a row that does not exist. What was queued for the row
        before is not written."""
        primary = [c.name for c in TABLES[table].__table__.primary_key.columns]
        if len(primary) != len(key):
            raise ValueError(f"{table}: a key of {len(primary)} columns, not {key!r}")
        self._queue(DELETE, table, key, dict(zip(primary, key)))

    def _queue(self, kind: str, table: str, key: tuple[Any, ...], values: dict[str, Any]) -> None:
        row_key = (table, key)
        current = self._pending.get(row_key)
        if current is not None:
            if DELETE in (kind, current[0]):
                current[0], current[1] = _merged(current[0], current[1], kind, values)
            else:  # the common case, in place: a busy row's columns merge (later wins)
                current[1].update(values)
                if kind == UPSERT:
                    current[0] = UPSERT
            return
        if len(self._pending) >= self._queue_max:
            self._on_drop("store_write", 1)
            return
        self._pending[row_key] = [kind, dict(values)]

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="kvhint-store-writer")

    async def close(self, retry_for_s: float = 10.0) -> None:
        """Stop the flush loop, then write what is queued, retrying a store that is away
        for up to ``retry_for_s``; rows still unwritten then are dropped and counted
        (``store_write``). The loop is stopped between flushes, never during one: a batch
        cancelled in its thread would go on and could commit after the newer rows. A
        flush waits database.WRITE_LOCK_WAIT_S at most for a lock, and close()'s own
        flushes no longer than its deadline for anything, so it ends within
        ``retry_for_s`` plus that."""
        if self._task is not None:
            async with self._flush_lock:  # a flush in progress finishes first
                self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        deadline = time.monotonic() + retry_for_s
        self._close_by = deadline
        pause = 0.1
        while True:
            await self.flush()
            if not self._pending or time.monotonic() + pause > deadline:
                break
            await asyncio.sleep(pause)
            pause = min(pause * 2, 1.0)
        if self._pending:
            log.error("store still failing at shutdown: %d queued rows dropped (%s)",
                      len(self._pending), self.last_error)
            self._on_drop("store_write", len(self._pending))
            self._pending = {}
            self._versioned = {}

    async def flush(self) -> None:
        """Write what is queued. Versioned rows found saved by another replica are merged
        by their owners and queued again: written in this flush too (a few rounds at
        most; a row still conflicting then waits for the next flush)."""
        async with self._flush_lock:
            for _round in range(_CONFLICT_ROUNDS):
                if not self._pending:
                    return
                batch, self._pending = self._pending, {}
                self._writing = frozenset(batch)
                try:
                    conflicted = await self._flush_batch(batch)
                finally:
                    self._writing = frozenset()
                if not conflicted:
                    return

    async def _flush_batch(self, batch: dict[RowKey, list[Any]]) -> bool:
        """Write ``batch``; whether some versioned row of it conflicted."""
        expected = self._expected(batch)
        try:
            conflicts = await asyncio.to_thread(self._write, batch, expected)
        except _WRITE_ERRORS as exc:
            if _is_row_error(exc):
                self._failed(exc, "writing its rows one by one", len(batch))
                await self._write_each(batch, expected)
            else:
                self._failed(exc, "rows kept for retry", len(batch))
                self._requeue(batch)
            return False
        except Exception as exc:  # noqa: BLE001 - nothing foreseen may end the loop
            self._failed(exc, "rows dropped", len(batch))
            self._on_drop("store_write", len(batch))
            for row_key in expected:
                self._settled(row_key)
            return False
        self.flushes += 1
        self.rows_written += len(batch) - len(conflicts)
        self._answer(batch, expected, conflicts)
        return bool(conflicts)

    def _expected(self, batch: dict[RowKey, list[Any]]
                  ) -> dict[RowKey, tuple[VersionedSave, int]]:
        """The versioned rows of ``batch``: each one's owner and expected revision."""
        expected = {}
        for row_key, owner in self._versioned.items():
            entry = batch.get(row_key)
            if entry is not None and entry[0] == UPSERT:
                expected[row_key] = (owner, owner.expected_revision())
        return expected

    def _settled(self, row_key: RowKey) -> None:
        """The versioned row's write is over: its owner is kept only for a newer one."""
        if row_key not in self._pending:
            self._versioned.pop(row_key, None)

    def _answer(self, batch: dict[RowKey, list[Any]],
                expected: dict[RowKey, tuple[VersionedSave, int]],
                conflicts: Conflicts) -> None:
        """Tell each versioned row's owner what became of its write."""
        for row_key, (owner, revision) in expected.items():
            if row_key not in batch:
                continue
            self._settled(row_key)
            if row_key in conflicts:
                owner.conflicted(conflicts[row_key])
            else:
                owner.written(revision + 1, batch[row_key][1])

    def _failed(self, exc: Exception, then: str, rows: int) -> None:
        self.flush_errors += 1
        self.last_error = f"{type(exc).__name__}: {exc}"[:500]
        # repr'd: a database's message may quote a row's values (a DETAIL line included)
        log.warning("store flush of %d rows failed (%s): %r", rows, then, self.last_error)

    async def _write_each(self, batch: dict[RowKey, list[Any]],
                          expected: dict[RowKey, tuple[VersionedSave, int]]) -> None:
        """Each row in its own transaction: the rows the database refuses are dropped and
        counted; if it goes away meanwhile, the rest are kept for the next flush."""
        rejected = 0
        rows = sorted(batch.items(), key=lambda item: write_order(item[1][0], item[0][0]))
        for index, (row_key, entry) in enumerate(rows):
            mine = {row_key: expected[row_key]} if row_key in expected else {}
            try:
                conflicts = await asyncio.to_thread(self._write, {row_key: entry}, mine)
            except _WRITE_ERRORS as exc:
                if not _is_row_error(exc):
                    self._failed(exc, "rows kept for retry", len(rows) - index)
                    self._requeue(dict(rows[index:]))
                    break
                rejected += 1
                log.error("store refused a %s row, dropped: %r", row_key[0],
                          f"{type(exc).__name__}: {exc}"[:300])
                if mine:
                    self._settled(row_key)
                continue
            self.rows_written += 1 - len(conflicts)
            self._answer({row_key: entry}, mine, conflicts)
        if rejected:
            self._on_drop("store_row_rejected", rejected)
        self.flushes += 1

    def _requeue(self, batch: dict[RowKey, list[Any]]) -> None:
        for row_key, (kind, values) in batch.items():
            newer = self._pending.get(row_key)
            if newer is not None:
                self._pending[row_key] = list(_merged(kind, values, newer[0], newer[1]))
            elif len(self._pending) < self._queue_max:
                self._pending[row_key] = [kind, values]
            else:
                self._on_drop("store_write", 1)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._interval)
            await self.flush()


def _merged(kind: str, values: dict[str, Any], later_kind: str,
            later: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """One queued entry for a row from an earlier one and a later one, as if written in
    turn: a later delete wins whatever came before; a later whole row (upsert) writes
    the row again after a delete; a later update of a deleted row finds none (the delete
    stays); otherwise the columns merge, later values winning, an upsert if either is."""
    if later_kind == DELETE:
        return DELETE, dict(later)
    if kind == DELETE:
        return (UPSERT, {**values, **later}) if later_kind == UPSERT else (DELETE, values)
    return (UPSERT if UPSERT in (kind, later_kind) else UPDATE), {**values, **later}
