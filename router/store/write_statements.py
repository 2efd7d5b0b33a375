"""The SQL of a store flush: one transaction writing a batch of queued rows.

:class:`BatchStatements` is a part of :class:`~kvhint.router.store.writer.StoreWriter` (a
mixin, split from it along this seam: the writer queues, batches, retries and answers the
versioned rows' owners; this builds and runs each batch's statements). Contract with the
writer: it owns the fields annotated below (``StoreWriter.__init__`` sets them) and calls
:meth:`BatchStatements._write` in a worker thread, one batch at a time; what it raises
is the writer's to classify (row error or database away). What the statements do is the
writer's module docstring: whole-row writes, updates and deletes grouped into one
executemany each, in the order of the foreign keys (:func:`write_order`); a reference
whose foreign key sets NULL on delete written only while its row exists
(:func:`_nulled_references`); versioned rows written only over their expected revision,
those found at another read back in the same transaction (the conflicts returned).

The queued-row kinds (``UPSERT``, ``UPDATE``, ``DELETE``) and the row key are defined
here, the layer below the writer, which imports them (store.writer still exports them).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sqlalchemy import Connection, Engine, Table, bindparam, delete, select, update

from kvhint.router.store.database import bound_write_waits
from kvhint.router.store.models import TABLES, Base

if TYPE_CHECKING:
    from kvhint.router.store.writer import VersionedSave

RowKey = tuple[str, tuple[Any, ...]]
UPSERT = "upsert"
UPDATE = "update"
DELETE = "delete"
# Rows a versioned write found at another revision: the row now (None: gone meanwhile).
Conflicts = dict[RowKey, dict[str, Any] | None]


class BatchStatements:
    """The statements of :class:`~kvhint.router.store.writer.StoreWriter`'s flushes."""

    # Set by StoreWriter.__init__ (declared here for the methods below; no class values).
    _engine: Engine
    # close()'s deadline (time.monotonic()), None before close(): database.bound_write_waits.
    _close_by: float | None
    # The dialect's insert (PostgreSQL's or SQLite's: both have on_conflict_do_*).
    _insert: Any

    def _write(self, batch: dict[RowKey, list[Any]],
               expected: dict[RowKey, tuple[VersionedSave, int]]) -> Conflicts:
        """Write ``batch`` in one transaction; the versioned rows (``expected``) only
        over their expected revision: those found at another are returned, each with the
        row as it is now (read in the same transaction)."""
        # Group by kind, table and column set: one executemany per group, in the order
        # of write_order (foreign keys; upserts before updates, so an update queued
        # after a flushed insert finds its row). The versioned rows are upserts in it.
        groups: dict[tuple[str, str, tuple[str, ...]], list[dict[str, Any]]] = {}
        versioned: dict[tuple[str, tuple[str, ...]], list[tuple[RowKey, dict[str, Any]]]] = {}
        for row_key, (kind, values) in batch.items():
            if row_key in expected:
                versioned.setdefault((row_key[0], tuple(sorted(values))), []).append(
                    (row_key, {**values, "revision": expected[row_key][1] + 1}))
                continue
            groups.setdefault((kind, row_key[0], tuple(sorted(values))), []).append(values)
        # (order, versioned?, kind, table, columns): a table's versioned rows after its
        # plain upserts (no row is both).
        steps = sorted([(write_order(k, t), False, k, t, c) for k, t, c in groups]
                       + [(write_order(UPSERT, t), True, UPSERT, t, c) for t, c in versioned])
        conflicts: Conflicts = {}
        with self._engine.begin() as conn:
            bound_write_waits(conn, self._close_by)
            for _order, is_versioned, kind, table, columns in steps:
                if is_versioned:
                    conflicts.update(self._write_versioned(
                        conn, TABLES[table].__table__, (*columns, "revision"),
                        versioned[(table, columns)]))
                    continue
                rows = groups[(kind, table, columns)]
                model = TABLES[table]
                table_obj = model.__table__
                primary = [c.name for c in table_obj.primary_key.columns]
                if kind == DELETE:
                    conn.execute(delete(table_obj).where(
                        *(table_obj.c[p] == bindparam(f"pk_{p}") for p in primary)),
                        [{f"pk_{p}": r[p] for p in primary} for r in rows])
                    continue
                if kind == UPDATE:
                    statement = (update(table_obj)
                                 .where(*(table_obj.c[p] == bindparam(f"pk_{p}") for p in primary))
                                 .values({c: bindparam(c) for c in columns if c not in primary}))
                    conn.execute(statement, [{**{f"pk_{p}": r[p] for p in primary},
                                              **{c: r[c] for c in columns if c not in primary}}
                                             for r in rows])
                    continue
                statement, rows = self._insert_rows(table_obj, columns, rows)
                updates = {c: statement.excluded[c] for c in columns if c not in primary}
                if updates:
                    statement = statement.on_conflict_do_update(index_elements=primary,
                                                                set_=updates)
                else:
                    statement = statement.on_conflict_do_nothing(index_elements=primary)
                conn.execute(statement, rows)
        return conflicts

    def _insert_rows(self, table: Table, columns: tuple[str, ...],
                     rows: list[dict[str, Any]]) -> tuple[Any, list[dict[str, Any]]]:
        """An insert of ``rows`` (each with ``columns``) into ``table``, and the rows as
        it binds them: a reference its foreign key nulls on delete is read in the same
        statement (:func:`_nulled_references`), bound under its ``ref_`` name."""
        statement = self._insert(table)
        references = _nulled_references(table, columns)
        if not references:
            return statement, rows
        return statement.values(references), [
            {_REFERENCE_KEY + c if c in references else c: v for c, v in r.items()}
            for r in rows]

    def _write_versioned(self, conn: Connection, table: Table, columns: tuple[str, ...],
                         keyed: list[tuple[RowKey, dict[str, Any]]]) -> Conflicts:
        """Insert each row where there is none, else update it where it is still at the
        revision before the one it carries (``revision``: the expected one plus 1; a row
        never seen stored expects NOT_STORED, which no stored row is at). Those not
        written are read again (:func:`_written_keys` says which were)."""
        primary = [c.name for c in table.primary_key.columns]
        statement, rows = self._insert_rows(table, columns,
                                            [values for _row_key, values in keyed])
        statement = statement.on_conflict_do_update(
            index_elements=primary,
            set_={c: statement.excluded[c] for c in columns if c not in primary},
            where=table.c.revision == statement.excluded.revision - 1)
        written = _written_keys(conn, statement, primary, rows)
        conflicts: Conflicts = {}
        for row_key, values in keyed:
            key = tuple(values[p] for p in primary)
            if key not in written:
                found = conn.execute(select(*table.columns).where(
                    *(table.c[p] == v for p, v in zip(primary, key)))).mappings().first()
                conflicts[row_key] = dict(found) if found is not None else None
        return conflicts


# Rows per statement of a versioned write: measured on PostgreSQL, 1,000 sessions take
# ~140 ms so against ~190 ms in one statement (a plain upsert's executemany: ~70 ms).
_RETURNING_PAGE_ROWS = 100


def _written_keys(conn: Connection, statement: Any, primary: list[str],
                  rows: list[dict[str, Any]]) -> set[tuple[Any, ...]]:
    """The primary keys of ``rows`` the conditional upsert ``statement`` wrote: sent in
    statements of many rows, RETURNING the keys of the rows written (a row count cannot
    say which: SQLAlchemy sends many rows as one statement, whose count it does not
    give)."""
    returning = statement.returning(*(statement.table.c[p] for p in primary)).execution_options(
        insertmanyvalues_page_size=_RETURNING_PAGE_ROWS)
    return {tuple(row) for row in conn.execute(returning, rows)}


# Each table's place in the order of the foreign keys: a referenced table (workers)
# before the tables naming it (sessions, hint_actions). Derived from the models, so a new
# table or key takes its place by itself.
_TABLE_RANK = {table.name: rank for rank, table in enumerate(Base.metadata.sorted_tables)}
_KIND_RANK = {UPSERT: 0, UPDATE: 1, DELETE: 2}


def write_order(kind: str, table: str) -> tuple[int, int]:
    """Where a ``kind`` write of ``table`` goes in a flush (sorted ascending): whole rows
    (upserts, versioned or not), then updates, then deletes; within the writes, a
    referenced table's before the tables naming it (their rows' keys find it: a session's
    worker is kept, not nulled, a hint action is not refused); within the deletes, the
    naming tables' first (their rows go before the one they name, which sets NULL or
    cascades either way)."""
    rank = _TABLE_RANK[table]
    return _KIND_RANK[kind], -rank if kind == DELETE else rank


# The parameter of a nulled reference's value (a column's own name is SQLAlchemy's).
_REFERENCE_KEY = "ref_"


def _nulled_references(table: Table, columns: tuple[str, ...]) -> dict[str, Any]:
    """Of ``columns``, those whose foreign key sets them NULL when the referenced row is
    deleted, each to the referenced key read in the same statement: itself while its row
    exists, else NULL (store.writer's module docstring). The value is bound as
    ``ref_<column>``."""
    references: dict[str, Any] = {}
    for name in columns:
        for key in table.c[name].foreign_keys:
            if key.ondelete is not None and key.ondelete.upper() == "SET NULL":
                target = key.column
                references[name] = select(target).where(
                    target == bindparam(_REFERENCE_KEY + name)).scalar_subquery()
    return references
