"""What a failed statement says about itself, read from the codes the drivers attach (not
from their messages, which are in the server's ``lc_messages`` language and change with
versions). Shared by the writer (retry a batch, or drop the rows it holds) and the admin
API's read errors (503 retry later, or 500)."""

from __future__ import annotations

# SQLSTATEs of a statement that the store's schema or the router's rights cannot serve,
# whatever the values it carries: 42P01 undefined table, 42703 undefined column (a
# schema not migrated to what this router writes, or dropped), 3F000 no such schema,
# 42501 insufficient privilege. psycopg raises them as ProgrammingError, the class it
# also raises for a value it cannot adapt; only these say nothing about the rows.
SCHEMA_SQLSTATES = frozenset({"42P01", "42703", "3F000", "42501"})


def sqlstate(error: BaseException | None) -> str | None:
    """The SQLSTATE a PostgreSQL driver attached to ``error`` (psycopg ``sqlstate``,
    psycopg2 ``pgcode``), or None: an error not PostgreSQL's, or one the server did not
    send with a result. libpq keeps to itself the SQLSTATE of an error the server sends
    while a connection starts (no function returns it), so psycopg's error for a
    connection the server refused has none either."""
    for name in ("sqlstate", "pgcode"):
        value = getattr(error, name, None)
        if isinstance(value, str) and len(value) == 5:
            return value
    return None
