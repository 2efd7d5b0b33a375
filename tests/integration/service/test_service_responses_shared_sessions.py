"""A Responses follow-up (``previous_response_id``) that names no session continues the
session of its response on a router that did not relay it: another replica sharing the
PostgreSQL store, or the same router after a restart (responses_sessions.py). Before, it
continued none there (``drops_total{what="response_session_unknown"}``), and the
session's turns, tool gaps and learning went with it: agent SDKs chaining
``previous_response_id`` often send no session id, and replicas behind a plain load
balancer get each other's follow-ups.

Also: another tenant never gets the session; a follow-up within the write-behind window
still continues none, counted as before; a store that fails, is slow, or is busy with
reads never fails the follow-up, each counted.

Stand-in workers answer in vLLM 0.32's shapes (test_service_responses_api.py)."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
from conftest import RunningRouter, router_settings, running_router, sample, scrape
from feed_helpers import until
from test_service_responses_api import TENANTS, ResponsesStub, create

from kvhint.router.service.responses_sessions import (
    MAX_READS_IN_FLIGHT,
    MAX_READS_PER_TENANT,
)
from kvhint.router.service.settings import RouterSettings
from kvhint.router.store.models import ResponseSessionRow

ACME, BETA = {"Authorization": "Bearer ka"}, {"Authorization": "Bearer kb"}
READS = "kvhint_router_response_session_reads_total"
DROPS = "kvhint_router_drops_total"


@pytest.fixture
async def holder(tiny_model_dir: Path) -> AsyncIterator[ResponsesStub]:
    worker = ResponsesStub(str(tiny_model_dir))
    await worker.start()
    try:
        yield worker
    finally:
        await worker.stop()


def _settings(tmp_path: Path, holder: ResponsesStub, database_url: str,
              **extra: Any) -> RouterSettings:
    """What every replica is configured with. Its store writes wait for the test's own
    flushes (an hour's interval): the write-behind window is the test's to open and
    close."""
    return router_settings(tmp_path, [("w0", holder.url)], tenants=TENANTS,
                           salt_secret="replicas-share-this-secret",
                           database_url=database_url,
                           **({"store_flush_interval_s": 3600.0} | extra))


def _postgresql_only(database_url: str) -> None:
    if not database_url.startswith("postgresql"):
        pytest.skip("replicas share a PostgreSQL store; SQLite is one router's own")


async def _make(client: httpx.AsyncClient, router: RunningRouter, headers: dict[str, str],
                **extra: Any) -> str:
    answer = await client.post(f"{router.url}/v1/responses", json=create(**extra),
                               headers=headers)
    assert answer.status_code == 200, answer.text
    return answer.json()["id"]


async def _follow(client: httpx.AsyncClient, router: RunningRouter, previous: str,
                  headers: dict[str, str] = ACME) -> httpx.Response:
    """A follow-up of ``previous`` naming no session, as agent SDKs send it."""
    answer = await client.post(f"{router.url}/v1/responses", headers=headers,
                               json=create(previous_response_id=previous))
    assert answer.status_code == 200, answer.text
    return answer


async def test_a_follow_up_on_another_replica_continues_its_responses_session(
        tmp_path: Path, database_url: str, holder: ResponsesStub) -> None:
    """A relays acme's response in session "agent". B's follow-up naming no session,
    once A's write is in the store, goes in session "agent": the worker gets it, and B
    continues A's record of the session from the store (test_service_replica_sessions.py:
    as a turn naming the session does). The response B relays is read the other way by A.
    Within the write-behind window (A not flushed yet) B continues none, counted as
    before. beta never reaches acme's: not by the id, not by a row naming another
    tenant; beta's own session of the same name is beta's."""
    _postgresql_only(database_url)
    settings = _settings(tmp_path, holder, database_url)
    async with AsyncExitStack() as stack:
        a = await stack.enter_async_context(running_router(settings))
        b = await stack.enter_async_context(running_router(settings))
        client = await stack.enter_async_context(httpx.AsyncClient(timeout=30))
        made = await _make(client, a, ACME, session_id="agent")
        # A has not written it yet: B cannot tell, as before (counted).
        await _follow(client, b, made)
        assert "session_id" not in holder.received[-1]
        await a.runtime.writer.flush()
        follow = await _follow(client, b, made)
        assert holder.received[-1]["session_id"] == "acme/agent"
        record = b.runtime.sessions.get("acme", "agent")
        assert record is not None and (record.turns, record.worker_id) == (2, "w0")
        # And back: the response B relayed in the session, followed through A.
        await b.runtime.writer.flush()
        await _follow(client, a, follow.json()["id"])
        assert holder.received[-1]["session_id"] == "acme/agent"
        # beta presenting acme's id: unknown to it; nothing read, nothing sent.
        sent = len(holder.received)
        refused = await client.post(f"{b.url}/v1/responses", headers=BETA,
                                    json=create(previous_response_id=made))
        assert refused.status_code == 404 and len(holder.received) == sent
        # beta's own session "agent" is beta's.
        theirs = await _make(client, a, BETA, session_id="agent")
        await a.runtime.writer.flush()
        await _follow(client, b, theirs, BETA)
        assert holder.received[-1]["session_id"] == "beta/agent"
        # A row naming another tenant than the one the id was made for is not used.
        with b.runtime.engine.begin() as conn:
            conn.execute(sa.update(ResponseSessionRow).where(
                ResponseSessionRow.response_id == made).values(tenant="beta"))
        await _follow(client, b, made)
        assert "session_id" not in holder.received[-1]
        on_b, on_a = await scrape(client, b.url), await scrape(client, a.url)
        assert {o: sample(on_b, READS, outcome=o) for o in (
            "found", "missing", "other_tenant", "error", "timeout", "busy")} == {
            "found": 2, "missing": 1, "other_tenant": 1, "error": 0, "timeout": 0, "busy": 0}
        assert sample(on_b, DROPS, what="response_session_unknown") == 2
        assert sample(on_b, DROPS, what="response_session_unread") is None
        assert sample(on_a, READS, outcome="found") == 1
        assert sample(on_a, DROPS, what="response_session_unknown") is None


async def test_a_restarted_router_continues_the_sessions_of_the_responses_it_relayed(
        tmp_path: Path, database_url: str, holder: ResponsesStub) -> None:
    """The router's map of the ids it relayed goes with its process; the store keeps the
    sessions. After a restart, a follow-up naming no session continues its response's
    (SQLite and PostgreSQL). With the store's table gone from under it (a store that
    cannot be read), the follow-up is served continuing none, counted."""
    settings = _settings(tmp_path, holder, database_url)
    async with httpx.AsyncClient(timeout=30) as client:
        async with running_router(settings) as router:
            made = await _make(client, router, ACME, session_id="agent")
            other = await _make(client, router, ACME, session_id="other")
        async with running_router(settings) as router:
            await _follow(client, router, made)
            assert holder.received[-1]["session_id"] == "acme/agent"
            assert router.runtime.sessions.get("acme", "agent").turns == 2
            with router.runtime.engine.begin() as conn:
                conn.execute(sa.text("ALTER TABLE response_sessions RENAME TO away"))
            await _follow(client, router, other)
            assert "session_id" not in holder.received[-1]
            samples = await scrape(client, router.url)
            assert sample(samples, READS, outcome="found") == 1
            assert sample(samples, READS, outcome="error") == 1
            assert sample(samples, DROPS, what="response_session_unread") == 1
            assert sample(samples, DROPS, what="response_session_unknown") is None
            with router.runtime.engine.begin() as conn:  # for the writer's last flush
                conn.execute(sa.text("ALTER TABLE away RENAME TO response_sessions"))


async def test_a_follow_up_is_served_whatever_the_store_does(
        tmp_path: Path, database_url: str, holder: ResponsesStub) -> None:
    """On PostgreSQL, replica B's reads of A's response's session: held up by a lock
    (another session's ACCESS EXCLUSIVE on the table) past the read timeout, they give
    up (``timeout``); more at once than MAX_READS_PER_TENANT (one tenant's share of
    MAX_READS_IN_FLIGHT), the rest are not made (``busy``); with the database refusing connections, they fail (``error``). Each
    follow-up is served, continuing no session, each counted; once the store is back,
    the session is continued again."""
    _postgresql_only(database_url)
    import psycopg

    settings = _settings(tmp_path, holder, database_url,
                         responses={"session_read_timeout_s": 1.0})
    async with AsyncExitStack() as stack:
        a = await stack.enter_async_context(running_router(settings))
        b = await stack.enter_async_context(running_router(settings))
        client = await stack.enter_async_context(httpx.AsyncClient(timeout=30))
        made = await _make(client, a, ACME, session_id="agent")
        await a.runtime.writer.flush()
        name = b.runtime.engine.url.database
        dsn = b.runtime.engine.url.set(drivername="postgresql").render_as_string(
            hide_password=False)
        with psycopg.connect(dsn) as locker:
            locker.execute("LOCK TABLE response_sessions IN ACCESS EXCLUSIVE MODE")
            sent = len(holder.received)
            started = time.monotonic()
            answers = await asyncio.gather(*(_follow(client, b, made)
                                             for _ in range(MAX_READS_IN_FLIGHT + 2)))
            assert time.monotonic() - started < 10.0  # not held for the lock
            assert len(answers) == len(holder.received) - sent == MAX_READS_IN_FLIGHT + 2
            assert all("session_id" not in body for body in holder.received[sent:])
        # The reads given up on end (PostgreSQL's statement_timeout, or the lock let go).
        await until(lambda: b.app.state.responses.sessions.in_flight == 0)
        # From the server's admin database (tests/conftest.py's): PostgreSQL refuses to
        # turn connections off from a connection to the database itself.
        server = b.runtime.engine.url.set(
            drivername="postgresql", database=os.environ.get("KVHINT_TEST_PG_DB", "test"))
        with psycopg.connect(server.render_as_string(hide_password=False),
                             autocommit=True) as admin:
            admin.execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS false')
            try:
                admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                              "WHERE datname = %s AND pid <> pg_backend_pid()", (name,))
                await _follow(client, b, made)
                assert "session_id" not in holder.received[-1]
            finally:
                admin.execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS true')
        await _follow(client, b, made)
        assert holder.received[-1]["session_id"] == "acme/agent"
        samples = await scrape(client, b.url)
        assert {o: sample(samples, READS, outcome=o) for o in (
            "found", "missing", "error", "timeout", "busy")} == {
            "found": 1, "missing": 0, "error": 1, "timeout": MAX_READS_PER_TENANT,
            "busy": MAX_READS_IN_FLIGHT + 2 - MAX_READS_PER_TENANT}
        assert sample(samples, DROPS, what="response_session_unread") == (
            MAX_READS_IN_FLIGHT + 3)
        assert sample(samples, DROPS, what="response_session_unknown") is None
