"""Engine creation and schema migration for the router store.

SQLite (a file) by default, PostgreSQL by URL (``postgresql+psycopg://...``); the same
Alembic migrations build both.
"""

from __future__ import annotations

import json
import logging
import math
import time
from importlib.resources import files
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from alembic.util.exc import CommandError
from sqlalchemy import (Connection, Engine, TextClause, create_engine, event, inspect,
                        make_url, text)
from sqlalchemy.exc import OperationalError, SQLAlchemyError

from kvhint.router.store.db_errors import sqlstate
from kvhint.router.store.models import TABLES

log = logging.getLogger(__name__)


# How long a PostgreSQL connection attempt may take before it fails (libpq's
# connect_timeout, for the libpq drivers; a URL that sets its own keeps it).
DEFAULT_CONNECT_TIMEOUT_S = 10.0


def create_store_engine(url: str, connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S) -> Engine:
    """An engine for ``url``. A PostgreSQL server that does not answer (a dropped route,
    a host that accepts and stalls) fails a connection after ``connect_timeout_s``:
    without a bound, libpq waits for as long as the kernel retries, so the router's
    start and every store flush hung for minutes on it."""
    if url.startswith("sqlite"):
        _ensure_sqlite_dir(url)
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30},
                               json_deserializer=_stored_json)
        event.listen(engine, "connect", _sqlite_pragmas)
        return engine
    parsed = make_url(url)
    connect_args: dict[str, object] = {}
    if parsed.get_backend_name() == "postgresql" and parsed.get_driver_name() in (
            "psycopg", "psycopg2") and "connect_timeout" not in parsed.query:
        # libpq takes whole seconds; under 2 it treats as 2.
        connect_args["connect_timeout"] = max(2, math.ceil(connect_timeout_s))
    return create_engine(parsed, pool_pre_ping=True, pool_size=4, max_overflow=4,
                         connect_args=connect_args)


def _stored_json(text: str) -> Any:
    """A JSON column's value as SQLite gives it back (TEXT: nothing checked it was JSON
    when written). Text that is not JSON (a hand edit, a torn restore) comes back as the
    string it is, for its reader to refuse as of the wrong form, as it refuses a JSON
    value of another shape, and count (a session's: service.sessions.readable_row; a
    hint action's: reader._readable_action; learnt statistics: hint_learned). Before,
    the read raised: one such row among those a start reads failed it, every time."""
    try:
        return json.loads(text)
    except ValueError:  # json.JSONDecodeError
        return text


def store_unreachable(url: str, connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S) -> str:
    """One line saying why the store at ``url`` cannot be connected to, or "" if it can.
    For start-up: an operator reads this where the service would otherwise die in its
    lifespan with a driver traceback."""
    engine = create_store_engine(url, connect_timeout_s)
    try:
        engine.connect().close()
    except SQLAlchemyError as exc:
        reason = str(getattr(exc, "orig", None) or exc).strip().splitlines()
        where = engine.url.render_as_string(hide_password=True)
        return f"cannot connect to the store at {where}: {reason[0] if reason else type(exc).__name__}"
    finally:
        engine.dispose()
    return ""


def _sqlite_pragmas(dbapi_connection, _record) -> None:  # noqa: ANN001 - DBAPI object
    cursor = dbapi_connection.cursor()
    # WAL: the admin API reads while the writer thread writes.
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=NORMAL")
    # SQLite enforces foreign keys (a worker's deletion cascading to its hint actions,
    # models.HintActionRow) only on a connection that asks, each time it connects.
    cursor.execute(_SQLITE_FOREIGN_KEYS_ON)
    cursor.close()


_SQLITE_FOREIGN_KEYS_ON = "PRAGMA foreign_keys=ON"
_SQLITE_FOREIGN_KEYS_OFF = "PRAGMA foreign_keys=OFF"


def _sqlite_foreign_keys(connection: Connection, on: bool) -> None:
    """Turn SQLite's foreign keys on or off on ``connection``, outside a transaction
    (inside one SQLite ignores the pragma: checked, so that a migration never runs with
    them on)."""
    connection.exec_driver_sql(_SQLITE_FOREIGN_KEYS_ON if on else _SQLITE_FOREIGN_KEYS_OFF)
    connection.commit()
    if bool(connection.exec_driver_sql("PRAGMA foreign_keys").scalar()) is not on:
        raise RuntimeError(f"SQLite did not turn foreign keys {'on' if on else 'off'}")
    connection.commit()


def _ensure_sqlite_dir(url: str) -> None:
    path = url.split(":///", 1)[1] if ":///" in url else ""
    if path and path != ":memory:":
        Path(path).expanduser().resolve().parent.mkdir(parents=True, exist_ok=True)


def alembic_config(url: str) -> Config:
    location = files("kvhint.migrations")
    config = Config(str(location / "alembic.ini"))
    config.set_main_option("script_location", str(location))
    config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return config


# pg_advisory_xact_lock key for migrations: "kvhint" as a number.
_MIGRATION_LOCK = 0x6B7668696E74


def migrate(engine: Engine, revision: str = "head") -> bool:
    """Bring the schema to ``revision`` (idempotent); False when the database is at a
    revision this code does not know (a newer router migrated it), left as it is.

    On PostgreSQL, routers starting together (replicas, a rolling deploy) take turns: the
    first migrates, the others then find the schema current (without the lock, all but
    one failed on a fresh database with a duplicate-key error).

    A newer revision: during a rolling upgrade an older router that restarts (or a
    rollback) finds the database migrated ahead of it. Alembic would refuse ("can't
    locate revision") and the router would crash-loop; it runs on the newer schema
    instead, which works because migrations only add (nullable columns, new tables) and
    drop nothing a release before still reads (migrations/README.md)."""
    config = alembic_config(engine.url.render_as_string(hide_password=False))
    scripts = ScriptDirectory.from_config(config)
    sqlite = engine.dialect.name == "sqlite"
    with engine.connect() as connection:
        if sqlite:
            # A migration on SQLite copies a table to alter it (batch mode): dropping the
            # old ``workers`` with foreign keys on would delete every hint action (the
            # cascade). Off while migrating, as SQLite's and Alembic's docs ask.
            _sqlite_foreign_keys(connection, on=False)
        try:
            return _migrate(connection, config, scripts, revision)
        finally:
            if sqlite:
                try:
                    _sqlite_foreign_keys(connection, on=True)
                except (SQLAlchemyError, RuntimeError):
                    # Not back to the pool without them (the writer would not cascade).
                    connection.invalidate()
                    raise


def _migrate(connection: Connection, config: Config, scripts: ScriptDirectory,
             revision: str) -> bool:
    with connection.begin():
        if connection.dialect.name == "postgresql":
            connection.execute(text("SELECT pg_advisory_xact_lock(:key)"),
                               {"key": _MIGRATION_LOCK})
        unknown = [head for head in MigrationContext.configure(connection).get_current_heads()
                   if not _known_revision(scripts, head)]
        if unknown:
            log.warning("the store is at schema revision %s, newer than this router's (%s): "
                        "running on it without migrating", ", ".join(unknown),
                        ", ".join(scripts.get_heads()))
            return False
        config.attributes["connection"] = connection
        command.upgrade(config, revision)
    return True


# How long a migration tries to lock the store's tables without waiting on anyone while
# it holds one (lock_for_migration), before it waits as any statement does.
MIGRATION_LOCK_PATIENCE_S = 30.0
# A try's wait for a lock, at most (and under half PostgreSQL's deadlock_timeout).
_LOCK_TRY_MS = 100
# 55P03 lock_not_available (lock_timeout), 40P01 deadlock_detected: try again.
_LOCK_RETRY_SQLSTATES = frozenset({"55P03", "40P01"})


def lock_for_migration(connection: Connection,
                       patience_s: float = MIGRATION_LOCK_PATIENCE_S) -> None:
    """On PostgreSQL, lock every table of the store that exists for writes (SHARE ROW
    EXCLUSIVE: writes wait, reads go on) until ``connection``'s transaction ends, before
    a migration alters them (migrations/env.py: only when the store is behind).

    All or none: each try waits at most ``_LOCK_TRY_MS`` for a lock, and a try that did
    not get them all lets go of those it got. Routers still running take the tables in
    opposite orders: a flush workers, then sessions and hint_actions; retention
    hint_actions and sessions, then workers. A migration that waited for a second table
    while holding the first was one side of a deadlock with either, and PostgreSQL
    aborted it when it detected it first (revision 0003 against a prune of the release
    before: the router's start failed, the next one migrated). A try lets go before
    PostgreSQL's deadlock_timeout, so the migration is never the one aborted, and
    whoever waited on it goes on. Past ``patience_s`` (writes so busy that no try finds
    every table free), it waits as any statement does."""
    if connection.dialect.name != "postgresql":
        return
    names = sorted(set(TABLES) & set(inspect(connection).get_table_names()))
    if not names:
        return
    quote = connection.dialect.identifier_preparer.quote
    statement = text(f"LOCK TABLE {', '.join(map(quote, names))} IN SHARE ROW EXCLUSIVE MODE")
    deadlock_ms = connection.execute(text(
        "SELECT setting::int FROM pg_settings WHERE name = 'deadlock_timeout'")).scalar_one()
    before = connection.execute(text("SELECT current_setting('lock_timeout')")).scalar_one()
    _set_lock_timeout(connection, f"{max(1, min(_LOCK_TRY_MS, deadlock_ms // 2))}ms")
    try:
        locked = _try_locks(connection, statement, patience_s)
    finally:
        _set_lock_timeout(connection, before)
    if not locked:
        log.warning("could not lock the store's tables for %.0fs without waiting while "
                    "holding one: waiting for them now", patience_s)
        connection.execute(statement)


def _try_locks(connection: Connection, statement: TextClause, patience_s: float) -> bool:
    """Whether one of the tries within ``patience_s`` took every lock of ``statement``
    (each in a savepoint: one that fails lets go of what it took)."""
    deadline = time.monotonic() + patience_s
    pause = 0.05
    while True:
        attempt = connection.begin_nested()
        try:
            connection.execute(statement)
        except OperationalError as exc:
            attempt.rollback()
            if sqlstate(exc.orig) not in _LOCK_RETRY_SQLSTATES:
                raise
        else:
            attempt.commit()
            return True
        if time.monotonic() + pause > deadline:
            return False
        time.sleep(pause)
        pause = min(pause * 2, 1.0)


# The longest a store write's transaction waits for a lock another connection holds
# (SQLite's write lock, PostgreSQL's row and table locks) before it fails and its rows wait
# for the writer's next flush. Before, SQLite's busy timeout (30 s, above) and PostgreSQL's
# none: a store locked at shutdown held the router's stop 30 s (or for good) past
# StoreWriter.close's retry time.
WRITE_LOCK_WAIT_S = 5.0


def bound_write_waits(connection: Connection, close_by: float | None) -> None:
    """Bound how long the write transaction on ``connection`` waits on the database: for a
    lock, WRITE_LOCK_WAIT_S; with ``close_by`` (the writer's shutdown deadline,
    time.monotonic()), no longer than that either, for a lock or (PostgreSQL) any
    statement. A wait cut short fails the flush as a store that is away does (its rows
    kept for the next one, not refused as bad rows)."""
    wait_s = WRITE_LOCK_WAIT_S
    if close_by is not None:
        wait_s = min(wait_s, max(close_by - time.monotonic(), 0.1))
    wait_ms = max(int(wait_s * 1000), 1)
    dialect = connection.dialect.name
    if dialect == "sqlite":  # the pooled connection's own setting: set by each write
        connection.exec_driver_sql(f"PRAGMA busy_timeout = {wait_ms}")
    elif dialect == "postgresql":  # this transaction's only (set_config's is_local)
        _set_lock_timeout(connection, f"{wait_ms}ms")
        if close_by is not None:
            connection.execute(text("SELECT set_config('statement_timeout', :value, true)"),
                               {"value": f"{wait_ms}ms"})


def _set_lock_timeout(connection: Connection, value: str) -> None:
    connection.execute(text("SELECT set_config('lock_timeout', :value, true)"),
                       {"value": value})


def _known_revision(scripts: ScriptDirectory, revision: str) -> bool:
    try:
        return scripts.get_revision(revision) is not None
    except CommandError:  # alembic's "Can't locate revision"
        return False
