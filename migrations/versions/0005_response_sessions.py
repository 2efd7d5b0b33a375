"""the session each stored Responses API response was made in, shared by the replicas

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-15 09:00:00

A follow-up (``previous_response_id``) naming no session continues the session of the
response it follows. The router's response id says which worker holds the response, not
the session (responses_id_codec.py), so only the replica that relayed it knew the
session: on another replica, or after a restart, the turn continued none. The table
``response_sessions`` (response id -> tenant, session, when) lets any replica read it.

Only adds (migrations/README.md): a new table no router of the release before reads or
writes, so it runs on this schema as it did. Nothing existing is altered or repaired,
so there is nothing to lock for (0004 locks its two tables for its repair): replicas
starting together take turns on PostgreSQL (database.migrate's advisory lock), and a
router still running on the release before goes on writing its tables meanwhile.
"""
from typing import Sequence, Union

from alembic import op
import sqlalchemy as sa


# revision identifiers, used by Alembic.
revision: str = '0005'
down_revision: Union[str, Sequence[str], None] = '0004'
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    """Upgrade schema."""
    op.create_table('response_sessions',
    sa.Column('response_id', sa.String(length=256), nullable=False),
    sa.Column('tenant', sa.String(length=64), nullable=False),
    sa.Column('session_id', sa.String(length=256), nullable=False),
    sa.Column('created_at', sa.Float(), nullable=False),
    sa.PrimaryKeyConstraint('response_id')
    )
    with op.batch_alter_table('response_sessions', schema=None) as batch_op:
        batch_op.create_index('ix_response_sessions_created', ['created_at'], unique=False)


def downgrade() -> None:
    """Downgrade schema."""
    with op.batch_alter_table('response_sessions', schema=None) as batch_op:
        batch_op.drop_index('ix_response_sessions_created')
    op.drop_table('response_sessions')
