"""hint actions belong to their worker: deleting a worker's row deletes its actions' rows

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-05 09:00:00

Before, a worker's row was deleted (forgotten, dropped from the config, pruned by
retention) and its actions' rows stayed: a restart restored its Pins and Retains whose
TTL was not over, counted against its tenant's budget, and waited for its pending ones.
The rows such deletions left are deleted here first (the constraint could not hold
otherwise), then the foreign key (ON DELETE CASCADE) and the index its cascade reads.

Only adds (migrations/README.md): a router of the release before runs on it as it did,
its deletions of workers now cascade on PostgreSQL (on SQLite only a connection that
turns foreign keys on enforces them), and an action row it would write for a worker
without a row is refused, which its writer drops and counts.

Replicas migrate one at a time (database.migrate's advisory lock). On PostgreSQL the
two tables are locked for writes before the orphans are deleted, so no router's flush
adds one between that delete and the constraint's check.
"""
import logging
from typing import Sequence, Union

from alembic import op
import sqlalchemy as sa


# revision identifiers, used by Alembic.
revision: str = '0003'
down_revision: Union[str, Sequence[str], None] = '0002'
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None

log = logging.getLogger(__name__)


def upgrade() -> None:
    """Upgrade schema."""
    bind = op.get_bind()
    if bind.dialect.name == "postgresql":
        # The order the writer's flush takes them (workers before hint_actions), and the
        # mode ADD CONSTRAINT takes anyway: writes wait, reads go on.
        op.execute("LOCK TABLE workers, hint_actions IN SHARE ROW EXCLUSIVE MODE")
    actions = sa.table("hint_actions", sa.column("worker_id"))
    workers = sa.table("workers", sa.column("worker_id"))
    orphans = bind.execute(actions.delete().where(
        ~sa.exists().where(workers.c.worker_id == actions.c.worker_id))).rowcount
    if orphans:
        log.info("deleted %d hint action rows of workers no longer in the store", orphans)
    with op.batch_alter_table('hint_actions', schema=None) as batch_op:
        batch_op.create_index('ix_hint_actions_worker', ['worker_id'], unique=False)
        batch_op.create_foreign_key('fk_hint_actions_worker', 'workers', ['worker_id'],
                                    ['worker_id'], ondelete='CASCADE')


def downgrade() -> None:
    """Downgrade schema."""
    with op.batch_alter_table('hint_actions', schema=None) as batch_op:
        batch_op.drop_constraint('fk_hint_actions_worker', type_='foreignkey')
        batch_op.drop_index('ix_hint_actions_worker')
