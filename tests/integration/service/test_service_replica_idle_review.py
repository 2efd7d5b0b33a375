"""Two router replicas on one store (PostgreSQL, or one SQLite file) and one NATS, a
session's turns served by both (a load balancer without affinity), w0's plugin played by
the test (every hint accepted): the session's idle review (decay, release, abandonment)
is the replica's that served its latest turn, not every replica's that holds a record.

Before, replica A, which served turn 1 and then saw none of turn 2 (served by B), kept
reviewing its older record: its idle decays and, ``abandon_after_s`` after turn 1's gap
opened, its abandonment's release went to w0 for the session while B's turn 2 had just
opened a new gap and Retained it there (the release, the same session's and owner's,
supersedes it), A learnt a non-return of a session that had returned, and A's budget
kept counting its own Retain the worker had replaced (measured here: A's release
reached w0 3 s after turn 1, 1.5 s into B's gap).

The review times are shortened through the planner's config (an hour to abandonment by
default); the ticks are the test's (``hints.tick_s`` an hour), so both replicas review
at the same moments."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack
from pathlib import Path

import httpx
import nats
import pytest
from conftest import RunningRouter, StubWorker, router_settings, running_router
from feed_helpers import ACTIONS_WITH_OWNER, AcceptingPlugin, plugin_registered, status

from kvhint.router.store.reader import get_session
from kvhint.schemas import Subjects

pytestmark = pytest.mark.usefixtures("throwaway_streams")

ABANDON_S = 3.0


async def _turn(client: httpx.AsyncClient, router: RunningRouter, session: str) -> None:
    response = await client.post(f"{router.url}/v1/chat/completions", json={
        "model": "stub", "session_id": session,
        "messages": [{"role": "user", "content": f"{session}: " + "x" * 400}]})
    assert response.status_code == 200, response.text


def _sent(router: RunningRouter) -> float:
    return sum(sample.value for metric in router.runtime.metrics.hints_sent.collect()
               for sample in metric.samples if sample.name.endswith("_total"))


def _yielded(router: RunningRouter) -> float:
    return router.runtime.metrics.idle_reviews_yielded._value.get()


@dataclasses.dataclass
class Replicas:
    a: RunningRouter
    b: RunningRouter
    client: httpx.AsyncClient
    plugin: AcceptingPlugin


@pytest.fixture
async def replicas(tmp_path: Path, nats_url: str, subject_prefix: str, database_url: str,
                   stub_workers: list[StubWorker]) -> AsyncIterator[Replicas]:
    stub = stub_workers[0]
    stub.finish_reason, stub.tool_names = "tool_calls", ["search"]
    subjects = Subjects(subject_prefix)
    nc = await nats.connect(nats_url)
    plugin = AcceptingPlugin(nc, subjects)
    await nc.subscribe(subjects.hints("w0"), cb=plugin.on_hints)

    async def heartbeats() -> None:
        for seq in range(1, 1_000_000):
            await asyncio.sleep(0.25)
            await nc.publish(subjects.status("w0"),
                             status("w0", "e1", seq, actions=ACTIONS_WITH_OWNER))

    # The read before each turn (and idle review) asked for: on a SQLite file it is off
    # unless set (a file is one router's own), and these tests share one.
    settings = router_settings(tmp_path, [("w0", stub.url)], nats_url=nats_url,
                               subject_prefix=subject_prefix, database_url=database_url,
                               store_flush_interval_s=3600.0, hints={"tick_s": 3600.0},
                               routing={"session_refresh": True})
    beating = None
    try:
        async with AsyncExitStack() as stack:
            a = await stack.enter_async_context(running_router(settings))
            b = await stack.enter_async_context(running_router(settings))
            client = await stack.enter_async_context(httpx.AsyncClient(timeout=30))
            for router in (a, b):
                await plugin_registered(router.runtime, nc, subjects, ACTIONS_WITH_OWNER)
                router.runtime.hints.planner_config = dataclasses.replace(
                    router.runtime.hints.planner_config, idle_review_first_s=0.2,
                    idle_review_growth=1.5, return_window_s=60.0,
                    abandon_after_s=ABANDON_S)
            beating = asyncio.create_task(heartbeats())
            yield Replicas(a, b, client, plugin)
    finally:
        if beating is not None:
            beating.cancel()
        await nc.drain()


async def _ticks_until(replicas: Replicas, deadline: float) -> None:
    while time.monotonic() < deadline:
        await asyncio.sleep(0.1)
        for router in (replicas.a, replicas.b):
            await router.runtime.lifecycle.tick()


async def _ticks_while(replicas: Replicas, waiting: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 10.0
    while waiting():
        assert time.monotonic() < deadline, "not in 10 s"
        await _ticks_until(replicas, time.monotonic() + 0.1)


async def test_only_the_replica_that_served_the_latest_turn_reviews_the_session(
        replicas: Replicas) -> None:
    """A serves turn 1 (a tool call: a gap, w0 Retains it), B turn 2 1.5 s later (its
    gap Retained again). Ticks on both until past A's turn's abandonment time, short of
    B's: A sends nothing more, forgets its record (one review yielded); B reviews it,
    and no release reaches w0 (the session is not abandoned: B's gap is 1.5 s
    old). The stored row ends as B's turn left it, awaiting the return."""
    a, b, plugin = replicas.a, replicas.b, replicas.plugin
    await _turn(replicas.client, a, "s")
    start = time.monotonic()  # turn 1's gap opened just before
    await a.runtime.writer.flush()
    await asyncio.sleep(1.5)
    await _turn(replicas.client, b, "s")
    await b.runtime.writer.flush()
    sent_by_a, sent_by_b, received = _sent(a), _sent(b), len(plugin.received)
    assert sent_by_a >= 1 and sent_by_b >= 1
    await _ticks_until(replicas, start + ABANDON_S + 0.6)
    await asyncio.sleep(0.2)  # the last sends reach w0
    after = [payload for _id, payload in plugin.received[received:]]
    assert _sent(a) == sent_by_a, after
    assert all(getattr(payload, "priority", None) != 0 for payload in after), after
    assert a.runtime.sessions.get("default", "s") is None
    assert _yielded(a) == 1 and _yielded(b) == 0
    assert not a.runtime.hints.holdings.workers_holding("default/s")
    on_b = b.runtime.sessions.get("default", "s")
    assert on_b.state == "tool_gap" and on_b.plan.awaiting_return
    assert on_b.idle_reviewed_at is not None  # B reviewed it
    await b.runtime.writer.flush()
    await a.runtime.writer.flush()
    stored = await asyncio.to_thread(get_session, a.runtime.engine, "default", "s")
    assert stored["turns"] == 2 and stored["state"] == "tool_gap"
    # B abandons it in time, alone: one release to w0.
    await _ticks_while(replicas, lambda: b.runtime.sessions.get("default", "s").state
                       != "ended")
    await _ticks_until(replicas, time.monotonic() + 0.5)
    await asyncio.sleep(0.2)
    releases = [payload for _id, payload in plugin.received[received:]
                if getattr(payload, "priority", None) == 0]
    assert len(releases) == 1, releases
    assert b.runtime.sessions.get("default", "s").state == "ended"


async def test_a_turn_on_the_replica_that_yielded_makes_the_review_its_own_again(
        replicas: Replicas) -> None:
    """After A yielded the session to B, A serves turn 3: it reads the row back and its
    review is A's again; B, reading the row at its next due review, yields in turn."""
    a, b = replicas.a, replicas.b
    await _turn(replicas.client, a, "t")
    await a.runtime.writer.flush()
    await asyncio.sleep(0.3)
    await _turn(replicas.client, b, "t")
    await b.runtime.writer.flush()
    await _ticks_while(replicas, lambda: not _yielded(a))
    assert _yielded(a) == 1 and a.runtime.sessions.get("default", "t") is None
    await _turn(replicas.client, a, "t")
    await a.runtime.writer.flush()
    sent_by_b = _sent(b)
    await _ticks_while(replicas, lambda: not _yielded(b))
    assert _yielded(b) == 1 and b.runtime.sessions.get("default", "t") is None
    assert _sent(b) == sent_by_b
    on_a = a.runtime.sessions.get("default", "t")
    assert on_a.turns == 3 and on_a.plan.awaiting_return and not on_a.latest_elsewhere
