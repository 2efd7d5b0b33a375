"""Which failed store reads may pass if retried: real errors of the real drivers, as
SQLAlchemy raises them."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import sqlite3
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.exc import OperationalError, ProgrammingError
from starlette.requests import Request

from kvhint.router.devstack.nats_server import free_port
from kvhint.router.service.store_errors import (STORE_ERRORS, StoreFailure, StoreReadErrors,
                                                 classify)


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


def _postgres(user: str, database: str) -> Engine:
    """An engine on the test PostgreSQL (127.0.0.1:5432, or KVHINT_TEST_PG_HOST/PORT) as
    ``user`` on ``database``; the test is skipped when nothing answers there."""
    pytest.importorskip("psycopg")
    host = os.environ.get("KVHINT_TEST_PG_HOST", "127.0.0.1")
    port = int(os.environ.get("KVHINT_TEST_PG_PORT", "5432"))
    try:
        socket.create_connection((host, port), timeout=1.0).close()
    except OSError:
        pytest.skip(f"PostgreSQL not reachable on {host}:{port}")
    return create_engine(f"postgresql+psycopg://{user}@{host}:{port}/{database}",
                         connect_args={"connect_timeout": 5})


@pytest.mark.parametrize(("user", "database", "named"), [
    ("postgres", "kvhint_no_such_database", 'database "kvhint_no_such_database"'),
    ("kvhint_no_such_role", os.environ.get("KVHINT_TEST_PG_DB", "test"),
     'role "kvhint_no_such_role"'),
])
def test_a_postgresql_connection_refused_for_its_settings_is_permanent(
        user: str, database: str, named: str) -> None:
    """The server refuses the connection at its start (a database or role that does not
    exist): libpq keeps no SQLSTATE for it, and it was classified transient, a 503
    "retry later" that no retry fixes. Now permanent, for its configuration, naming the
    cause."""
    engine = _postgres(user, database)
    try:
        failure = _failure(_select(engine, "SELECT 1"))
        assert not failure.transient and failure.config
        assert failure.cause.startswith("psycopg.OperationalError")
        assert f"{named} does not exist" in failure.cause
        with pytest.raises(STORE_ERRORS) as raised:
            _select(engine, "SELECT 1")()
        request = Request({"type": "http", "method": "GET", "path": "/admin/hints",
                           "headers": [], "query_string": b"",
                           "app": SimpleNamespace(state=SimpleNamespace())})
        response = asyncio.run(StoreReadErrors()(request, raised.value))
        message = json.loads(response.body)["error"]["message"]
        assert response.status_code == 500 and f"{named} does not exist" in message
        assert "database_url" in message and "retrying will not help" in message
    finally:
        engine.dispose()


@pytest.mark.parametrize(("message", "transient"), [
    ('FATAL:  password authentication failed for user "kvhint"', False),
    ('FATAL:  no pg_hba.conf entry for host "10.0.0.1", user "kvhint", database "k"',
     False),
    ("fe_sendauth: no password supplied", False),
    ("FATAL:  the database system is starting up", True),
    ("FATAL:  the database system is shutting down", True),
    ("FATAL:  sorry, too many clients already", True),
    ("timeout expired", True),
])
def test_a_postgresql_connection_refused_at_its_start_is_told_by_its_message(
        message: str, transient: bool) -> None:
    """What the test server (trust authentication, running) cannot be made to answer on
    cue: psycopg's error as it raises it for each, without a SQLSTATE."""
    psycopg = pytest.importorskip("psycopg")
    orig = psycopg.OperationalError(
        f'connection failed: connection to server at "127.0.0.1", port 5432 failed: '
        f"{message}")
    failure = classify(OperationalError("SELECT 1", {}, orig))
    assert failure.transient is transient and failure.config is not transient


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


def _german_postgres() -> Engine:
    """An engine on the test PostgreSQL whose sessions report in German (lc_messages, a
    superuser's startup option); skipped where the server has no German locale."""
    engine = _postgres("postgres", os.environ.get("KVHINT_TEST_PG_DB", "test"))
    german = create_engine(engine.url, connect_args={
        "connect_timeout": 5, "options": "-c lc_messages=de_DE.UTF-8"})
    engine.dispose()
    try:
        german.connect().close()
    except OperationalError as exc:
        german.dispose()
        pytest.skip(f"the test PostgreSQL cannot report in German: {exc.orig}")
    return german


def test_a_postgresql_error_in_another_language_is_classified_as_in_english() -> None:
    """The server reports in German: a table missing is still permanent, a lock not
    granted in time still transient (their SQLSTATEs, not their words, decide)."""
    engine = _german_postgres()
    table = f"kvhint_lock_probe_{os.getpid()}_{free_port()}"  # its own in a shared database
    holder = engine.connect()
    try:
        failure = _failure(_select(engine, "SELECT * FROM kvhint_no_such_table"))
        assert not failure.transient and not failure.config
        assert "Relation »kvhint_no_such_table« existiert nicht" in failure.cause
        holder.execute(text(f"CREATE TABLE {table} (x int)"))
        holder.commit()
        holder.execute(text(f"LOCK TABLE {table} IN ACCESS EXCLUSIVE MODE"))

        def blocked() -> object:
            with engine.connect() as conn:
                conn.execute(text("SET lock_timeout = '100ms'"))
                return conn.execute(text(f"SELECT * FROM {table}")).all()

        failure = _failure(blocked)
        assert failure.transient and "Zeitüberschreitung einer Sperre" in failure.cause
    finally:
        holder.rollback()
        holder.execute(text(f"DROP TABLE IF EXISTS {table}"))
        holder.commit()
        holder.close()
        engine.dispose()


def test_a_sqlite_file_that_cannot_be_opened_is_transient(tmp_path: Path) -> None:
    """SQLite's refused connection: the file's folder not there (a volume not mounted
    yet)."""
    engine = create_engine(f"sqlite:///{tmp_path / 'not-yet' / 'kvhint.db'}")
    try:
        failure = _failure(_select(engine, "SELECT 1"))
        assert failure.transient and "unable to open database file" in failure.cause
    finally:
        engine.dispose()


def test_a_file_that_is_not_a_sqlite_database_is_permanent(tmp_path: Path) -> None:
    """SQLite's wrong database: a file that is not one (a path pointing elsewhere)."""
    path = tmp_path / "kvhint.db"
    path.write_bytes(b"not a database, " * 128)
    engine = create_engine(f"sqlite:///{path}")
    try:
        failure = _failure(_select(engine, "SELECT * FROM sqlite_master"))
        assert not failure.transient and "file is not a database" in failure.cause
    finally:
        engine.dispose()


def test_of_several_attempts_one_refused_for_its_settings_decides() -> None:
    """Two addresses, the first refused at the socket, the second a server that says
    the database does not exist: permanent, for the configuration (the server that
    answered is surer than an address nothing listens on, as an IPv6 one of localhost
    often is)."""
    engine = _postgres("postgres", "kvhint_no_such_database")
    url = engine.url.set(host=None, port=None).update_query_pairs(
        [("host", f"127.0.0.1:{free_port()}"),
         ("host", f"{engine.url.host}:{engine.url.port}")])
    engine.dispose()
    engine = create_engine(url, connect_args={"connect_timeout": 5})
    try:
        failure = _failure(_select(engine, "SELECT 1"))
        assert not failure.transient and failure.config
    finally:
        engine.dispose()


@pytest.mark.parametrize(("sqlstate", "transient", "config"), [
    ("57P04", False, False),  # database dropped (a standby replaying its drop)
    ("3D000", False, True),   # no such database
    ("28P01", False, True),   # password authentication failed
    ("28000", False, True),   # invalid authorization (no such role, no pg_hba entry)
    ("57P01", True, False),   # admin shutdown (terminated, a server stopping)
    ("57P02", True, False),   # crash shutdown (another backend crashed)
    ("57P03", True, False),   # cannot connect now (starting up)
    # Idle-in-transaction timeout: the code says no more than the drop (a new
    # connection passes).
    ("25P03", True, False),
])
def test_a_definite_sqlstate_decides_on_a_dropped_connection(
        sqlstate: str, transient: bool, config: bool) -> None:
    """An error that ends the session (FATAL) drops the connection with it, which
    SQLAlchemy says as ``connection_invalidated``. Before, that decided first: 57P04,
    3D000 and 28xxx were 503 "retry later", that no retry fixes. Now the code decides
    where it says what is wrong; the drop only where it does not (25P03). psycopg's own
    error classes, made here: the test server cannot be made to send these on a live
    connection on cue (57P04 comes only from a standby, 57P02 from a crashed backend,
    28xxx and 3D000 only at a connection's start, where libpq keeps the code); 57P01 is
    caused for real below."""
    psycopg = pytest.importorskip("psycopg")
    orig = psycopg.errors.lookup(sqlstate)(f"server said {sqlstate}")
    failure = classify(OperationalError("SELECT 1", {}, orig, connection_invalidated=True))
    assert (failure.transient, failure.config) == (transient, config)


def _throwaway_database() -> tuple[Engine, str]:
    """A new database on the test PostgreSQL (skipped when nothing answers), and the
    name an admin connection to it is made with. The caller drops it."""
    admin = _postgres("postgres", os.environ.get("KVHINT_TEST_PG_DB", "test"))
    name = f"kvhint_dropped_{os.getpid()}_{free_port()}"
    with admin.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    return admin, name


def _on_admin(admin: Engine, sql: str, **params: object) -> None:
    with admin.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text(sql), params)


def test_a_store_connection_an_operator_terminates_is_transient() -> None:
    """pg_terminate_backend on the store's connection from another one: the server says
    57P01 (admin shutdown) and drops it; transient, and the next read (a new
    connection) passes."""
    from kvhint.router.store.database import create_store_engine

    admin, name = _throwaway_database()
    store = create_store_engine(admin.url.set(database=name).render_as_string(False))
    try:
        with store.connect() as conn:
            pid = conn.execute(text("SELECT pg_backend_pid()")).scalar_one()
            _on_admin(admin, "SELECT pg_terminate_backend(:pid)", pid=pid)
            with pytest.raises(STORE_ERRORS) as raised:
                conn.execute(text("SELECT 1")).all()
        assert raised.value.connection_invalidated
        assert getattr(raised.value.orig, "sqlstate", None) == "57P01"
        assert classify(raised.value) == StoreFailure(
            True, "psycopg.errors.AdminShutdown: terminating connection due to "
                  "administrator command")
        assert _select(store, "SELECT 1")() == [(1,)]
    finally:
        store.dispose()
        _on_admin(admin, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.dispose()


def test_a_dropped_store_database_is_permanent_from_the_next_connection() -> None:
    """The store's database dropped WITH (FORCE) from another connection: the server
    ends the store's connection as an operator's terminate (57P01: it cannot be told
    from a restart, transient), then refuses the next one for a database that does not
    exist (3D000, told by its message, for the configuration): permanent, a 500."""
    from kvhint.router.store.database import create_store_engine

    admin, name = _throwaway_database()
    store = create_store_engine(admin.url.set(database=name).render_as_string(False))
    try:
        with store.connect() as conn:
            conn.execute(text("SELECT 1"))
            _on_admin(admin, f'DROP DATABASE "{name}" WITH (FORCE)')
            first = _failure(lambda: conn.execute(text("SELECT 1")).all())
        assert first.transient and "AdminShutdown" in first.cause
        for _ in range(2):  # a connection in the pool, then a new one: the same
            failure = _failure(_select(store, "SELECT 1"))
            assert not failure.transient and failure.config
            assert f'database "{name}" does not exist' in failure.cause
    finally:
        store.dispose()
        _on_admin(admin, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.dispose()
