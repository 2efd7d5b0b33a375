"""Alembic environment for the router store.

Run from code (:func:`kvhint.router.store.database.migrate`, the router does it at start)
or from the command line::

    alembic -c migrations/alembic.ini -x url=sqlite:///kvhint-router.db upgrade head

The URL comes from ``-x url=...``, else ``KVHINT_ROUTER_DATABASE_URL``, else the
config's ``sqlalchemy.url``.
"""

from __future__ import annotations

import os

from alembic import context
from sqlalchemy import engine_from_config, pool

from kvhint.router.store.database import lock_for_migration
from kvhint.router.store.models import Base

config = context.config
target_metadata = Base.metadata


def _url() -> str:
    url = context.get_x_argument(as_dictionary=True).get("url")
    url = url or os.environ.get("KVHINT_ROUTER_DATABASE_URL")
    url = url or config.get_main_option("sqlalchemy.url")
    if not url:
        raise RuntimeError("no database URL: pass -x url=... or set KVHINT_ROUTER_DATABASE_URL")
    if url.startswith(("postgresql://", "postgres://")):
        url = "postgresql+psycopg://" + url.split("://", 1)[1]
    return url


def run_migrations_offline() -> None:
    context.configure(url=_url(), target_metadata=target_metadata, literal_binds=True,
                      render_as_batch=True)
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    section = dict(config.get_section(config.config_ini_section) or {})
    section["sqlalchemy.url"] = _url()
    engine = engine_from_config(section, prefix="sqlalchemy.", poolclass=pool.NullPool)
    with engine.connect() as connection:
        _run(connection)


def _run(connection) -> None:  # noqa: ANN001 - alembic passes a Connection
    # render_as_batch: SQLite cannot ALTER most things; batch mode copies the table.
    context.configure(connection=connection, target_metadata=target_metadata,
                      render_as_batch=True, compare_type=True)
    with context.begin_transaction():
        if set(context.get_context().get_current_heads()) != set(context.script.get_heads()):
            # The store is behind: its tables locked for writes, all at once, before any
            # revision alters them (PostgreSQL; the lock's docstring says why).
            lock_for_migration(connection)
        context.run_migrations()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
