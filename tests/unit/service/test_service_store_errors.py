"""Which failed store reads may pass if retried: real errors of the real drivers, as
SQLAlchemy raises them."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from pathlib import Path

import pytest
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.exc import OperationalError, ProgrammingError

from kvhint.router.devstack.nats_server import free_port
from kvhint.router.service.store_errors import STORE_ERRORS, StoreFailure, classify


def _failure(run: Callable[[], object]) -> StoreFailure:
    with pytest.raises(STORE_ERRORS) as raised:
        run()
    return classify(raised.value)


def _select(engine: Engine, sql: str) -> Callable[[], object]:
    def run() -> object:
        with engine.connect() as conn:
            return conn.execute(text(sql)).all()
    return run


def test_a_missing_table_in_sqlite_is_permanent(tmp_path: Path) -> None:
    """sqlite3 raises "no such table" as an OperationalError, like a lock: its result code
    (SQLITE_ERROR) tells them apart."""
    engine = create_engine(f"sqlite:///{tmp_path / 'a.db'}")
    try:
        failure = _failure(_select(engine, "SELECT * FROM hint_actions"))
        assert failure == StoreFailure(
            False, "sqlite3.OperationalError: no such table: hint_actions")
    finally:
        engine.dispose()


def test_a_locked_sqlite_database_is_transient(tmp_path: Path) -> None:
    path = tmp_path / "b.db"
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("CREATE TABLE t (x INTEGER)")
    holder.execute("BEGIN EXCLUSIVE")  # rollback journal: no reader gets in meanwhile
    engine = create_engine(f"sqlite:///{path}", connect_args={"timeout": 0})
    try:
        failure = _failure(_select(engine, "SELECT * FROM t"))
        assert failure.transient and "database is locked" in failure.cause
    finally:
        holder.execute("ROLLBACK")
        holder.close()
        engine.dispose()


def test_a_refused_postgresql_connection_is_transient() -> None:
    """psycopg gives no SQLSTATE for a server that never answered."""
    pytest.importorskip("psycopg")
    engine = create_engine(f"postgresql+psycopg://kvhint@127.0.0.1:{free_port()}/x",
                           connect_args={"connect_timeout": 2})
    try:
        failure = _failure(_select(engine, "SELECT 1"))
        assert failure.transient and failure.cause.startswith("psycopg.OperationalError")
    finally:
        engine.dispose()


def test_a_pool_with_every_connection_busy_is_transient(tmp_path: Path) -> None:
    engine = create_engine(f"sqlite:///{tmp_path / 'c.db'}", pool_size=1, max_overflow=0,
                           pool_timeout=0.05)
    held = engine.connect()
    try:
        failure = _failure(engine.connect)
        assert failure.transient and failure.cause.startswith("connection pool:")
    finally:
        held.close()
        engine.dispose()


class _PgError(Exception):
    """What psycopg raises for an error the server answered, with its SQLSTATE (servers
    that cannot be made to answer each of these on cue)."""

    def __init__(self, sqlstate: str) -> None:
        super().__init__(f"server said {sqlstate}")
        self.sqlstate = sqlstate


@pytest.mark.parametrize(("sqlstate", "transient"), [
    ("42P01", False),  # undefined table
    ("42703", False),  # undefined column
    ("3D000", False),  # no such database
    ("57P04", False),  # database dropped
    ("XX001", False),  # data corrupted
    ("08006", True),   # connection failure
    ("40001", True),   # serialization failure
    ("53300", True),   # too many connections
    ("57014", True),   # statement timeout
    ("57P01", True),   # server shutting down
    ("55P03", True),   # lock not available
])
def test_a_postgresql_error_is_classified_by_its_sqlstate(sqlstate: str,
                                                          transient: bool) -> None:
    # The class SQLAlchemy wraps it in does not decide, its SQLSTATE does.
    for wrapper in (OperationalError, ProgrammingError):
        failure = classify(wrapper("SELECT 1", {}, _PgError(sqlstate)))
        assert failure.transient is transient, wrapper
        assert failure.cause.endswith(f"_PgError: server said {sqlstate}")
