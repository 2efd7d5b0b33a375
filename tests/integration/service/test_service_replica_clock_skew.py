"""Two router replicas on one store, replica B's clock 5 s behind A's, a session's turns
served by both, each closer together than the skew: where the session is now (its open
tool gap, state, planner state) follows the turn that came last, not the larger clock
reading (session_merge.py).

Before, a merge took where the session is from whichever record's latest event had the
larger wall-clock reading: A's record, made from turn 1's row and seeing nothing since,
merged B's save of turn 2 (stamped 5 s behind) as older than its own and kept turn 1's
open gap and planner state; A's next turn then closed turn 1's gap again, measured over
both turns, and planned from the stale state. Now a record that saw no event since the
row it was made from takes the other's; only events on both replicas since the last
save either read are ordered by the clocks (the bound, docs/router.md).

The skew is set through the lifecycle's clock (``SessionLifecycle._clock``, what stamps
every session event): a test cannot set a machine's clock back."""

from __future__ import annotations

import asyncio
import time
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
SKEW_S = 5.0


@pytest.fixture
async def worker(tiny_model_dir: Path) -> AsyncIterator[StubWorker]:
    async with serving([StubWorker(model_root=str(tiny_model_dir))]) as (stub,):
        stub.finish_reason, stub.tool_names = "tool_calls", ["search"]
        yield stub


async def _turn(client: httpx.AsyncClient, router: RunningRouter, session: str) -> None:
    answer = await client.post(f"{router.url}/v1/chat/completions", json=CHAT,
                               headers=ACME | {"x-session-id": session})
    assert answer.status_code == 200, answer.text


async def _stored(router: RunningRouter, session: str) -> dict:
    return await asyncio.to_thread(get_session, router.runtime.engine, "acme", session)


@pytest.mark.parametrize("behind", ["b", "a"])
async def test_the_later_turn_wins_the_merge_whatever_the_clocks_say(
        tmp_path: Path, database_url: str, worker: StubWorker, behind: str) -> None:
    """A serves turn 1, B turn 2 0.3 s later, A turn 3: A's read before turn 3 merges
    B's save, and A's record then holds turn 2's open gap and planner state (B's), with
    the clock of either replica 5 s behind the other's. Turn 3 closes turn 2's gap,
    measured from when turn 2 opened it (B's reading); the row ends with gaps at depths 1
    and 2 and the planner at depth 3."""
    settings = router_settings(tmp_path, [("w0", worker.url)], tenants=TENANTS,
                               database_url=database_url, store_flush_interval_s=3600.0,
                               routing={"session_refresh": True})
    async with AsyncExitStack() as stack:
        a = await stack.enter_async_context(running_router(settings))
        b = await stack.enter_async_context(running_router(settings))
        client = await stack.enter_async_context(httpx.AsyncClient(timeout=30))
        skewed = a if behind == "a" else b
        skewed.runtime.lifecycle._clock = lambda: time.time() - SKEW_S
        await _turn(client, a, "skew")
        await a.runtime.writer.flush()
        await asyncio.sleep(0.3)
        await _turn(client, b, "skew")
        await b.runtime.writer.flush()
        row = await _stored(b, "skew")
        await a.runtime.lifecycle.recall("acme", "skew")  # what turn 3 does first
        on_a = a.runtime.sessions.get("acme", "skew")
        assert on_a.turns == 2
        assert on_a.open_gap == row["open_gap"]
        assert on_a.plan.gap_opened_at == row["plan"]["gap_opened_at"]
        assert on_a.last_activity == row["last_activity"]
        assert on_a.latest_elsewhere
        await _turn(client, a, "skew")
        await a.runtime.writer.flush()
        stored = await _stored(a, "skew")
        assert stored["turns"] == 3 and stored["plan"]["turns"] == 3
        gaps = stored["tool_gap_stats"]["gaps"]
        assert [gap["depth"] for gap in gaps] == [1, 2]
        # Turn 2's gap: from B's reading of its opening to A's of turn 3's start, so off
        # by the skew (none below 0), but one gap, not turns 1 to 3 measured as one.
        if behind == "b":
            assert abs(gaps[1]["seconds"] - SKEW_S) < 2.0, gaps
        else:
            assert gaps[1]["seconds"] == 0.0, gaps
        assert not a.runtime.sessions.get("acme", "skew").latest_elsewhere
