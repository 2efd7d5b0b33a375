"""Engine creation and schema migration for the router store.

SQLite (a file) by default, PostgreSQL by URL (``postgresql+psycopg://...``); the same
Alembic migrations build both.
"""

from __future__ import annotations

import logging
import math
from importlib.resources import files
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from alembic.util.exc import CommandError
from sqlalchemy import Connection, Engine, create_engine, event, make_url, text
from sqlalchemy.exc import SQLAlchemyError

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
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30})
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


def _known_revision(scripts: ScriptDirectory, revision: str) -> bool:
    try:
        return scripts.get_revision(revision) is not None
    except CommandError:  # alembic's "Can't locate revision"
        return False
