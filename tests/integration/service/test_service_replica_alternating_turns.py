"""Two router replicas on one store (one SQLite file, or one PostgreSQL database), a
session's turns alternating between them (a load balancer without affinity): the stored
row ends with every turn either served, its tool gaps, its tokens. Before, each replica
read the row only on first sight of the id and then saved its own record at each flush,
last writer winning: the replica behind wrote its older record (fewer turns, its own
gaps) over the other's progress (sessions.py, session_merge.py, store.writer's
``upsert_versioned``, revision 0006).

A save that finds the row another replica saved since is not written: the row is read
again, merged, and saved (``kvhint_router_session_save_conflicts_total``); a turn of a
session in memory reads the row first and merges another replica's saves since
(``kvhint_router_session_refreshes_total``), so it continues them."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from pathlib import Path

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

from kvhint.router.store.reader import get_session

TENANTS = [{"name": "acme", "api_keys": ["ka"]}]
ACME = {"Authorization": "Bearer ka"}
CHAT = {"model": "stub", "messages": [{"role": "user", "content": "hello there"}],
        "max_tokens": 4}
CONFLICTS = "kvhint_router_session_save_conflicts_total"
REFRESHES = "kvhint_router_session_refreshes_total"


@pytest.fixture
async def worker(tiny_model_dir: Path) -> AsyncIterator[StubWorker]:
    async with serving([StubWorker(model_root=str(tiny_model_dir))]) as (stub,):
        yield stub


async def _replicas(stack: AsyncExitStack, tmp_path: Path, worker: StubWorker,
                    database_url: str) -> tuple[RunningRouter, RunningRouter, httpx.AsyncClient]:
    """Both on the empty store; writes wait for the test's flushes (an hour's interval).
    The read before each turn is asked for: on a SQLite file it is off unless set (a file
    is one router's own), and these tests share one between two replicas."""
    settings = router_settings(tmp_path, [("w0", worker.url)], tenants=TENANTS,
                               database_url=database_url, store_flush_interval_s=3600.0,
                               routing={"session_refresh": True})
    a = await stack.enter_async_context(running_router(settings))
    b = await stack.enter_async_context(running_router(settings))
    return a, b, await stack.enter_async_context(httpx.AsyncClient(timeout=30))


async def _turn(client: httpx.AsyncClient, router: RunningRouter, session: str) -> None:
    answer = await client.post(f"{router.url}/v1/chat/completions", json=CHAT,
                               headers=ACME | {"x-session-id": session})
    assert answer.status_code == 200, answer.text


async def _stored(router: RunningRouter, session: str) -> dict:
    return await asyncio.to_thread(get_session, router.runtime.engine, "acme", session)


async def test_alternating_turns_all_reach_the_stored_row(
        tmp_path: Path, database_url: str, worker: StubWorker) -> None:
    """A, B, A, B, A, B, each turn ending in a tool call, each replica flushing after its
    turn: six turns, five closed gaps (depths 1-5, each once), six turns' tokens, in the
    row and in both replicas' records. Before, the row held what the last replica to
    save had counted (A's record saw turns 1, 3, 5 only)."""
    worker.finish_reason, worker.tool_names = "tool_calls", ["search"]
    async with AsyncExitStack() as stack:
        a, b, client = await _replicas(stack, tmp_path, worker, database_url)
        for number in range(6):
            replica = (a, b)[number % 2]
            await _turn(client, replica, "agent-1")
            await replica.runtime.writer.flush()
        stored = await _stored(a, "agent-1")
        assert stored["turns"] == 6
        assert [g["depth"] for g in stored["tool_gap_stats"]["gaps"]] == [1, 2, 3, 4, 5]
        assert stored["prompt_tokens"] == 6 * worker.prompt_tokens
        assert stored["state"] == "tool_gap" and stored["open_gap"] is not None
        assert stored["plan"]["turns"] == 6
        on_b = b.runtime.sessions.get("acme", "agent-1")
        assert on_b.turns == 6 and on_b.plan.turns == 6 and len(on_b.gaps) == 5
        # The turns after the first on each replica continued the other's saves.
        for replica, merged in ((a, 2), (b, 2)):
            samples = await scrape(client, replica.url)
            assert sample(samples, REFRESHES, outcome="merged") == merged
            assert not sample(samples, CONFLICTS, outcome="merged")


async def test_a_save_over_another_replicas_newer_save_is_merged_not_written_over(
        tmp_path: Path, database_url: str, worker: StubWorker) -> None:
    """Turns on both replicas before either flushes (each replica's record then holds
    only its own turns since the row it read): the second save finds the row saved by
    the other, reads it again and merges; no turn is lost. Before, the later flush wrote
    its record over the earlier one's."""
    async with AsyncExitStack() as stack:
        a, b, client = await _replicas(stack, tmp_path, worker, database_url)
        await _turn(client, a, "both")
        await a.runtime.writer.flush()
        await _turn(client, b, "both")  # B reads A's row: 1 turn, then its own
        for _turn_number in range(2):
            await _turn(client, a, "both")  # A's record: B's turn not saved yet
        await _turn(client, b, "both")
        await b.runtime.writer.flush()
        await a.runtime.writer.flush()  # finds B's save: merged, written in the same flush
        stored = await _stored(a, "both")
        assert stored["turns"] == 5
        assert stored["prompt_tokens"] == 5 * worker.prompt_tokens
        assert a.runtime.sessions.get("acme", "both").turns == 5
        samples = await scrape(client, a.url)
        assert sample(samples, CONFLICTS, outcome="merged") == 1
        # B's next turn continues the merged row.
        await _turn(client, b, "both")
        await b.runtime.writer.flush()
        assert (await _stored(b, "both"))["turns"] == 6
        assert sample(await scrape(client, b.url), REFRESHES, outcome="merged") >= 1


async def test_alternating_turns_with_the_replicas_own_flushes(
        tmp_path: Path, database_url: str, worker: StubWorker) -> None:
    """As deployed: each replica's writer flushes on its own (every 50 ms), an agent's
    eight turns alternating between them with tool gaps of 150 ms. The row ends with
    every turn and gap; nothing is dropped."""
    worker.finish_reason, worker.tool_names = "tool_calls", ["search"]
    settings = router_settings(tmp_path, [("w0", worker.url)], tenants=TENANTS,
                               database_url=database_url, store_flush_interval_s=0.05,
                               routing={"session_refresh": True})
    async with AsyncExitStack() as stack:
        a = await stack.enter_async_context(running_router(settings))
        b = await stack.enter_async_context(running_router(settings))
        client = await stack.enter_async_context(httpx.AsyncClient(timeout=30))
        for number in range(8):
            await _turn(client, (a, b)[number % 2], "agent-2")
            await asyncio.sleep(0.15)
        stored = await _stored(a, "agent-2")
        assert stored["turns"] == 8 and stored["plan"]["turns"] == 8
        assert [g["depth"] for g in stored["tool_gap_stats"]["gaps"]] == list(range(1, 8))
        assert stored["prompt_tokens"] == 8 * worker.prompt_tokens
        for replica in (a, b):
            samples = await scrape(client, replica.url)
            assert sample(samples, REFRESHES, outcome="merged") >= 3
            assert {labels: value for (name, labels), value in samples.items()
                    if name == "kvhint_router_drops_total" and value} == {}


async def test_with_refresh_off_turns_read_nothing_and_saves_still_merge(
        tmp_path: Path, database_url: str, worker: StubWorker) -> None:
    """``routing.session_refresh`` off (one replica, or a load balancer's affinity): a
    turn of a session in memory reads no row (no refresh counted), and a save over the
    other replica's newer one still merges (turns and tokens of both kept). Without the
    setting every such turn read the store."""
    settings = router_settings(tmp_path, [("w0", worker.url)], tenants=TENANTS,
                               database_url=database_url, store_flush_interval_s=3600.0,
                               routing={"session_refresh": False})
    async with AsyncExitStack() as stack:
        a = await stack.enter_async_context(running_router(settings))
        b = await stack.enter_async_context(running_router(settings))
        client = await stack.enter_async_context(httpx.AsyncClient(timeout=30))
        await _turn(client, a, "sticky")
        await a.runtime.writer.flush()
        await _turn(client, b, "sticky")  # first sight on B: read once, continues A's
        await b.runtime.writer.flush()
        for _ in range(2):
            await _turn(client, a, "sticky")  # A does not read B's save
        await a.runtime.writer.flush()  # finds B's save: merged
        stored = await _stored(a, "sticky")
        assert stored["turns"] == 4
        assert stored["prompt_tokens"] == 4 * worker.prompt_tokens
        for replica in (a, b):
            samples = await scrape(client, replica.url)
            assert not any(value for (name, _labels), value in samples.items()
                           if name == REFRESHES)
        assert sample(await scrape(client, a.url), CONFLICTS, outcome="merged") == 1


async def test_the_read_before_each_turn_is_on_for_postgresql_and_off_for_sqlite_by_default(
        tmp_path: Path, database_url: str, worker: StubWorker) -> None:
    """Unset, ``routing.session_refresh`` follows the store: a PostgreSQL store is the one
    replicas share, so each later turn reads the row; a SQLite file is one router's own,
    so none does (0.4-0.8 ms of router CPU a turn saved, BENCHMARKS.md). Before, every
    router read the row before every turn."""
    settings = router_settings(tmp_path, [("w0", worker.url)], tenants=TENANTS,
                               database_url=database_url)
    async with AsyncExitStack() as stack:
        router = await stack.enter_async_context(running_router(settings))
        client = await stack.enter_async_context(httpx.AsyncClient(timeout=30))
        for _ in range(3):
            await _turn(client, router, "one-replica")
        samples = await scrape(client, router.url)
        refreshed = sum(value for (name, _labels), value in samples.items()
                        if name == REFRESHES)
        assert refreshed == (2 if database_url.startswith("postgresql") else 0)
