"""The router's tables (SQLAlchemy 2). The schema is owned by the Alembic migrations in
``migrations/`` (package ``kvhint.migrations``); a test checks the two agree.

Times are unix seconds (float) as the wire contract uses them. Session ids are the
client's own id, keyed with the tenant (``(tenant, session_id)``); the worker-visible id is
``<tenant>/<session_id>``.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import (JSON, BigInteger, Boolean, Float, ForeignKey, Index, Integer, String,
                        Text)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


class Base(DeclarativeBase):
    pass


class TenantRow(Base):
    __tablename__ = "tenants"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    cache_salt: Mapped[str | None] = mapped_column(String(128))
    created_at: Mapped[float] = mapped_column(Float)


class WorkerRow(Base):
    __tablename__ = "workers"

    worker_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    url: Mapped[str | None] = mapped_column(String(512))
    from_config: Mapped[bool] = mapped_column(Boolean, default=False)
    epoch: Mapped[str | None] = mapped_column(String(128))
    model: Mapped[str | None] = mapped_column(String(512))
    cache_namespace: Mapped[str | None] = mapped_column(String(512))
    block_size: Mapped[int | None] = mapped_column(Integer)
    last_seen: Mapped[float | None] = mapped_column(Float)
    # The last heartbeat as JSON (status, budgets, usage).
    status: Mapped[dict[str, Any] | None] = mapped_column(JSON)


class SessionRow(Base):
    __tablename__ = "sessions"

    tenant: Mapped[str] = mapped_column(String(64), primary_key=True)
    session_id: Mapped[str] = mapped_column(String(256), primary_key=True)
    # The worker of its last turn, while that worker has a row: a session outlives its
    # worker, so deleting the worker's row (forgotten, dropped from the config, pruned)
    # sets this NULL (revision 0004), and the writer writes NULL for a worker without a
    # row (writer.StoreWriter: a refused row would lose the session's turns). Before,
    # it kept naming a worker the store no longer held.
    worker_id: Mapped[str | None] = mapped_column(
        String(128), ForeignKey("workers.worker_id", name="fk_sessions_worker",
                                ondelete="SET NULL"))
    turns: Mapped[int] = mapped_column(Integer, default=0)
    created_at: Mapped[float] = mapped_column(Float)
    last_activity: Mapped[float] = mapped_column(Float)
    ended_at: Mapped[float | None] = mapped_column(Float)
    # active | tool_gap | ended
    state: Mapped[str] = mapped_column(String(16), default="active")
    # The open tool gap: {"tools": [...], "started_at": t, "worker_id": w} or null.
    open_gap: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    # Per-session counters and the tool gaps it saw: {"gaps": [...], ...}.
    tool_gap_stats: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    # The hint planner's own state for the session (policy.session.SessionPlanState).
    plan: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    prompt_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    cached_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    predicted_cached_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    # How many saves the row has had (revision 0006): a router saves its record of the
    # session only where the row is still at the revision it last read or wrote, else it
    # reads the row again and merges (writer.StoreWriter.upsert_versioned,
    # service.session_merge). A router of the release before leaves it as it is; on
    # PostgreSQL a trigger (revision 0007) then moves it on, so its saves are merged too.
    revision: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    # The replica (``routing.replica_id``) that saw the session's latest event (revision
    # 0009): a replica restarting leaves the idle review of a session another replica
    # served last to that one. NULL: not known (no id set, or a router from before).
    latest_replica: Mapped[str | None] = mapped_column(String(128))

    __table_args__ = (
        Index("ix_sessions_last_activity", "last_activity"),
        # A worker's deletion finds its sessions (the foreign key's SET NULL).
        Index("ix_sessions_worker", "worker_id"),
    )


# The key of a worker's outcome feedback row in ``learned_stats``: (FEEDBACK_TENANT,
# FEEDBACK_KIND_PREFIX + worker id). Written by the router (service.hint_learned); deleted
# with the worker's row wherever that goes (forgotten, dropped at a restart, pruned by
# retention: store.retention).
FEEDBACK_TENANT = "*"
FEEDBACK_KIND_PREFIX = "feedback:"


class LearnedStatsRow(Base):
    """The planner's learned statistics (tool gaps per tool and depth), as its own plain
    data; one row per tenant and kind."""

    __tablename__ = "learned_stats"

    tenant: Mapped[str] = mapped_column(String(64), primary_key=True)
    kind: Mapped[str] = mapped_column(String(64), primary_key=True)
    data: Mapped[dict[str, Any]] = mapped_column(JSON)
    updated_at: Mapped[float] = mapped_column(Float)


class HintActionRow(Base):
    __tablename__ = "hint_actions"

    action_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    message_id: Mapped[str] = mapped_column(String(128))
    tenant: Mapped[str | None] = mapped_column(String(64))
    session_id: Mapped[str | None] = mapped_column(String(256))
    # The worker's row owns the action's: deleting the worker (forgotten, dropped from
    # the config, pruned) deletes its actions in the same statement (revision 0003;
    # SQLite enforces it with PRAGMA foreign_keys, database.py). Before, they stayed, and
    # a restart restored a gone worker's holds against its tenant's budget.
    worker_id: Mapped[str] = mapped_column(
        String(128), ForeignKey("workers.worker_id", name="fk_hint_actions_worker",
                                ondelete="CASCADE"))
    action_type: Mapped[str] = mapped_column(String(32))
    # planner | api
    source: Mapped[str] = mapped_column(String(16))
    # Why it was sent (tool_gap_open, session_end, session_moved, api, ...).
    trigger: Mapped[str] = mapped_column(String(64), default="")
    payload: Mapped[dict[str, Any]] = mapped_column(JSON)
    # pending (sent, nothing back yet) | deferred | accepted | clipped | rejected | missing
    # | expired (no terminal outcome in time) | failed (could not be sent)
    status: Mapped[str] = mapped_column(String(16))
    reason: Mapped[str] = mapped_column(Text, default="")
    requested_blocks: Mapped[int] = mapped_column(Integer, default=0)
    requested_tokens: Mapped[int] = mapped_column(Integer, default=0)
    applied_blocks: Mapped[int] = mapped_column(Integer, default=0)
    applied_tokens: Mapped[int] = mapped_column(Integer, default=0)
    created_at: Mapped[float] = mapped_column(Float)
    updated_at: Mapped[float] = mapped_column(Float)
    # What the action protects (a session's worker-side id, or a shared prefix's key) and
    # when its TTL ends: a restarted router rebuilds its holdings from the live ones.
    scope: Mapped[str | None] = mapped_column(String(400))
    expires_at: Mapped[float | None] = mapped_column(Float)
    # Set when the worker later reports letting blocks of this accepted Pin/Retain go
    # unasked (schemas.releases): the latest report's reason (displaced, pressure, reset,
    # gone or other), when it came, and the blocks the action still held then (0: none).
    release_reason: Mapped[str | None] = mapped_column(String(16))
    released_at: Mapped[float | None] = mapped_column(Float)
    held_after_release_blocks: Mapped[int | None] = mapped_column(Integer)
    # Revision 0008 (service.hint_records.SentAction): a deferred Prefetch's clipped wait
    # (outcome 1.1 waits_for: the most it can hold); the worker's clock of the latest
    # answer; when the engine whose new epoch let it go while it waited started.
    waits_for_blocks: Mapped[int | None] = mapped_column(Integer)
    answered_at: Mapped[float | None] = mapped_column(Float)
    reset_by_engine_at: Mapped[float | None] = mapped_column(Float)

    __table_args__ = (
        Index("ix_hint_actions_status", "status"),
        Index("ix_hint_actions_session", "tenant", "session_id"),
        Index("ix_hint_actions_created", "created_at"),
        # Restart recovery reads the holdings whose TTL is not over (reader.load_recovery).
        Index("ix_hint_actions_expires", "expires_at"),
        # A worker's deletion finds its actions (the foreign key's cascade).
        Index("ix_hint_actions_worker", "worker_id"),
    )


class ResponseSessionRow(Base):
    """The client session a stored Responses API response was made in (revision 0005),
    so that any replica continues it for a follow-up that names none
    (service.responses_sessions). Written behind (one row per stored response made in a
    session), read by the id on a replica's local miss, checked against the tenant the
    id's tag was verified for; deleted by retention past ``store_retention_s``."""

    __tablename__ = "response_sessions"

    # The router's id (responses_id_codec.py: at most 199 characters).
    response_id: Mapped[str] = mapped_column(String(256), primary_key=True)
    tenant: Mapped[str] = mapped_column(String(64))
    # The client's own session id (the worker-visible one is "<tenant>/<session_id>").
    session_id: Mapped[str] = mapped_column(String(256))
    created_at: Mapped[float] = mapped_column(Float)

    __table_args__ = (
        # Retention deletes by age (store.retention).
        Index("ix_response_sessions_created", "created_at"),
    )


class CursorRow(Base):
    """Where the router is in a JetStream stream (resume point after a restart)."""

    __tablename__ = "cursors"

    name: Mapped[str] = mapped_column(String(128), primary_key=True)
    value: Mapped[int] = mapped_column(BigInteger)
    updated_at: Mapped[float] = mapped_column(Float)


TABLES = {cls.__tablename__: cls for cls in
          (TenantRow, WorkerRow, SessionRow, LearnedStatsRow, HintActionRow, CursorRow,
           ResponseSessionRow)}
