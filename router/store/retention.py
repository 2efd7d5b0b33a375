"""How long the store keeps history: rows older than the retention window are deleted.

Only history goes: answered hint actions (never one still pending or deferred, nor a
Pin/Retain whose TTL is not over), sessions idle since before the window, and workers
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
"""

from __future__ import annotations

from sqlalchemy import Engine, delete, or_, select

from kvhint.router.store.models import (
    FEEDBACK_KIND_PREFIX,
    FEEDBACK_TENANT,
    HintActionRow,
    LearnedStatsRow,
    SessionRow,
    WorkerRow,
)
from kvhint.router.store.reader import NON_TERMINAL


def prune_history(engine: Engine, before: float) -> dict[str, int]:
    """Delete history older than ``before`` (seconds since the epoch); returns the rows
    deleted per table."""
    actions = delete(HintActionRow).where(
        HintActionRow.created_at < before,
        HintActionRow.status.not_in(NON_TERMINAL),
        or_(HintActionRow.expires_at.is_(None), HintActionRow.expires_at < before))
    sessions = delete(SessionRow).where(SessionRow.last_activity < before)
    gone = (WorkerRow.from_config.is_(False),
            or_(WorkerRow.last_seen.is_(None), WorkerRow.last_seen < before))
    deleted = dict.fromkeys(("hint_actions", "learned_stats", "sessions", "workers"), 0)
    with engine.begin() as conn:
        # First, a write: on SQLite it takes the write lock for the whole transaction.
        deleted["hint_actions"] += conn.execute(actions).rowcount or 0
        deleted["sessions"] += conn.execute(sessions).rowcount or 0
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
    return deleted
