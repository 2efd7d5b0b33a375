"""A store read the database failed: for now (transient) or for good (permanent).

The admin API reads the store on request (hint history, sessions no longer in memory).
When the database fails such a read, the answer tells the caller whether to retry:

- transient, 503 "retry later": the database is unreachable or went away (connection
  refused, lost, timed out), is busy or locked, short of resources or shutting down;
- permanent, 500: the database answers but cannot serve the read as the router asks it:
  a table or column missing (SQLite "no such table", PostgreSQL 42P01: a schema not
  migrated, dropped, restored from elsewhere), a file that is not a database or is
  corrupt, access refused. A retry gets the same answer until an operator fixes the
  store. Each distinct cause is logged once (with the statement); every one is counted.
  So is a connection the server refuses for the router's configuration (a role or
  database that does not exist, authentication failed, no pg_hba.conf entry): the 500
  names the cause and says the store's settings (``database_url``) need fixing.

Before, every OperationalError was a 503, and SQLite raises its "no such table" as one:
a missing schema invited clients to retry for good. (PostgreSQL's, a ProgrammingError,
was a 500 counted as the router's internal error, with a traceback each time.)

SQLAlchemy wraps the driver's exception (``.orig``). It is classified by codes first,
so an error the server reports in another language is classified as in English:

1. the SQLSTATE (psycopg ``sqlstate``, psycopg2 ``pgcode``;
   :func:`kvhint.router.store.db_errors.sqlstate`), whether or not the connection dropped
   with it (an error that ends the session, FATAL, always drops it). A code that says
   what is wrong decides: permanent, 57P04 (database dropped), 3D000 (no such database)
   and class 28 (authentication: for the configuration, as below); transient, classes
   08, 40, 53, 57 (57P01 admin shutdown, 57P02 crash shutdown, 57P03 cannot connect
   now...) and 58, 55P03, 55006. Any other code is about the statement (42P01 no such
   table, 22xxx bad data...) and permanent, unless the connection dropped with it (25P03
   idle-in-transaction timeout): a new connection may pass, transient. Before, a
   dropped connection decided first, so 57P04 or 28P01 on one was a 503 "retry later"
   that no retry fixes;
2. SQLAlchemy's own verdict (``connection_invalidated``: the connection dropped);
3. sqlite3's result code (``sqlite_errorcode``, Python 3.11+; its message on 3.10, which
   has no code: SQLite's messages are English, it has no translations).

The message is the last resort, for one case only: a connection the server refused
while it started. libpq keeps the SQLSTATE the server sent then to itself (no libpq
function returns it: psycopg's error has ``sqlstate`` None and an empty ``diag``), and
the socket is libpq's, so no errno comes either (checked with psycopg 3.3, libpq 18).
The server's FATAL text for a refusal of the router's settings (below) is matched;
anything else is transient: libpq's own socket failures (refused, unreachable, timed
out: psycopg's ConnectionTimeout), the server starting up or shutting down, too many
clients. The server writes that text in its ``lc_messages`` language: one in another
language ("FATAL:  Datenbank »x« existiert nicht") is not recognised and is transient,
the answer that costs least when wrong (a client retries in vain, rather than giving up
while a server restarts). Of several attempts (hosts, or addresses of one host) one
refused for the settings decides: the server that answered is surer than a host that
did not (an IPv6 address the server does not listen on). Last, the DB-API class
(OperationalError transient, as before, the others permanent).
"""

from __future__ import annotations

import logging
import re
import sqlite3
from dataclasses import dataclass

from sqlalchemy.exc import DBAPIError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeoutError
from starlette.requests import Request
from starlette.responses import Response

from kvhint.router.service.inbound import error_response
from kvhint.router.store.db_errors import sqlstate as driver_sqlstate

log = logging.getLogger(__name__)

# The exceptions create_app hands to StoreReadErrors: any error the database driver
# raised, and the connection pool's own timeout (every connection busy: transient).
STORE_ERRORS = (DBAPIError, PoolTimeoutError)

# SQLite primary result codes of a condition that passes: ABORT (rolled back), BUSY,
# LOCKED, NOMEM, INTERRUPT, IOERR, FULL, CANTOPEN (a volume not there yet), PROTOCOL,
# SCHEMA (changed while prepared: prepared again). SQLITE_ERROR (1: no such table or
# column), CORRUPT, NOTADB, PERM, READONLY, AUTH... do not.
_SQLITE_TRANSIENT_CODES = frozenset({4, 5, 6, 7, 9, 10, 13, 14, 15, 17})
# The same, by message, where sqlite3 gives no code (Python 3.10).
_SQLITE_TRANSIENT_MESSAGES = ("database is locked", "database table is locked",
                              "disk i/o error", "unable to open database file",
                              "database or disk is full", "interrupted",
                              "database schema has changed")
# SQLSTATE classes of a condition that passes: 08 connection exception, 40 transaction
# rollback (serialization failure, deadlock), 53 insufficient resources (too many
# connections, out of memory or disk), 57 operator intervention (statement timeout,
# server shutting down or starting), 58 system error (I/O).
_PG_TRANSIENT_CLASSES = frozenset({"08", "40", "53", "57", "58"})
_PG_TRANSIENT_STATES = frozenset({"55P03", "55006"})  # lock not available, object in use
_PG_PERMANENT_STATES = frozenset({"57P04"})  # database dropped
# SQLSTATEs of a refusal of the router's settings: 3D000 (no such database) and class 28
# (invalid authorization: bad password, no such role, no pg_hba.conf entry).
_PG_CONFIG_STATES = frozenset({"3D000"})
_PG_CONFIG_CLASSES = frozenset({"28"})
# The last resort (module docstring): the server's English message (lower case) for a
# connection it refused for the router's configuration, which no retry fixes:
# 28P01/28000 (authentication failed for the method the server asks, a role that does
# not exist or may not log in, no pg_hba.conf entry), 3D000 (no such database), 42501
# (no CONNECT privilege), 55000 (the database does not accept connections), and libpq's
# own "no password supplied".
_PG_CONNECT_CONFIG_ERRORS = re.compile(
    r"authentication failed for user|no pg_hba\.conf entry|role \".*\" does not exist"
    r"|is not permitted to log in|database \".*\" does not exist"
    r"|permission denied for database|is not currently accepting connections"
    r"|no password supplied")
# Distinct permanent causes remembered as logged (a bound: the causes are few).
_MAX_LOGGED_CAUSES = 256


@dataclass(frozen=True, slots=True)
class StoreFailure:
    transient: bool
    # The driver's exception, one line: "sqlite3.OperationalError: no such table: x".
    cause: str
    # Permanent because the server refused the router's connection settings (role,
    # password, database): the fix is in the configuration, not in the store's data.
    config: bool = False


def classify(exc: DBAPIError | PoolTimeoutError) -> StoreFailure:
    """Whether the failed read may succeed if retried, and why it failed."""
    if isinstance(exc, PoolTimeoutError):
        return StoreFailure(True, f"connection pool: {_first_line(exc)}")
    orig = exc.orig
    cause = f"{type(orig).__module__}.{type(orig).__name__}: {_first_line(orig)}"
    sqlstate = driver_sqlstate(orig)
    if sqlstate is not None:
        return _by_sqlstate(sqlstate, exc.connection_invalidated, cause)
    if exc.connection_invalidated:
        return StoreFailure(True, cause)
    if isinstance(orig, sqlite3.Error):
        code = getattr(orig, "sqlite_errorcode", None)
        if isinstance(code, int):
            return StoreFailure((code & 0xFF) in _SQLITE_TRANSIENT_CODES, cause)
        message = str(orig).lower()
        return StoreFailure(any(m in message for m in _SQLITE_TRANSIENT_MESSAGES), cause)
    if _PG_CONNECT_CONFIG_ERRORS.search(str(orig).lower()):
        return StoreFailure(False, cause, config=True)
    return StoreFailure(isinstance(exc, OperationalError), cause)


def _by_sqlstate(sqlstate: str, dropped: bool, cause: str) -> StoreFailure:
    """The verdict of a PostgreSQL error's SQLSTATE (module docstring, 1), the connection
    having ``dropped`` with it or not."""
    if sqlstate in _PG_CONFIG_STATES or sqlstate[:2] in _PG_CONFIG_CLASSES:
        return StoreFailure(False, cause, config=True)
    if sqlstate in _PG_PERMANENT_STATES:
        return StoreFailure(False, cause)
    if sqlstate[:2] in _PG_TRANSIENT_CLASSES or sqlstate in _PG_TRANSIENT_STATES:
        return StoreFailure(True, cause)
    return StoreFailure(dropped, cause)


class StoreReadErrors:
    """The app's exception handler for :data:`STORE_ERRORS` (one per app: it remembers
    the permanent causes it has logged)."""

    def __init__(self) -> None:
        self._logged: set[str] = set()

    async def __call__(self, request: Request, exc: Exception) -> Response:
        assert isinstance(exc, STORE_ERRORS)
        failure = classify(exc)
        runtime = getattr(request.app.state, "runtime", None)
        path = request.url.path
        if failure.transient:
            log.warning("store unavailable on %s: %s", path, failure.cause)
            if runtime is not None:
                runtime.metrics.drop("store_read_error")
            return error_response("the router's store cannot be read right now; retry later", 503)
        if runtime is not None:
            runtime.metrics.drop("store_read_error:permanent")
        if failure.cause not in self._logged:
            if len(self._logged) < _MAX_LOGGED_CAUSES:
                self._logged.add(failure.cause)
            statement = " ".join(str(getattr(exc, "statement", "") or "").split())[:300]
            log.error("store read on %s failed, and will until the store is fixed: %s "
                      "(statement: %s). Logged once; each one is counted as "
                      "drops{what=\"store_read_error:permanent\"}", path, failure.cause,
                      statement or "-")
        if failure.config:
            return error_response(f"the router's store refuses its connection ({failure.cause}); "
                          "retrying will not help until the router's database_url (its "
                          "role, password or database) or the server's access rules are "
                          "fixed", 500)
        return error_response(f"the router's store cannot serve this read ({failure.cause}); "
                      "retrying will not help until the store is fixed (its schema "
                      "migrated, its database restored)", 500)


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[0][:300] if lines else type(error).__name__
