"""a revision per session row: replicas save a session only over the row they last saw

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-16 09:00:00

Replicas share the store and each keeps its own record of a session in memory. Before,
each saved its record over the row whatever another replica had saved since: a session
whose turns alternated between replicas lost the other replica's turns (its turn count,
tool gaps, planner state), last writer winning. ``sessions.revision`` counts the saves of
a row; a router saves a session only where the row is still at the revision it last read
or wrote (store.writer, service.sessions), and otherwise reads the row again and merges.

Only adds (migrations/README.md): a column with a default, so a router of the release
before goes on inserting its rows (at revision 0) and updating them (leaving the revision
as it is: its saves are not checked, as before). Nothing existing is repaired, so there
is nothing to lock for: replicas starting together take turns on PostgreSQL
(database.migrate's advisory lock).
"""
from typing import Sequence, Union

from alembic import op
import sqlalchemy as sa


# revision identifiers, used by Alembic.
revision: str = '0006'
down_revision: Union[str, Sequence[str], None] = '0005'
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    """Upgrade schema."""
    with op.batch_alter_table('sessions', schema=None) as batch_op:
        batch_op.add_column(sa.Column('revision', sa.BigInteger(), server_default='0',
                                      nullable=False))


def downgrade() -> None:
    """Downgrade schema."""
    with op.batch_alter_table('sessions', schema=None) as batch_op:
        batch_op.drop_column('revision')
