"""The store's lookups by primary key on a request's path (reader.py: a session's row
before each turn, session_reads.py; a stored response's session, responses_sessions.py)
on SQLite and PostgreSQL. Their statements are built once and shared by every read (and
thread): each read must still find its own key's row only, never another tenant's, and
no row for a key the store does not hold."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from kvhint.router.store.database import create_store_engine, migrate
from kvhint.router.store.reader import get_response_session, get_session, get_session_within

from store_helpers import insert_rows


def _session(tenant: str, session_id: str, turns: int) -> dict:
    return {"tenant": tenant, "session_id": session_id, "worker_id": None, "turns": turns,
            "created_at": 1.0, "last_activity": 2.0, "state": "active", "revision": turns,
            "plan": {"turns": turns}, "prompt_tokens": 0, "cached_tokens": 0,
            "predicted_cached_tokens": 0}


def test_a_sessions_row_is_read_by_its_tenant_and_id_only(database_url: str) -> None:
    engine = create_store_engine(database_url)
    try:
        migrate(engine)
        # One id in two tenants, and ids that share a prefix.
        keys = {("acme", "s1"): 3, ("globex", "s1"): 7, ("acme", "s10"): 11,
                ("acme", "s"): 13}
        insert_rows(engine, sessions=[_session(t, s, n) for (t, s), n in keys.items()])
        missing = [("globex", "s10"), ("acme", "s2"), ("initech", "s1"), ("acme", "S1")]
        for read in (get_session, lambda e, t, s: get_session_within(e, t, s, 0.5)):
            for (tenant, session_id), turns in keys.items():
                row = read(engine, tenant, session_id)
                assert row is not None
                assert (row["tenant"], row["session_id"], row["turns"]) == (
                    tenant, session_id, turns)
                assert row["plan"] == {"turns": turns} and row["revision"] == turns
            for tenant, session_id in missing:
                assert read(engine, tenant, session_id) is None

        # Reads from several threads at once (the loop's executor), keys interleaved:
        # each finds its own row.
        asked = [*keys, *missing] * 25
        with ThreadPoolExecutor(4) as pool:
            rows = list(pool.map(lambda key: get_session_within(engine, *key, 0.5), asked))
        for (tenant, session_id), row in zip(asked, rows, strict=True):
            if (tenant, session_id) in keys:
                assert row is not None
                assert (row["tenant"], row["session_id"], row["turns"]) == (
                    tenant, session_id, keys[(tenant, session_id)])
            else:
                assert row is None
    finally:
        engine.dispose()


def test_a_stored_responses_session_is_read_by_its_id_only(database_url: str) -> None:
    engine = create_store_engine(database_url)
    try:
        migrate(engine)
        insert_rows(engine, response_sessions=[
            {"response_id": "resp_a", "tenant": "acme", "session_id": "s1", "created_at": 1.0},
            {"response_id": "resp_ab", "tenant": "globex", "session_id": "s2",
             "created_at": 1.0}])
        assert get_response_session(engine, "resp_a", 0.5) == ("acme", "s1")
        assert get_response_session(engine, "resp_ab", 0.5) == ("globex", "s2")
        assert get_response_session(engine, "resp_b", 0.5) is None
        asked = ["resp_a", "resp_ab", "resp_b"] * 30
        with ThreadPoolExecutor(4) as pool:
            found = list(pool.map(lambda rid: get_response_session(engine, rid, 0.5), asked))
        expected = {"resp_a": ("acme", "s1"), "resp_ab": ("globex", "s2"), "resp_b": None}
        assert found == [expected[rid] for rid in asked]
    finally:
        engine.dispose()
