"""Engine creation and schema migration for the router store.

SQLite (a file) by default, PostgreSQL by URL (``postgresql+psycopg://...``); the same
Alembic migrations build both.
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy import Engine, create_engine, event, text


def create_store_engine(url: str) -> Engine:
    if url.startswith("sqlite"):
        _ensure_sqlite_dir(url)
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30})
        event.listen(engine, "connect", _sqlite_pragmas)
        return engine
    return create_engine(url, pool_pre_ping=True, pool_size=4, max_overflow=4)


def _sqlite_pragmas(dbapi_connection, _record) -> None:  # noqa: ANN001 - DBAPI object
    cursor = dbapi_connection.cursor()
    # WAL: the admin API reads while the writer thread writes.
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.close()


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


def migrate(engine: Engine, revision: str = "head") -> None:
    """Bring the schema to ``revision`` (idempotent). On PostgreSQL, routers starting
    together (replicas, a rolling deploy) take turns: the first migrates, the others
    then find the schema current (without the lock, all but one failed on a fresh
    database with a duplicate-key error)."""
    config = alembic_config(engine.url.render_as_string(hide_password=False))
    with engine.begin() as connection:
        if engine.dialect.name == "postgresql":
            connection.execute(text("SELECT pg_advisory_xact_lock(:key)"),
                               {"key": _MIGRATION_LOCK})
        config.attributes["connection"] = connection
        command.upgrade(config, revision)
