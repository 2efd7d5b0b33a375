"""A stored row the router cannot read as its own form (review of the store): a
JSON column that is not JSON at all (SQLite keeps TEXT, nothing checks it), or JSON of
another shape (a hand edit, a restore from elsewhere), or a plan naming another
tenant's session. Before, one such row among the recent ones failed the router's start
(its recovery reads them all: a crash loop), and one read later (a turn of a session
not in memory) or kept since made its session's every turn a 500. Now the column is
read as absent, the session goes on with the rest of its row, and each such row is
counted (``drops_total{what="session_row_unreadable"}``). The same for the other rows
a start reads: a hint action whose payload is no JSON object is left out
(``hint_not_restored:unreadable``), learnt statistics of another shape ignored
(``learned_stats_unreadable``): before, each failed the start."""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path

import httpx
import pytest

from conftest import StubWorker, router_settings, running_router, sample, scrape
from kvhint.router.policy import USER_GAP, GapObserved, LearnedStats
from kvhint.router.service.hint_records import SentAction
from kvhint.router.store.database import create_store_engine
from store_helpers import insert_rows

TENANTS = [{"name": "a", "api_keys": ["key-a"]}, {"name": "b", "api_keys": ["key-b"]}]
KEY_A = {"authorization": "Bearer key-a"}

# (column, what the row holds there instead of the router's own form)
UNREADABLE = {
    "plan_not_json": ("plan", "{not json"),
    "plan_a_list": ("plan", "[1]"),
    "plan_of_wrong_types": ("plan", '{"session_id": "a/bad", "tenant": "a", "turns": "x"}'),
    "plan_of_another_tenant": ("plan", '{"session_id": "b/theirs", "tenant": "b"}'),
    "stats_not_json": ("tool_gap_stats", "{not json"),
    "stats_a_string": ("tool_gap_stats", '"x"'),
    "open_gap_not_json": ("open_gap", "{not json"),
    "open_gap_a_list": ("open_gap", "[1]"),
    "open_gap_of_wrong_types": ("open_gap", '{"tools": 5, "started_at": "x"}'),
}


async def _turn(client: httpx.AsyncClient, url: str, session: str) -> httpx.Response:
    return await client.post(f"{url}/v1/chat/completions", headers=KEY_A, json={
        "model": "stub", "session_id": session,
        "messages": [{"role": "user", "content": f"{session}: " + "x" * 400}]})


@pytest.mark.parametrize("read", ["at_start", "at_its_turn"])
@pytest.mark.parametrize("case", sorted(UNREADABLE))
async def test_an_unreadable_session_row_neither_stops_the_router_nor_fails_its_turns(
        tmp_path: Path, stub_workers: list[StubWorker], case: str, read: str) -> None:
    """``at_start``: the row is among those the recovery reads; ``at_its_turn``: it is
    older than ``session_forget_s``, read when its session's next turn comes."""
    url = stub_workers[0].url
    async with running_router(router_settings(tmp_path, [("w0", url)], tenants=TENANTS)) \
            as router, httpx.AsyncClient(timeout=30) as client:
        for session in ("bad", "keep"):
            assert (await _turn(client, router.url, session)).status_code == 200
        await router.runtime.writer.flush()
    column, value = UNREADABLE[case]
    with sqlite3.connect(tmp_path / "router.db") as db:
        db.execute(f"UPDATE sessions SET {column} = ?, last_activity = last_activity - ? "
                   "WHERE session_id = 'bad'", (value, 0 if read == "at_start" else 7200))
    db.close()
    async with running_router(router_settings(tmp_path, [("w0", url)], tenants=TENANTS)) \
            as router, httpx.AsyncClient(timeout=30) as client:
        runtime = router.runtime
        if read == "at_start":
            assert runtime.sessions.get("a", "bad") is not None
        else:
            assert runtime.sessions.get("a", "bad") is None
        answer = await _turn(client, router.url, "bad")
        assert answer.status_code == 200, answer.text
        record = runtime.sessions.get("a", "bad")
        assert record.turns == 2  # the row's counters kept
        assert record.plan.session_id == "a/bad" and record.plan.tenant == "a"
        assert (await _turn(client, router.url, "keep")).status_code == 200
        samples = await scrape(client, router.url)
        assert sample(samples, "kvhint_router_drops_total",
                      what="session_row_unreadable") == 1
        assert sample(samples, "kvhint_router_drops_total", what="internal_error") in (None, 0)


def _retain(action_id: str, status: str, now: float) -> dict:
    """A Retain of a/bad on w0 as the router stores it: ``accepted`` (held 3 blocks for
    10 minutes) or ``pending`` (sent, not answered)."""
    return SentAction(
        action_id=action_id, message_id=f"m-{action_id}", worker_id="w0", tenant="a",
        session_id="bad", action_type="kv.retain", source="api", trigger="api",
        payload={"priority": 100, "ttl_s": 600, "target": {"session_id": "a/bad"}},
        status=status, created_at=now, updated_at=now, applied_blocks=3,
        requested_blocks=3, scope="a/bad", expires_at=now + 600).row()


def _nan_stats() -> dict:
    stats = LearnedStats()
    stats.apply(GapObserved(USER_GAP, 1, 30.0))
    data = stats.to_dict()
    for histogram in data["gaps"].values():  # type: ignore[union-attr]
        histogram["total"] = float("nan")
    return data


async def test_unreadable_action_and_learned_rows_no_longer_stop_the_start(
        tmp_path: Path, stub_workers: list[StubWorker]) -> None:
    """A held Retain whose payload is a JSON array (its holding's keys read the payload),
    a pending one whose payload is not JSON (SQLite), and a tenant's learnt statistics
    that are a string: each alone failed the router's start, for good. Now each is left
    out, counted, and the router serves. So are learnt statistics holding a NaN."""
    settings = router_settings(tmp_path, [("w0", stub_workers[0].url)], tenants=TENANTS)
    async with running_router(settings):
        pass  # the schema, and w0's row
    now = time.time()
    engine = create_store_engine(settings.database_url)
    try:
        insert_rows(engine, hint_actions=[_retain("held", "accepted", now),
                                          _retain("waiting", "pending", now)])
    finally:
        engine.dispose()
    with sqlite3.connect(tmp_path / "router.db") as db:
        db.execute("UPDATE hint_actions SET payload = '[1]' WHERE action_id = 'held'")
        db.execute("UPDATE hint_actions SET payload = '{not json' WHERE action_id = 'waiting'")
        db.execute("INSERT INTO learned_stats (tenant, kind, data, updated_at) "
                   "VALUES ('a', 'tenant_gaps', '\"x\"', 0)")
        # Of the right shape, with a NaN total: before, it was restored and made every
        # retain priority computed from it raise (LearnedStats.from_dict now refuses it).
        db.execute("INSERT INTO learned_stats (tenant, kind, data, updated_at) "
                   "VALUES ('b', 'tenant_gaps', ?, 0)", (json.dumps(_nan_stats()),))
    db.close()
    async with running_router(settings) as router, httpx.AsyncClient(timeout=30) as client:
        assert (await _turn(client, router.url, "bad")).status_code == 200
        assert router.runtime.hints.holdings.tenant("a").retained_blocks == 0
        samples = await scrape(client, router.url)
        assert sample(samples, "kvhint_router_drops_total",
                      what="hint_not_restored:unreadable") == 2
        assert sample(samples, "kvhint_router_drops_total",
                      what="learned_stats_unreadable") == 2
