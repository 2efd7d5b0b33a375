"""sessions: the replica that saw the session's latest event

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-05 18:30:00

``latest_replica``: the ``routing.replica_id`` of the router that saw the session's
latest event (served its latest turn, or ended it). Only that replica runs the session's
idle review (router/service/idle_reviews.py); a replica restarting restores its recent
rows, and one naming another replica is left to that replica's review. Before, the row
named none, and a restarted replica reviewed (decayed, released, abandoned) a session
another replica served last as its own, beside that replica.

Only adds a nullable column (migrations/README.md): a router of the release before, or
one without ``routing.replica_id``, leaves it NULL (not known: reviewed as before).
"""
from typing import Sequence, Union

from alembic import op
import sqlalchemy as sa


# revision identifiers, used by Alembic.
revision: str = '0009'
down_revision: Union[str, Sequence[str], None] = '0008'
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    """Upgrade schema."""
    with op.batch_alter_table('sessions', schema=None) as batch_op:
        batch_op.add_column(sa.Column('latest_replica', sa.String(length=128), nullable=True))


def downgrade() -> None:
    """Downgrade schema."""
    with op.batch_alter_table('sessions', schema=None) as batch_op:
        batch_op.drop_column('latest_replica')
