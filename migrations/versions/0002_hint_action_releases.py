"""hint actions: what a Pin/Retain protects and until when, and what a worker later let go
of it unasked

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-02 07:30:00

"""
from typing import Sequence, Union

from alembic import op
import sqlalchemy as sa


# revision identifiers, used by Alembic.
revision: str = '0002'
down_revision: Union[str, Sequence[str], None] = '0001'
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    """Upgrade schema."""
    with op.batch_alter_table('hint_actions', schema=None) as batch_op:
        batch_op.add_column(sa.Column('scope', sa.String(length=400), nullable=True))
        batch_op.add_column(sa.Column('expires_at', sa.Float(), nullable=True))
        batch_op.add_column(sa.Column('release_reason', sa.String(length=16), nullable=True))
        batch_op.add_column(sa.Column('released_at', sa.Float(), nullable=True))
        batch_op.add_column(sa.Column('held_after_release_blocks', sa.Integer(), nullable=True))
        batch_op.create_index('ix_hint_actions_expires', ['expires_at'], unique=False)


def downgrade() -> None:
    """Downgrade schema."""
    with op.batch_alter_table('hint_actions', schema=None) as batch_op:
        batch_op.drop_index('ix_hint_actions_expires')
        batch_op.drop_column('held_after_release_blocks')
        batch_op.drop_column('released_at')
        batch_op.drop_column('release_reason')
        batch_op.drop_column('expires_at')
        batch_op.drop_column('scope')
