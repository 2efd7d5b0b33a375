"""A session outlives its worker's row, on SQLite and PostgreSQL: the row's deletion
(revision 0004's foreign key, ON DELETE SET NULL) leaves the session with no worker,
whichever way the row goes (the feed forgets the worker, a restart finds it gone,
retention prunes it); a session saved after its worker's row is gone is written without
it, not refused; the sessions a store of the release before names gone workers in are
repaired by the migration, once, however many replicas start together; and a restart
reads such a session back with no worker. Before, ``sessions.worker_id`` kept naming a
worker the store no longer held."""

from __future__ import annotations

import asyncio
import time

import sqlalchemy as sa

from kvhint.router.service.sessions import SessionRegistry
from kvhint.router.store.database import create_store_engine, migrate
from kvhint.router.store.models import SessionRow, WorkerRow
from kvhint.router.store.reader import load_recovery
from kvhint.router.store.retention import prune_history

from conftest import migrate_together
from store_helpers import forget_then_restart, insert_rows, recording_writer
from test_service_store_forgotten_workers import _worker_row

NOW = time.time()


def _session(session_id: str, worker_id: str | None) -> dict:
    """A session's row as the router writes it (SessionRecord.row), active a minute ago."""
    return {"tenant": "acme", "session_id": session_id, "worker_id": worker_id, "turns": 3,
            "created_at": NOW - 600, "last_activity": NOW - 60, "ended_at": None,
            "state": "tool_gap", "open_gap": {"tools": ["search"], "started_at": NOW - 60,
                                              "worker_id": worker_id},
            "tool_gap_stats": {"gaps": []}, "plan": None, "prompt_tokens": 100,
            "cached_tokens": 40, "predicted_cached_tokens": 30}


def _insert(engine: sa.Engine, workers: list[dict], sessions: list[dict]) -> None:
    """Rows as the store's tables are at the engine's revision (reflected)."""
    insert_rows(engine, workers=workers, sessions=sessions)


def _sessions(engine: sa.Engine) -> dict[str, dict]:
    """Session id -> its stored row, as :func:`_session` writes it: without the
    ``revision`` and ``latest_replica`` later migrations add (0006,
    test_service_store_session_revisions; 0009)."""
    with engine.connect() as conn:
        return {row["session_id"]: {k: v for k, v in row.items()
                                    if k not in ("revision", "latest_replica")}
                for row in conn.execute(sa.select(SessionRow.__table__)).mappings()}


def _session_workers(engine: sa.Engine) -> dict[str, str | None]:
    return {sid: row["worker_id"] for sid, row in _sessions(engine).items()}


def test_a_store_of_the_release_before_keeps_its_sessions_without_gone_workers(
        database_url: str) -> None:
    """A store at 0003 whose worker "gone" was deleted, a session still naming it: the
    upgrade sets that session's worker NULL (the constraint could not hold otherwise)
    and keeps every row, every other column, as it was; then deleting a worker leaves
    its sessions without it. A restart reads such a session back with no worker.
    Migrating again changes nothing."""
    engine = create_store_engine(database_url)
    try:
        migrate(engine, "0003")
        kept = [_session("on-w0", "w0"), _session("none", None)]
        _insert(engine, [_worker_row("w0", True), _worker_row("w1", True)],
                kept + [_session("on-gone", "gone"), _session("on-w1", "w1")])
        migrate(engine)
        migrate(engine)  # idempotent
        rows = _sessions(engine)
        assert {row["session_id"]: rows[row["session_id"]] for row in kept} == {
            row["session_id"]: row for row in kept}
        assert rows["on-gone"] == _session("on-gone", "gone") | {"worker_id": None}
        (key,) = sa.inspect(engine).get_foreign_keys("sessions")
        assert (key["constrained_columns"], key["referred_table"], key["options"]) == (
            ["worker_id"], "workers", {"ondelete": "SET NULL"})
        with engine.begin() as conn:
            conn.execute(sa.delete(WorkerRow).where(WorkerRow.worker_id == "w1"))
        assert _session_workers(engine) == {"on-w0": "w0", "none": None, "on-gone": None,
                                            "on-w1": None}
        registry = SessionRegistry(None, 10)
        registry.restore(load_recovery(engine, 0.0, 10).sessions)
        assert {r.session_id: (r.worker_id, r.turns) for r in registry} == {
            "on-w0": ("w0", 3), "none": (None, 3), "on-gone": (None, 3), "on-w1": (None, 3)}
    finally:
        engine.dispose()


def test_replicas_upgrading_a_store_together_repair_its_sessions_once(
        replica_engines: list[sa.Engine]) -> None:
    """Three replicas of the new release start together on a 0003 store with a session
    naming a gone worker: one migrates (repairing it, adding the key), the others find
    it current."""
    engine = replica_engines[0]
    migrate(engine, "0003")
    _insert(engine, [_worker_row("w0", True)],
            [_session("on-w0", "w0"), _session("on-gone", "gone")])
    assert migrate_together(replica_engines) == [True, True, True]
    assert _session_workers(engine) == {"on-w0": "w0", "on-gone": None}
    assert len(sa.inspect(engine).get_foreign_keys("sessions")) == 1


def test_each_way_a_workers_row_goes_leaves_its_sessions_without_it(
        database_url: str) -> None:
    """"forgotten" (the writer's delete: the feed forgot it), "dropped" (a restart's
    registry does not hold it) and "pruned" (retention: not heard within the window):
    their sessions stay, every turn and gap of theirs, with no worker; "kept"'s keeps
    it. Retention deletes no session still within the window."""
    engine = create_store_engine(database_url)
    drops: list[tuple[str, int]] = []
    workers = ("kept", "forgotten", "dropped", "pruned")
    try:
        migrate(engine)
        _insert(engine, [_worker_row("kept", True, NOW), _worker_row("forgotten", False, NOW),
                         _worker_row("dropped", True, NOW),
                         _worker_row("pruned", False, NOW - 7200.0)],
                [_session(f"on-{worker}", worker) for worker in workers])
        forget_then_restart(engine, drops, NOW)
        assert prune_history(engine, before=NOW - 3600) == {
            "hint_actions": 0, "learned_stats": 0,
            "response_sessions": 0, "sessions": 0, "workers": 1}
        rows = _sessions(engine)
        assert {sid: row["worker_id"] for sid, row in rows.items()} == {
            "on-kept": "kept", "on-forgotten": None, "on-dropped": None, "on-pruned": None}
        assert all(row["turns"] == 3 and row["open_gap"]["tools"] == ["search"]
                   for row in rows.values())
        assert drops == []
    finally:
        engine.dispose()


def test_a_session_saved_after_its_workers_row_went_is_written_without_it(
        database_url: str) -> None:
    """A router saves sessions whose worker's row is gone: forgotten in the same batch
    (the delete lands after the session's write), forgotten in an earlier one, or pruned
    by another replica. Each session's row is written, with no worker, beside one whose
    worker has its row; nothing is refused. Without the writer's guard the key refused
    them: the sessions' turns were dropped (store_row_rejected)."""
    engine = create_store_engine(database_url)
    drops: list[tuple[str, int]] = []
    try:
        migrate(engine)
        _insert(engine, [_worker_row("live", False, NOW), _worker_row("earlier", False, NOW),
                         _worker_row("same", False, NOW)], [])

        async def run() -> None:
            writer = recording_writer(engine, drops)
            writer.delete("workers", ("earlier",))
            await writer.flush()
            with engine.begin() as conn:  # another replica's retention
                conn.execute(sa.insert(WorkerRow).values(_worker_row("pruned", False, NOW)))
                conn.execute(sa.delete(WorkerRow).where(WorkerRow.worker_id == "pruned"))
            for worker in ("live", "earlier", "same", "pruned"):
                writer.upsert("sessions", ("acme", f"on-{worker}"),
                              _session(f"on-{worker}", worker))
            writer.delete("workers", ("same",))
            await writer.flush()
            assert writer.flush_errors == 0
            # Written again (another turn): still no worker, the rest updated.
            writer.upsert("sessions", ("acme", "on-earlier"),
                          _session("on-earlier", "earlier") | {"turns": 4})
            await writer.close()

        asyncio.run(run())
        rows = _sessions(engine)
        assert {sid: (row["worker_id"], row["turns"]) for sid, row in rows.items()} == {
            "on-live": ("live", 3), "on-earlier": (None, 4), "on-same": (None, 3),
            "on-pruned": (None, 3)}
        assert drops == []
    finally:
        engine.dispose()
