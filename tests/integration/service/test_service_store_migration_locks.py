"""A migration and the routers still running on the store, on PostgreSQL: the migration
locks the store's tables for writes all at once (database.lock_for_migration), so it is
never one side of a deadlock with a router's prune, which takes the tables in the
opposite order to the writer's flush and to the migrations' own locks.

Before, the first router of a release with 0003 (or 0004) that migrated while an older
router's retention pruned (hint_actions or sessions deleted, then workers) locked workers,
then waited for the table the prune held, while the prune waited for workers: PostgreSQL
aborted the migration (deadlock detected) and the router's start failed."""

from __future__ import annotations

import concurrent.futures
import time

import pytest
import sqlalchemy as sa

from kvhint.router.store.database import create_store_engine, migrate
from kvhint.router.store.models import WorkerRow

from test_service_store_forgotten_workers import _worker_row


def _migration_locking(engine: sa.Engine) -> bool:
    """Whether a session of this database is at a LOCK TABLE (waiting or between tries)."""
    with engine.connect() as conn:
        return bool(conn.execute(sa.text(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND pid <> pg_backend_pid() AND query LIKE 'LOCK TABLE%'")).scalar_one())


@pytest.mark.parametrize("revision, first", [
    ("0002", "hint_actions"),  # the prune of the release before 0003, against 0003
    ("0003", "sessions"),      # the prune of the release before 0004, against 0004
    ("0004", "hint_actions"),  # the prune of the release before 0005, against 0005
])
def test_a_migration_and_a_routers_prune_at_once_both_finish(
        database_url: str, revision: str, first: str) -> None:
    """A router's prune has deleted from ``first`` (held for writes until it commits)
    when another router starts and migrates the store from ``revision``; the prune then
    deletes a worker's row. Both finish, the store at the head revision."""
    if not database_url.startswith("postgresql"):
        pytest.skip("SQLite takes one write lock for the whole database: no deadlock")
    engine = create_store_engine(database_url)
    try:
        migrate(engine, revision)
        with engine.begin() as conn:
            conn.execute(sa.insert(WorkerRow), [_worker_row("kept", True),
                                                _worker_row("pruned", False, 1.0)])
        # The prune's connection closes (rolling back) before the pool waits for the
        # migration, should an assertion fail meanwhile.
        with concurrent.futures.ThreadPoolExecutor(1) as pool, engine.connect() as prune:
            prune.execute(sa.text(f"DELETE FROM {first} WHERE worker_id = 'pruned'"))
            migrating = pool.submit(migrate, engine)
            deadline = time.monotonic() + 10.0
            while not _migration_locking(engine):
                assert time.monotonic() < deadline, "the migration never locked"
                assert not migrating.done(), migrating.result()
                time.sleep(0.01)
            time.sleep(0.2)  # waiting for ``first`` by now, holding workers before the fix
            prune.execute(sa.delete(WorkerRow).where(WorkerRow.worker_id == "pruned"))
            prune.commit()
            assert migrating.result(timeout=120) is True
        with engine.connect() as conn:
            assert conn.execute(sa.select(WorkerRow.worker_id)).scalars().all() == ["kept"]
        assert {key["name"] for table in ("hint_actions", "sessions")
                for key in sa.inspect(engine).get_foreign_keys(table)} == {
            "fk_hint_actions_worker", "fk_sessions_worker"}
    finally:
        engine.dispose()
