"""How long the store keeps history: rows older than the retention window are deleted.

Only history goes: answered hint actions (never one still pending or deferred, nor a
Pin/Retain whose TTL is not over), sessions idle since before the window, the sessions
of Responses API responses made before a window of their own, no longer
(models.ResponseSessionRow; ``responses.session_retention_s``: one a day by default, at
100 responses/s ~9 million rows instead of ~60 million over 7 days), and workers
learned from heartbeats (never configured ones) not heard since, with every action of
theirs (the foreign key would cascade to them anyway: deleted first, so that they are
counted) and their outcome feedback row (``learned_stats``, models.FEEDBACK_TENANT /
FEEDBACK_KIND_PREFIX), in the same transaction: as the router's forgetting a worker
does (hint_learned.LearnedState.forget_worker). Before, the feedback row stayed until a
router's next start found its worker gone. Synchronous (SQLAlchemy Core); the service
runs it in a worker thread.

A worker heard while it is pruned keeps its row, actions and feedback, or loses all
three: its rows are locked first (PostgreSQL: ``FOR UPDATE``, which under READ
COMMITTED re-checks a row a heartbeat changed meanwhile and leaves it out; a heartbeat
after waits for the commit; SQLite: the transaction's first statement, a delete, holds
the database's write lock to the commit), and only the actions, feedback and rows of
the workers locked are deleted. Before, each delete chose "not heard since" anew: a
heartbeat between them left a worker's row without its actions and feedback.

Feedback rows whose worker has no row go too, whenever they were written: another
replica's late save of what a worker it still remembered taught (one this replica
pruned meanwhile), or an older release's. Before, they stayed until a router's next
start found their worker gone. (A feedback row rewritten, in the same transaction as its
worker's row, by a replica that hears the worker again while this delete runs may go with
them, PostgreSQL re-reading the row without the worker's: that replica writes it again at
the worker's next outcome.) Sessions and actions need no such sweep: their foreign keys
set NULL or delete them with the worker's row (revisions 0003, 0004).
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import Connection, Engine, delete, exists, func, or_, select

from kvhint.router.store.models import (
    FEEDBACK_KIND_PREFIX,
    FEEDBACK_TENANT,
    HintActionRow,
    LearnedStatsRow,
    ResponseSessionRow,
    SessionRow,
    WorkerRow,
)
from kvhint.router.store.reader import NON_TERMINAL


@dataclass(frozen=True)
class Pruned:
    # Rows deleted per table.
    deleted: dict[str, int]
    # The workers whose rows were deleted (their actions and feedback with them).
    workers: tuple[str, ...]


def prune_history(engine: Engine, before: float,
                  responses_before: float | None = None) -> dict[str, int]:
    """Delete history older than ``before`` (seconds since the epoch); returns the rows
    deleted per table."""
    return prune(engine, before, responses_before).deleted


def prune(engine: Engine, before: float, responses_before: float | None = None) -> Pruned:
    """Delete history older than ``before`` (seconds since the epoch), and feedback rows
    whose worker has no row; returns the rows deleted per table and the workers pruned
    (whose feedback the router lets go of in memory too).

    Responses' sessions go from ``responses_before`` (``responses.session_retention_s``
    ago), or ``before`` where that is later or None: never kept past the rest of history
    (``store_retention_s``)."""
    responses_before = before if responses_before is None else max(before, responses_before)
    actions = delete(HintActionRow).where(
        HintActionRow.created_at < before,
        HintActionRow.status.not_in(NON_TERMINAL),
        or_(HintActionRow.expires_at.is_(None), HintActionRow.expires_at < before))
    sessions = delete(SessionRow).where(SessionRow.last_activity < before)
    response_sessions = delete(ResponseSessionRow).where(
        ResponseSessionRow.created_at < responses_before)
    gone = (WorkerRow.from_config.is_(False),
            or_(WorkerRow.last_seen.is_(None), WorkerRow.last_seen < before))
    deleted = dict.fromkeys(("hint_actions", "learned_stats", "response_sessions",
                             "sessions", "workers"), 0)
    with engine.begin() as conn:
        # First, a write: on SQLite it takes the write lock for the whole transaction.
        deleted["hint_actions"] += conn.execute(actions).rowcount or 0
        deleted["sessions"] += conn.execute(sessions).rowcount or 0
        deleted["response_sessions"] += conn.execute(response_sessions).rowcount or 0
        ids = list(conn.execute(
            select(WorkerRow.worker_id).where(*gone).with_for_update()).scalars())
        if ids:
            deleted["hint_actions"] += conn.execute(delete(HintActionRow).where(
                HintActionRow.worker_id.in_(ids))).rowcount or 0
            deleted["learned_stats"] += conn.execute(delete(LearnedStatsRow).where(
                LearnedStatsRow.tenant == FEEDBACK_TENANT, LearnedStatsRow.kind.in_(
                    [FEEDBACK_KIND_PREFIX + worker_id for worker_id in ids]))).rowcount or 0
            deleted["workers"] += conn.execute(delete(WorkerRow).where(
                WorkerRow.worker_id.in_(ids))).rowcount or 0
        deleted["learned_stats"] += _delete_orphan_feedback(conn)
    return Pruned(deleted, tuple(ids))


def _delete_orphan_feedback(conn: Connection) -> int:
    """Delete the feedback rows (models.FEEDBACK_TENANT, FEEDBACK_KIND_PREFIX + worker)
    of workers without a row; returns how many."""
    named = func.substr(LearnedStatsRow.kind, len(FEEDBACK_KIND_PREFIX) + 1)
    return conn.execute(delete(LearnedStatsRow).where(
        LearnedStatsRow.tenant == FEEDBACK_TENANT,
        LearnedStatsRow.kind.startswith(FEEDBACK_KIND_PREFIX, autoescape=True),
        ~exists().where(WorkerRow.worker_id == named))).rowcount or 0
