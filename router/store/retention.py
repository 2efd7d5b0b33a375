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
"""

from __future__ import annotations

from sqlalchemy import Engine, String, delete, literal, or_, select

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
    of_gone_workers = delete(HintActionRow).where(
        HintActionRow.worker_id.in_(select(WorkerRow.worker_id).where(*gone)))
    feedback_of_gone_workers = delete(LearnedStatsRow).where(
        LearnedStatsRow.tenant == FEEDBACK_TENANT,
        LearnedStatsRow.kind.in_(
            select(literal(FEEDBACK_KIND_PREFIX, String) + WorkerRow.worker_id).where(*gone)))
    workers = delete(WorkerRow).where(*gone)
    deleted: dict[str, int] = {}
    with engine.begin() as conn:
        for table, statement in (("hint_actions", actions), ("hint_actions", of_gone_workers),
                                 ("learned_stats", feedback_of_gone_workers),
                                 ("sessions", sessions), ("workers", workers)):
            deleted[table] = deleted.get(table, 0) + (conn.execute(statement).rowcount or 0)
    return deleted
