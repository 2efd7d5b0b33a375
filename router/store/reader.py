"""Reads from the store: restart recovery and the admin API's history queries.

Synchronous (SQLAlchemy Core); the service runs them in a worker thread.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Connection, Engine, bindparam, func, select, text

from kvhint.router.store.legacy_rows import (
    LEGACY_LOOKBACK_S,
    with_derived_columns,
    worker_budgets,
)
from kvhint.router.store.models import (
    CursorRow,
    HintActionRow,
    LearnedStatsRow,
    ResponseSessionRow,
    SessionRow,
    WorkerRow,
)
from kvhint.schemas import Budgets

NON_TERMINAL = ("pending", "deferred")
HOLDING_STATUSES = ("accepted", "clipped")
# A Prefetch holds too: its worker retains what it applied (accepted or clipped) until its
# deadline (engine_plugin/prefetch.py), and its row's ``expires_at`` is that deadline (sent
# + ``deadline_s``; legacy_rows derives it so for a row without one). Before, only Pins
# and Retains were read back, and after a restart the budgets believed that room free.
HOLDING_TYPES = ("kv.pin", "kv.retain", "kv.prefetch")

# The lookups by primary key a request may make (a session's row before each turn of
# it, session_reads.py; a stored response's session, responses_sessions.py), built once
# with bound parameters: immutable, so threads share them, and SQLAlchemy keeps each
# one's cache key, where a statement built per read cost more CPU than the read itself
# (0.18 ms a read against 0.07 ms on a local SQLite file, BENCHMARKS.md).
_SESSION_BY_KEY = select(*SessionRow.__table__.columns).where(
    SessionRow.tenant == bindparam("tenant"), SessionRow.session_id == bindparam("session_id"))
_RESPONSE_SESSION_BY_ID = select(ResponseSessionRow.tenant, ResponseSessionRow.session_id
                                 ).where(ResponseSessionRow.response_id == bindparam("response_id"))


@dataclass(frozen=True)
class RecoveryState:
    sessions: list[dict[str, Any]] = field(default_factory=list)
    pending_actions: list[dict[str, Any]] = field(default_factory=list)
    # Answered Pins/Retains/Prefetches whose TTL (deadline) is not over, oldest first.
    held_actions: list[dict[str, Any]] = field(default_factory=list)
    learned: list[dict[str, Any]] = field(default_factory=list)
    workers: list[dict[str, Any]] = field(default_factory=list)
    cursors: dict[str, int] = field(default_factory=dict)
    # Pending or held action rows left out for a payload that is no JSON object
    # (:func:`_readable_action`): the caller counts them.
    unreadable_actions: int = 0


def _rows(engine: Engine, statement: Any) -> list[dict[str, Any]]:
    with engine.connect() as conn:
        return _read(conn, statement)


def _read(conn: Connection, statement: Any, parameters: dict[str, Any] | None = None
          ) -> list[dict[str, Any]]:
    return [dict(row._mapping) for row in conn.execute(statement, parameters)]


@contextmanager
def _snapshot(engine: Engine) -> Iterator[Connection]:
    """A connection whose reads all see the store as of one moment (one transaction,
    read only), for as long as the block lasts.

    PostgreSQL: REPEATABLE READ, READ ONLY (the snapshot is taken at the first read; READ
    COMMITTED takes one per statement). SQLite: Python's sqlite3 opens no transaction
    before a SELECT (each read is its own, WAL then shows each the latest commit), so the
    block opens one itself (BEGIN: its first read fixes the WAL snapshot); SQLAlchemy's
    commit at the end closes it. Neither blocks a writer."""
    with engine.connect() as conn:
        if conn.dialect.name == "postgresql":
            conn = conn.execution_options(isolation_level="REPEATABLE READ",
                                          postgresql_readonly=True)
        with conn.begin():
            if conn.dialect.name == "sqlite":
                conn.exec_driver_sql("BEGIN")
            yield conn


def load_recovery(engine: Engine, active_since: float, max_sessions: int,
                  now: float | None = None) -> RecoveryState:
    """Sessions active since ``active_since`` (newest first, at most ``max_sessions``),
    actions still waiting for an outcome, the Pins/Retains/Prefetches still held at
    ``now`` (None: not loaded), learned statistics, workers and cursors.

    Action rows a router of the store's first schema wrote (``scope`` and ``expires_at``
    NULL) come back with the two derived from their payload and sent time, as the router
    writes them now (:mod:`kvhint.router.store.legacy_rows`): they are held, and counted
    against the budgets, until their TTL really ends.

    Everything is read in one transaction (:func:`_snapshot`): routers sharing the store
    (replicas on one PostgreSQL) write while another starts. Before, each read was a
    transaction of its own, and together they mixed moments: an action without the
    session it belongs to, a held action of a worker deleted meanwhile."""
    with _snapshot(engine) as conn:
        sessions = _read(conn, select(*SessionRow.__table__.columns)
                         .where(SessionRow.last_activity >= active_since)
                         .order_by(SessionRow.last_activity.desc()).limit(max_sessions))
        workers = _read(conn, select(*WorkerRow.__table__.columns))
        budgets = worker_budgets(workers)
        waiting = _read(conn, select(*HintActionRow.__table__.columns)
                        .where(HintActionRow.status.in_(NON_TERMINAL)))
        pending = [with_derived_columns(row, budgets.get(row["worker_id"]))
                   for row in waiting if _readable_action(row)]
        held, unheld = ([], 0) if now is None else _held_actions(conn, now, budgets)
        unreadable = len(waiting) - len(pending) + unheld
        learned = _read(conn, select(*LearnedStatsRow.__table__.columns))
        cursors = {row["name"]: row["value"]
                   for row in _read(conn, select(*CursorRow.__table__.columns))}
    return RecoveryState(sessions, pending, held, learned, workers, cursors, unreadable)


def _readable_action(row: Mapping[str, Any]) -> bool:
    """Whether an action row's payload is a JSON object, as every router writes it. One
    that is not (a hand edit, a restore from elsewhere; on SQLite, text that is not JSON:
    database._stored_json) cannot say what the action holds or targets; restored, it
    failed the router's start (its holding's keys read the payload)."""
    return isinstance(row.get("payload"), dict)


def _held_actions(conn: Connection, now: float, budgets: Mapping[str, Budgets]
                  ) -> tuple[list[dict[str, Any]], int]:
    """Answered Pins/Retains/Prefetches whose TTL is not over at ``now`` (a Prefetch's:
    its deadline), oldest first: the rows
    that say so (a range of the ``expires_at`` index), and those that do not say when
    they end (written without ``expires_at``, sent within the longest TTL any action
    may have) whose derived end is after ``now``; and how many such rows were left out
    as unreadable (:func:`_readable_action`)."""
    holding = (HintActionRow.status.in_(HOLDING_STATUSES),
               HintActionRow.action_type.in_(HOLDING_TYPES))
    live = _read(conn, select(*HintActionRow.__table__.columns)
                 .where(*holding, HintActionRow.expires_at > now)
                 .order_by(HintActionRow.created_at))
    undated = _read(conn, select(*HintActionRow.__table__.columns)
                    .where(*holding, HintActionRow.expires_at.is_(None),
                           HintActionRow.created_at > now - LEGACY_LOOKBACK_S)
                    .order_by(HintActionRow.created_at))
    read = len(live) + len(undated)
    live = [row for row in live if _readable_action(row)]
    undated = [row for row in undated if _readable_action(row)]
    unreadable = read - len(live) - len(undated)
    if not undated:
        return live, unreadable
    derived = [row for row in (with_derived_columns(r, budgets.get(r["worker_id"]))
                               for r in undated)
               if row["expires_at"] is not None and row["expires_at"] > now]
    return sorted(live + derived, key=lambda row: row["created_at"]), unreadable


def query_hints(engine: Engine, status: str | None = None, tenant: str | None = None,
                session_id: str | None = None, worker_id: str | None = None,
                limit: int = 100) -> list[dict[str, Any]]:
    statement = select(*HintActionRow.__table__.columns)
    if status is not None:
        statement = statement.where(HintActionRow.status == status)
    if tenant is not None:
        statement = statement.where(HintActionRow.tenant == tenant)
    if session_id is not None:
        statement = statement.where(HintActionRow.session_id == session_id)
    if worker_id is not None:
        statement = statement.where(HintActionRow.worker_id == worker_id)
    statement = statement.order_by(HintActionRow.created_at.desc()).limit(limit)
    return _rows(engine, statement)


def count_hints_by_status(engine: Engine, tenant: str | None = None) -> dict[str, int]:
    statement = select(HintActionRow.status, func.count()).group_by(HintActionRow.status)
    if tenant is not None:
        statement = statement.where(HintActionRow.tenant == tenant)
    with engine.connect() as conn:
        return {status: count for status, count in conn.execute(statement)}


def query_sessions(engine: Engine, tenant: str | None = None, state: str | None = None,
                   limit: int = 100) -> list[dict[str, Any]]:
    statement = select(*SessionRow.__table__.columns)
    if tenant is not None:
        statement = statement.where(SessionRow.tenant == tenant)
    if state is not None:
        statement = statement.where(SessionRow.state == state)
    statement = statement.order_by(SessionRow.last_activity.desc()).limit(limit)
    return _rows(engine, statement)


def get_session(engine: Engine, tenant: str, session_id: str) -> dict[str, Any] | None:
    with engine.connect() as conn:
        rows = _read(conn, _SESSION_BY_KEY, {"tenant": tenant, "session_id": session_id})
    return rows[0] if rows else None


def get_session_within(engine: Engine, tenant: str, session_id: str, timeout_s: float
                       ) -> dict[str, Any] | None:
    """:func:`get_session`, one lookup by the primary key (tenant and session: never
    another tenant's row), whose statement gives up past ``timeout_s`` on PostgreSQL
    (:func:`_statement_timeout`): for a turn of a session this router has not seen, read
    with a bounded wait (service.session_reads)."""
    with engine.connect() as conn, conn.begin():
        _statement_timeout(conn, timeout_s)
        rows = _read(conn, _SESSION_BY_KEY, {"tenant": tenant, "session_id": session_id})
    return rows[0] if rows else None


# Session ids per statement of :func:`session_revisions_within` (bound parameters: far
# under SQLite's and PostgreSQL's limits).
_REVISIONS_CHUNK = 500


def session_revisions_within(engine: Engine, keys: Sequence[tuple[str, str]],
                             timeout_s: float) -> dict[tuple[str, str], int]:
    """The ``revision`` of each stored row of ``keys`` ((tenant, session id) pairs; one
    without a row is absent), in one transaction, a statement per tenant and 500 ids,
    each given up past ``timeout_s`` on PostgreSQL (:func:`_statement_timeout`): which
    of a tick's due idle reviews another replica saved since (service.idle_reviews)."""
    by_tenant: dict[str, list[str]] = {}
    for tenant, session_id in keys:
        by_tenant.setdefault(tenant, []).append(session_id)
    found: dict[tuple[str, str], int] = {}
    with engine.connect() as conn, conn.begin():
        _statement_timeout(conn, timeout_s)
        for tenant, ids in by_tenant.items():
            for at in range(0, len(ids), _REVISIONS_CHUNK):
                statement = select(SessionRow.session_id, SessionRow.revision).where(
                    SessionRow.tenant == tenant,
                    SessionRow.session_id.in_(ids[at:at + _REVISIONS_CHUNK]))
                for session_id, revision in conn.execute(statement):
                    found[(tenant, session_id)] = revision or 0
    return found


def _statement_timeout(conn: Connection, timeout_s: float) -> None:
    """On PostgreSQL the statements of ``conn``'s transaction give up past ``timeout_s``
    (``statement_timeout``, this transaction's only), so a read its caller stopped
    waiting for does not hold a connection and a thread for as long as a lock held on
    the table lasts. SQLite's reads (WAL) wait for no writer."""
    if conn.dialect.name == "postgresql":
        conn.execute(text("SELECT set_config('statement_timeout', :value, true)"),
                     {"value": f"{max(1, round(timeout_s * 1000))}ms"})


# The claims a session's release supersedes on the worker (live_agent_claims_within).
_SESSION_CLAIM_TYPES = ("kv.pin", "kv.retain")


def live_agent_claims_within(engine: Engine, tenant: str, session_id: str, now: float,
                             timeout_s: float) -> list[dict[str, Any]]:
    """The agent runtimes' claims on ``tenant``'s session ``session_id`` that may still
    hold at ``now``, whichever replica sent them: its rows sent by the hints API (source
    and trigger ``api``: not the releases an end sent), a Pin or Retain, pending or
    holding, with a TTL not over; (action id, worker, scope), oldest
    first. Not a Prefetch: its retain is a claim of no session on the worker (the ledger's
    ``prefetch_scope``), which an end's session release leaves; before, a stored Prefetch
    was named by the release (``kve-``), and its replica's ledger dropped a retain the
    worker kept to its deadline (or a later Prefetch hid the Pin the release ended). One
    range of the (tenant, session) index, given up past ``timeout_s`` on PostgreSQL
    (:func:`_statement_timeout`; service.agent_releases)."""
    statement = (select(HintActionRow.action_id, HintActionRow.worker_id, HintActionRow.scope)
                 .where(HintActionRow.tenant == tenant,
                        HintActionRow.session_id == session_id,
                        HintActionRow.source == "api", HintActionRow.trigger == "api",
                        HintActionRow.action_type.in_(_SESSION_CLAIM_TYPES),
                        HintActionRow.status.in_(HOLDING_STATUSES + NON_TERMINAL),
                        HintActionRow.expires_at > now)
                 .order_by(HintActionRow.created_at))
    with engine.connect() as conn, conn.begin():
        _statement_timeout(conn, timeout_s)
        return _read(conn, statement)


def get_response_session(engine: Engine, response_id: str, timeout_s: float
                         ) -> tuple[str, str] | None:
    """(tenant, session id) the stored response ``response_id`` was made in, or None: one
    lookup by the primary key, given up past ``timeout_s`` on PostgreSQL
    (:func:`_statement_timeout`; service.responses_sessions)."""
    with engine.connect() as conn, conn.begin():
        _statement_timeout(conn, timeout_s)
        row = conn.execute(_RESPONSE_SESSION_BY_ID, {"response_id": response_id}).first()
    return None if row is None else (row.tenant, row.session_id)
