"""a session's worker is a reference to the worker's row: deleting the row sets it NULL

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-08 09:00:00

A session outlives its worker: its turns, tool gaps and planner state stay when the
worker is forgotten, dropped from the config or pruned, and its next turn goes to another
worker. Before, ``sessions.worker_id`` kept naming a worker whose row was gone. The
sessions that name one are repaired here first (their worker set NULL: the constraint
could not hold otherwise), then the foreign key (ON DELETE SET NULL) and the index its
SET NULL reads.

Only adds (migrations/README.md), with the same caveat as 0003: a router of the release
before runs on it as it did, its deletions of workers now set their sessions' worker NULL
(on SQLite, on a connection that turns foreign keys on), and a session row it writes
naming a worker whose row is gone (a session saved after its worker was forgotten) is
refused, which its writer drops and counts (``store_row_rejected``). This release's
writer writes such a session with no worker instead (store.writer).

Replicas migrate one at a time (database.migrate's advisory lock), holding every table
for writes (database.lock_for_migration); the two tables are locked here as well for a
migration run by hand (alembic), so no router's flush names a deleted worker between the
repair and the constraint's check.
"""
import logging
from typing import Sequence, Union

from alembic import op
import sqlalchemy as sa


# revision identifiers, used by Alembic.
revision: str = '0004'
down_revision: Union[str, Sequence[str], None] = '0003'
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None

log = logging.getLogger(__name__)


def upgrade() -> None:
    """Upgrade schema."""
    bind = op.get_bind()
    if bind.dialect.name == "postgresql":
        # The order the writer's flush takes them (workers before sessions); already
        # held when the router migrates (database.lock_for_migration).
        op.execute("LOCK TABLE workers, sessions IN SHARE ROW EXCLUSIVE MODE")
    sessions = sa.table("sessions", sa.column("worker_id"))
    workers = sa.table("workers", sa.column("worker_id"))
    orphans = bind.execute(sessions.update().where(
        sessions.c.worker_id.is_not(None),
        ~sa.exists().where(workers.c.worker_id == sessions.c.worker_id)).values(
        worker_id=None)).rowcount
    if orphans:
        log.info("%d sessions named workers no longer in the store: their worker set NULL",
                 orphans)
    with op.batch_alter_table('sessions', schema=None) as batch_op:
        batch_op.create_index('ix_sessions_worker', ['worker_id'], unique=False)
        batch_op.create_foreign_key('fk_sessions_worker', 'workers', ['worker_id'],
                                    ['worker_id'], ondelete='SET NULL')


def downgrade() -> None:
    """Downgrade schema."""
    with op.batch_alter_table('sessions', schema=None) as batch_op:
        batch_op.drop_constraint('fk_sessions_worker', type_='foreignkey')
        batch_op.drop_index('ix_sessions_worker')
