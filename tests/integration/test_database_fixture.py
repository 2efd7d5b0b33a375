"""The database fixture hands out a real, empty, writable database on both backends."""

from __future__ import annotations

import sqlalchemy as sa


def test_database_is_fresh_and_writable(database_url: str) -> None:
    engine = sa.create_engine(database_url)
    try:
        assert sa.inspect(engine).get_table_names() == []
        meta = sa.MetaData()
        table = sa.Table("probe", meta, sa.Column("id", sa.Integer, primary_key=True),
                         sa.Column("name", sa.String(32)))
        meta.create_all(engine)
        with engine.begin() as conn:
            conn.execute(table.insert(), [{"name": "a"}, {"name": "b"}])
        with engine.connect() as conn:
            assert conn.execute(sa.select(sa.func.count()).select_from(table)).scalar() == 2
    finally:
        engine.dispose()
