"""The router's start-up read of the store (``load_recovery``) sees the store as of one
moment, on SQLite and PostgreSQL, while another router sharing it writes."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Engine, event

from kvhint.router.store.database import create_store_engine, migrate
from kvhint.router.store.models import HintActionRow, SessionRow, WorkerRow
from kvhint.router.store.reader import load_recovery

NOW = 1_700_000_000.0


def _session(session_id: str) -> dict[str, Any]:
    return {"tenant": "acme", "session_id": session_id, "worker_id": "w0", "turns": 1,
            "created_at": NOW, "last_activity": NOW, "state": "active",
            "prompt_tokens": 0, "cached_tokens": 0, "predicted_cached_tokens": 0}


def _pending_action(action_id: str, session_id: str) -> dict[str, Any]:
    return {"action_id": action_id, "message_id": "m1", "tenant": "acme",
            "session_id": session_id, "worker_id": "w0", "action_type": "kv.pin",
            "source": "planner", "trigger": "gap:search:pin", "payload": {"ttl_s": 30.0},
            "status": "pending", "reason": "", "requested_blocks": 4, "requested_tokens": 0,
            "applied_blocks": 0, "applied_tokens": 0, "created_at": NOW, "updated_at": NOW}


def _write_turn(engine: Engine, session_id: str, action_id: str) -> None:
    """What another router's writer commits for a turn: the session and the action it
    sent, in one transaction."""
    with engine.begin() as conn:
        conn.execute(SessionRow.__table__.insert().values(_session(session_id)))
        conn.execute(HintActionRow.__table__.insert().values(
            _pending_action(action_id, session_id)))


def test_recovery_reads_one_snapshot_while_another_router_writes(database_url: str) -> None:
    """A second router commits a turn (a session and its pending action) after this one's
    recovery read the sessions and before it reads the actions. Before, each read was a
    transaction of its own: the action came back without its session. Now neither of the
    turn's rows is seen (one snapshot, from the first read), and the next start sees both.

    The write goes in through an event on the reading engine, fired before its first
    statement on ``hint_actions``: the gap between two reads of one call is too short for
    another process to be timed into it. The write itself is a real commit, through a
    second engine (the other router's)."""
    engine = create_store_engine(database_url)
    replica = create_store_engine(database_url)
    seen: list[str] = []
    try:
        migrate(engine)
        with engine.begin() as conn:
            conn.execute(WorkerRow.__table__.insert().values(
                worker_id="w0", url="http://w0", from_config=True))
        _write_turn(replica, "before", "a-before")

        def between_reads(conn, cursor, statement, *_):  # noqa: ANN001, ANN002
            if "FROM hint_actions" in statement and not seen:
                seen.append(_transaction_of(cursor.connection, engine.dialect.name))
                _write_turn(replica, "meanwhile", "a-meanwhile")

        event.listen(engine, "before_cursor_execute", between_reads)
        try:
            state = load_recovery(engine, active_since=0.0, max_sessions=10, now=NOW)
        finally:
            event.remove(engine, "before_cursor_execute", between_reads)
        assert [a["action_id"] for a in state.pending_actions] == ["a-before"]
        assert [s["session_id"] for s in state.sessions] == ["before"]
        assert seen == [{"postgresql": "repeatable read, read only",
                         "sqlite": "in a transaction"}[engine.dialect.name]]
        # The read's connection went back to the pool writable, at the default isolation:
        # the router's writer writes through the same engine next.
        _write_turn(engine, "after", "a-after")
        again = load_recovery(engine, active_since=0.0, max_sessions=10, now=NOW)
        assert sorted(s["session_id"] for s in again.sessions) == [
            "after", "before", "meanwhile"]
        assert sorted(a["action_id"] for a in again.pending_actions) == [
            "a-after", "a-before", "a-meanwhile"]
    finally:
        replica.dispose()
        engine.dispose()


def _transaction_of(dbapi_connection: Any, dialect: str) -> str:  # noqa: ANN401 - DBAPI's
    """What the reading connection's transaction is, asked of the driver's connection
    directly (not through SQLAlchemy, whose event this runs in)."""
    if dialect == "sqlite":
        return "in a transaction" if dbapi_connection.in_transaction else "none"
    isolation = dbapi_connection.execute("SHOW transaction_isolation").fetchone()[0]
    read_only = dbapi_connection.execute("SHOW transaction_read_only").fetchone()[0]
    return f"{isolation}{', read only' if read_only == 'on' else ''}"
