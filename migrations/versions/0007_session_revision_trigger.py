"""PostgreSQL: a save that leaves a session row's revision as it is moves it on

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-17 09:00:00

Revision 0006 lets a replica save a session only over the row's revision it last read or
wrote. A router of the release before 0006 saves with a plain upsert that leaves the
revision as it is, so during a rolling upgrade the newer replicas could not tell its saves
from none: their next save was written over the older router's turns, and their read
before a turn (``routing.session_refresh``) found nothing new. This trigger moves the
revision on for such a save (any update that changes the row, ``worker_id`` aside, and
keeps its revision), so the newer replicas read it again and merge it
(``session_save_conflicts_total``, ``session_refreshes_total{outcome="merged"}``), as
they do another newer replica's save. What the older router writes over a newer
replica's save is still its own record: that router cannot be changed.

``worker_id`` is left out because the foreign key's ``SET NULL`` (a worker's row
deleted, revision 0004) is not a save: a conflict for each of the worker's sessions
would only re-read rows that hold nothing new. A save of this release sets the revision
itself (one more than the one it was made from), which the trigger leaves as it is.

PostgreSQL only: routers share a store there (replicas, rolling upgrades). A SQLite file
is one router's own, and SQLite's batch alterations (a later migration that alters
``sessions``) copy the table and would drop a trigger silently.
"""
from typing import Sequence, Union

from alembic import op


# revision identifiers, used by Alembic.
revision: str = '0007'
down_revision: Union[str, Sequence[str], None] = '0006'
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None

_FUNCTION = "kvhint_sessions_revision_on_save"
_TRIGGER = "sessions_revision_on_save"


def upgrade() -> None:
    """Upgrade schema."""
    if op.get_bind().dialect.name != "postgresql":
        return
    # jsonb of the whole row: json columns have no equality operator, and a column added
    # later is compared without this function changing.
    op.execute(f"""
        CREATE OR REPLACE FUNCTION {_FUNCTION}() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            IF NEW.revision = OLD.revision
               AND (to_jsonb(NEW) - 'worker_id' - 'revision')
                   IS DISTINCT FROM (to_jsonb(OLD) - 'worker_id' - 'revision') THEN
                NEW.revision := OLD.revision + 1;
            END IF;
            RETURN NEW;
        END
        $$""")
    op.execute(f"DROP TRIGGER IF EXISTS {_TRIGGER} ON sessions")
    op.execute(f"CREATE TRIGGER {_TRIGGER} BEFORE UPDATE ON sessions "
               f"FOR EACH ROW EXECUTE FUNCTION {_FUNCTION}()")


def downgrade() -> None:
    """Downgrade schema."""
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute(f"DROP TRIGGER IF EXISTS {_TRIGGER} ON sessions")
    op.execute(f"DROP FUNCTION IF EXISTS {_FUNCTION}()")
