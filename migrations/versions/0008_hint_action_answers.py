"""hint actions: what a clipped Prefetch waits for, when its worker answered, and when
the engine that let it go started

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-05 17:40:00

Three columns a restarted router needs to rebuild its holdings as the one before it had
them (router/service/hint_records.py ``SentAction``):

- ``waits_for_blocks``: a deferred Prefetch whose wait its worker's prefetch budget
  clipped (outcome 1.1 ``waits_for``) holds no more than this; before, a restart held it
  at every block it asked for until its deadline, and the budgets refused room (a 429)
  the worker could never fill.
- ``answered_at``: the worker's clock (``at``) of the action's latest answer, which says
  whether a worker's new engine gave it (HintDispatcher.reset_worker keeps what the new
  engine answered); before, a restart forgot it, and a new epoch heard after the restart
  let go of holds the new engine had.
- ``reset_by_engine_at``: when the engine whose new epoch let this action go while it
  waited started (worker's clock); its answer at or after that brings the holding back.
  Before, a restart forgot it, and that engine's answer was capped at the reset's 0.

Only adds nullable columns (migrations/README.md): a router of the release before writes
its rows without them (NULL: not known, as before this revision).
"""
from typing import Sequence, Union

from alembic import op
import sqlalchemy as sa


# revision identifiers, used by Alembic.
revision: str = '0008'
down_revision: Union[str, Sequence[str], None] = '0007'
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    """Upgrade schema."""
    with op.batch_alter_table('hint_actions', schema=None) as batch_op:
        batch_op.add_column(sa.Column('waits_for_blocks', sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column('answered_at', sa.Float(), nullable=True))
        batch_op.add_column(sa.Column('reset_by_engine_at', sa.Float(), nullable=True))


def downgrade() -> None:
    """Downgrade schema."""
    with op.batch_alter_table('hint_actions', schema=None) as batch_op:
        batch_op.drop_column('reset_by_engine_at')
        batch_op.drop_column('answered_at')
        batch_op.drop_column('waits_for_blocks')
