"""Two router replicas on one store (one SQLite file, or one PostgreSQL database), as a
load balancer spreads an agent's requests: a session's turn on the replica that did not
serve its earlier turns continues the stored session (its turns, open tool gap, planner
state, an end its client asked for) instead of starting a fresh record there whose first
save wrote over the other replica's row (session_reads.py). Before, a replica looked a
session up in the store only once its own registry was incomplete (a session evicted,
forgotten, or not restored), which a replica started before the other's sessions never
was.

Also: the read is the tenant's own (the same session id of another tenant is another
session); a new session pays one read, its later turns none; a store slower than
routing.session_read_timeout_s (PostgreSQL: a lock held on the table), or failing, never
fails the turn, each counted."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import (
    RunningRouter,
    StubWorker,
    router_settings,
    running_router,
    sample,
    scrape,
    serving,
)
from sqlalchemy import text

from kvhint.router.service.session_reads import StoredSessions
from kvhint.router.service.settings import RouterSettings
from kvhint.router.store.reader import get_session

TENANTS = [{"name": "acme", "api_keys": ["ka"]}, {"name": "beta", "api_keys": ["kb"]}]
ACME, BETA = {"Authorization": "Bearer ka"}, {"Authorization": "Bearer kb"}
CHAT = {"model": "stub", "messages": [{"role": "user", "content": "hello there"}],
        "max_tokens": 4}
READS = "kvhint_router_session_reads_total"
DROPS = "kvhint_router_drops_total"


def _settings(tmp_path: Path, worker: StubWorker, database_url: str,
              **extra: Any) -> RouterSettings:
    """What every replica is configured with. Store writes wait for the test's own
    flushes (an hour's interval): the write-behind window is the test's to close."""
    return router_settings(tmp_path, [("w0", worker.url)], tenants=TENANTS,
                           database_url=database_url,
                           **({"store_flush_interval_s": 3600.0} | extra))


async def _replicas(stack: AsyncExitStack, settings: RouterSettings
                    ) -> tuple[RunningRouter, RunningRouter, httpx.AsyncClient]:
    """Both started on the empty store: neither restores anything of the other's."""
    a = await stack.enter_async_context(running_router(settings))
    b = await stack.enter_async_context(running_router(settings))
    return a, b, await stack.enter_async_context(httpx.AsyncClient(timeout=30))


async def _turn(client: httpx.AsyncClient, router: RunningRouter, session: str,
                headers: dict[str, str] = ACME, **extra: str) -> None:
    answer = await client.post(f"{router.url}/v1/chat/completions", json=CHAT,
                               headers=headers | {"x-session-id": session} | extra)
    assert answer.status_code == 200, answer.text


@pytest.fixture
async def worker(tiny_model_dir: Path) -> AsyncIterator[StubWorker]:
    async with serving([StubWorker(model_root=str(tiny_model_dir))]) as (stub,):
        yield stub


async def test_a_replica_continues_the_session_another_served(
        tmp_path: Path, database_url: str, worker: StubWorker) -> None:
    async with AsyncExitStack() as stack:
        a, b, client = await _replicas(stack, _settings(tmp_path, worker, database_url))
        worker.finish_reason, worker.tool_names = "tool_calls", ["search"]
        for _turn_number in range(2):
            await _turn(client, a, "agent-1")
        on_a = a.runtime.sessions.get("acme", "agent-1")
        assert on_a.turns == 2 and on_a.state == "tool_gap" and on_a.plan.turns == 2
        await a.runtime.writer.flush()
        await asyncio.sleep(0.1)
        worker.finish_reason, worker.tool_names = "stop", []
        await _turn(client, b, "agent-1")  # the load balancer sends the next turn to B
        on_b = b.runtime.sessions.get("acme", "agent-1")
        assert on_b.turns == 3 and on_b.plan.turns == 3 and on_b.state == "active"
        assert on_b.created_at == on_a.created_at
        # The gap A closed, then A's open one closed on B: measured from when A opened it.
        assert [(g["tools"], g["depth"]) for g in on_b.gaps] == [(["search"], 1),
                                                                  (["search"], 2)]
        assert on_b.gaps[1]["seconds"] >= 0.1 and on_b.open_gap is None
        assert on_b.prompt_tokens == 3 * worker.prompt_tokens
        await b.runtime.writer.flush()
        stored = await asyncio.to_thread(get_session, b.runtime.engine, "acme", "agent-1")
        assert stored["turns"] == 3 and stored["created_at"] == on_a.created_at
        assert len(stored["tool_gap_stats"]["gaps"]) == 2 and stored["state"] == "active"
        # Another tenant's session of the same id is its own: B reads beta's (none).
        await _turn(client, b, "agent-1", BETA)
        assert b.runtime.sessions.get("beta", "agent-1").turns == 1
        assert on_b.turns == 3
        # A new session pays one read (no row), its later turns none.
        for _turn_number in range(3):
            await _turn(client, b, "brand-new")
        assert b.runtime.sessions.get("acme", "brand-new").turns == 3
        samples = await scrape(client, b.url)
        assert sample(samples, READS, outcome="found") == 1
        assert sample(samples, READS, outcome="missing") == 2  # beta's and brand-new
        assert sample(samples, DROPS, what="session_unread") is None


async def test_a_session_its_client_ended_on_one_replica_stays_ended_on_the_other(
        tmp_path: Path, database_url: str, worker: StubWorker) -> None:
    """An end the client asked for on A is what B finds: the session takes no hints
    until its next turn (ended_explicitly), and B can end a session only A served
    (before, a 404 there)."""
    async with AsyncExitStack() as stack:
        a, b, client = await _replicas(stack, _settings(tmp_path, worker, database_url))
        await _turn(client, a, "done", **{"x-session-end": "true"})
        await _turn(client, a, "ended-on-b")
        await a.runtime.writer.flush()
        await b.runtime.lifecycle.recall("acme", "done")
        on_b = b.runtime.sessions.get("acme", "done")
        assert on_b.state == "ended" and on_b.plan.ended_explicitly and on_b.turns == 1
        ended = await client.delete(f"{b.url}/v1/sessions/ended-on-b", headers=ACME)
        assert ended.status_code == 200, ended.text
        assert ended.json()["state"] == "ended"
        assert b.runtime.sessions.get("acme", "ended-on-b").turns == 1
        await _turn(client, b, "done")  # its next turn opens it again, as on A
        assert on_b.state == "active" and on_b.turns == 2


async def test_a_store_too_slow_to_answer_does_not_hold_a_turn(
        tmp_path: Path, database_url: str, worker: StubWorker) -> None:
    """PostgreSQL holding the sessions table locked past routing.session_read_timeout_s:
    the turn is served within about that time with a record of its own, counted."""
    if not database_url.startswith("postgresql"):
        pytest.skip("a read SQLite (WAL) holds up behind a writer cannot be made on cue")
    import psycopg

    settings = _settings(tmp_path, worker, database_url,
                         routing={"session_read_timeout_s": 0.3})
    async with AsyncExitStack() as stack:
        a, b, client = await _replicas(stack, settings)
        await _turn(client, a, "slow")
        await a.runtime.writer.flush()
        dsn = b.runtime.engine.url.set(drivername="postgresql").render_as_string(
            hide_password=False)
        with psycopg.connect(dsn) as locker:
            locker.execute("LOCK TABLE sessions IN ACCESS EXCLUSIVE MODE")
            started = time.monotonic()
            await _turn(client, b, "slow")
            took = time.monotonic() - started
        assert 0.3 <= took < 2.0
        assert b.runtime.sessions.get("acme", "slow").turns == 1  # a record of its own
        samples = await scrape(client, b.url)
        assert sample(samples, READS, outcome="timeout") == 1
        assert sample(samples, DROPS, what="session_unread") == 1


async def test_a_store_that_fails_the_read_does_not_fail_the_turn(
        tmp_path: Path, database_url: str, worker: StubWorker) -> None:
    async with AsyncExitStack() as stack:
        _a, b, client = await _replicas(stack, _settings(tmp_path, worker, database_url))
        with b.runtime.engine.begin() as conn:
            conn.execute(text("ALTER TABLE sessions RENAME TO sessions_away"))
        try:
            await _turn(client, b, "unread")
        finally:
            with b.runtime.engine.begin() as conn:
                conn.execute(text("ALTER TABLE sessions_away RENAME TO sessions"))
        assert b.runtime.sessions.get("acme", "unread").turns == 1
        samples = await scrape(client, b.url)
        assert sample(samples, READS, outcome="error") == 1
        assert sample(samples, DROPS, what="store_read_error") == 1


async def test_turns_of_one_session_arriving_together_share_one_read(
        tmp_path: Path, database_url: str, worker: StubWorker) -> None:
    async with AsyncExitStack() as stack:
        a, b, client = await _replicas(stack, _settings(tmp_path, worker, database_url))
        await _turn(client, a, "together")
        await a.runtime.writer.flush()
        reads = StoredSessions(b.runtime.engine, b.runtime.metrics, 0.5)
        rows = await asyncio.gather(*(reads.row("acme", "together") for _ in range(3)),
                                    reads.row("acme", "alone"))
        assert [row and row["turns"] for row in rows] == [1, 1, 1, None]
        samples = await scrape(client, b.url)
        assert sample(samples, READS, outcome="found") == 1
        assert sample(samples, READS, outcome="missing") == 1
