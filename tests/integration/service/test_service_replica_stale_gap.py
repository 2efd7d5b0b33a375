"""Two router replicas on one store, a session's turns alternating between them, where
one replica serves a turn from a record that does not hold the other's latest turn (its
read before the turn found the row older: the other's flush not written yet, a busy or
timed-out read, this replica's own flush of the row in progress, or
``routing.session_refresh`` off). That turn began after the other replica's turn had
opened a tool gap, so it closed that gap; its own record closed its older open gap
instead, at a depth the row already had a gap at.

Before, the merge at the save kept one gap per depth and took where the session is from
the later record only: the gap the other replica opened was closed by nobody and lost
(a clean-clone CI run of test_service_replica_alternating_turns.py, each replica
flushing every 50 ms on a loaded machine: depths [1, 3, 4, ...]). Now the merge closes
it at the turn that came after it (session_merge.py). Both orders of the flushes are
driven here with the writers' own flushes (an hour's interval otherwise), no fault
injected: the stale turn is the one a late flush or an unread row gives."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from pathlib import Path

import httpx
import pytest
from conftest import RunningRouter, StubWorker, router_settings, running_router, serving

from kvhint.router.store.reader import get_session

TENANTS = [{"name": "acme", "api_keys": ["ka"]}]
ACME = {"Authorization": "Bearer ka"}
CHAT = {"model": "stub", "messages": [{"role": "user", "content": "hello there"}],
        "max_tokens": 4}


@pytest.fixture
async def worker(tiny_model_dir: Path) -> AsyncIterator[StubWorker]:
    async with serving([StubWorker(model_root=str(tiny_model_dir))]) as (stub,):
        stub.finish_reason, stub.tool_names = "tool_calls", ["search"]
        yield stub


async def _turn(client: httpx.AsyncClient, router: RunningRouter, session: str) -> None:
    answer = await client.post(f"{router.url}/v1/chat/completions", json=CHAT,
                               headers=ACME | {"x-session-id": session})
    assert answer.status_code == 200, answer.text
    await asyncio.sleep(0.02)  # the gaps measured apart


async def _stored(router: RunningRouter, session: str) -> dict:
    return await asyncio.to_thread(get_session, router.runtime.engine, "acme", session)


def _depths(row: dict) -> list[int]:
    return [gap["depth"] for gap in row["tool_gap_stats"]["gaps"]]


async def test_a_late_flush_the_other_replica_did_not_read_loses_no_gap(
        tmp_path: Path, database_url: str, worker: StubWorker) -> None:
    """A serves turn 1, B turn 2 (not flushed yet: B's writer is late), A turn 3 (its
    read finds turn 1's row: current as far as A can know), A flushes, then B: B's save
    finds A's and merges. A's turn 3 closed the gap B's turn 2 opened (depth 2); A's
    record closed its own gap of turn 1 again. Before: gaps [1], turn 2's gap lost."""
    settings = router_settings(tmp_path, [("w0", worker.url)], tenants=TENANTS,
                               database_url=database_url, store_flush_interval_s=3600.0)
    async with AsyncExitStack() as stack:
        a = await stack.enter_async_context(running_router(settings))
        b = await stack.enter_async_context(running_router(settings))
        client = await stack.enter_async_context(httpx.AsyncClient(timeout=30))
        await _turn(client, a, "late")
        await a.runtime.writer.flush()
        await _turn(client, b, "late")
        await _turn(client, a, "late")
        await a.runtime.writer.flush()
        await b.runtime.writer.flush()
        stored = await _stored(a, "late")
        assert stored["turns"] == 3 and stored["plan"]["turns"] == 3
        assert _depths(stored) == [1, 2]
        assert stored["prompt_tokens"] == 3 * worker.prompt_tokens
        # The session is where A's turn 3 left it: its gap open.
        assert stored["open_gap"] is not None and stored["state"] == "tool_gap"
        # Every later turn continues it, on either replica.
        for number in range(3):
            replica = (b, a)[number % 2]
            await _turn(client, replica, "late")
            await replica.runtime.writer.flush()
        stored = await _stored(a, "late")
        assert stored["turns"] == 6 and _depths(stored) == [1, 2, 3, 4, 5]


async def test_a_turn_served_from_a_record_older_than_the_row_loses_no_gap(
        tmp_path: Path, database_url: str, worker: StubWorker) -> None:
    """B flushes its turn 2 before A's turn 3, but A serves turn 3 without reading it (as
    when its read is busy, times out, or finds its own flush in progress; here the
    setting that skips it, ``routing.session_refresh: false``): A's save finds B's and
    merges, A's record the later one. A's turn 3 closed B's gap of turn 2 (depth 2).
    Before: gaps [1], turn 2's gap lost."""
    settings_a = router_settings(tmp_path, [("w0", worker.url)], tenants=TENANTS,
                                 database_url=database_url, store_flush_interval_s=3600.0,
                                 routing={"session_refresh": False})
    settings_b = router_settings(tmp_path, [("w0", worker.url)], tenants=TENANTS,
                                 database_url=database_url, store_flush_interval_s=3600.0)
    async with AsyncExitStack() as stack:
        a = await stack.enter_async_context(running_router(settings_a))
        b = await stack.enter_async_context(running_router(settings_b))
        client = await stack.enter_async_context(httpx.AsyncClient(timeout=30))
        await _turn(client, a, "stale")
        await a.runtime.writer.flush()
        await _turn(client, b, "stale")
        await b.runtime.writer.flush()
        await _turn(client, a, "stale")  # A's record: turn 1, its gap still open
        await a.runtime.writer.flush()  # finds B's save: merged
        stored = await _stored(a, "stale")
        assert stored["turns"] == 3 and stored["plan"]["turns"] == 3
        assert _depths(stored) == [1, 2]
        assert stored["prompt_tokens"] == 3 * worker.prompt_tokens
        gaps = stored["tool_gap_stats"]["gaps"]
        assert all(gap["seconds"] >= 0.02 for gap in gaps), gaps
        await _turn(client, b, "stale")
        await b.runtime.writer.flush()
        stored = await _stored(b, "stale")
        assert stored["turns"] == 4 and _depths(stored) == [1, 2, 3]


async def test_a_stale_turn_with_no_gap_of_its_own_closes_the_other_replicas_gap(
        tmp_path: Path, database_url: str, worker: StubWorker) -> None:
    """As above, but A's turn 1 ends in a stop (no gap): A's record closes nothing at turn
    3, which still began after B's turn 2 opened its gap. Before: no gap at all."""
    settings_a = router_settings(tmp_path, [("w0", worker.url)], tenants=TENANTS,
                                 database_url=database_url, store_flush_interval_s=3600.0,
                                 routing={"session_refresh": False})
    settings_b = router_settings(tmp_path, [("w0", worker.url)], tenants=TENANTS,
                                 database_url=database_url, store_flush_interval_s=3600.0)
    async with AsyncExitStack() as stack:
        a = await stack.enter_async_context(running_router(settings_a))
        b = await stack.enter_async_context(running_router(settings_b))
        client = await stack.enter_async_context(httpx.AsyncClient(timeout=30))
        worker.finish_reason, worker.tool_names = "stop", []
        await _turn(client, a, "quiet")
        await a.runtime.writer.flush()
        worker.finish_reason, worker.tool_names = "tool_calls", ["search"]
        await _turn(client, b, "quiet")
        await b.runtime.writer.flush()
        await _turn(client, a, "quiet")
        await a.runtime.writer.flush()
        stored = await _stored(a, "quiet")
        assert stored["turns"] == 3 and _depths(stored) == [2]
        assert stored["tool_gap_stats"]["gaps"][0]["tools"] == ["search"]
