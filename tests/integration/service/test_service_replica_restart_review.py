"""Two router replicas on one store (PostgreSQL, or one SQLite file) and one NATS, each
with its ``routing.replica_id``: A serves a session's turn 1, B its turn 2, then A
restarts. The session's row names B as the replica that saw its latest event (revision
0009), so A's restored record leaves the idle review to B: A yields it at its first due
review (forgets it, counted) and sends w0 nothing; B abandons it alone, one release.

Before, the row named no replica: A restored the session as its own and reviewed it
beside B from the same row, and both released it at its end (two releases to w0 for
one session). w0's plugin is played by the test (every hint accepted); the review times
are shortened through the planner's config and the ticks are the test's, as in
test_service_replica_idle_review.py."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from contextlib import AsyncExitStack
from pathlib import Path

import httpx
import nats
import pytest
from conftest import RunningRouter, StubWorker, router_settings, running_router
from feed_helpers import ACTIONS_WITH_OWNER, AcceptingPlugin, plugin_registered, status

from kvhint.router.service.settings import RouterSettings
from kvhint.router.store.reader import get_session
from kvhint.schemas import Subjects

pytestmark = pytest.mark.usefixtures("throwaway_streams")

ABANDON_S = 3.0


def _sent(router: RunningRouter) -> float:
    return sum(sample.value for metric in router.runtime.metrics.hints_sent.collect()
               for sample in metric.samples if sample.name.endswith("_total"))


def _yielded(router: RunningRouter) -> float:
    return router.runtime.metrics.idle_reviews_yielded._value.get()


async def _ready(router: RunningRouter, nc: nats.NATS, subjects: Subjects) -> None:
    await plugin_registered(router.runtime, nc, subjects, ACTIONS_WITH_OWNER)
    router.runtime.hints.planner_config = dataclasses.replace(
        router.runtime.hints.planner_config, idle_review_first_s=0.2,
        idle_review_growth=1.5, return_window_s=60.0, abandon_after_s=ABANDON_S)


async def test_a_restarted_replica_leaves_the_review_to_the_one_that_served_last(
        tmp_path: Path, nats_url: str, subject_prefix: str, database_url: str,
        stub_workers: list[StubWorker]) -> None:
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

    def settings(replica: str) -> RouterSettings:
        # The read before each turn asked for (off on a SQLite file unless set).
        return router_settings(tmp_path, [("w0", stub.url)], nats_url=nats_url,
                               subject_prefix=subject_prefix, database_url=database_url,
                               store_flush_interval_s=3600.0, hints={"tick_s": 3600.0},
                               routing={"session_refresh": True, "replica_id": replica})

    async def turn(client: httpx.AsyncClient, router: RunningRouter) -> None:
        response = await client.post(f"{router.url}/v1/chat/completions", json={
            "model": "stub", "session_id": "s",
            "messages": [{"role": "user", "content": "s: " + "x" * 400}]})
        assert response.status_code == 200, response.text

    beating = asyncio.create_task(heartbeats())
    try:
        async with AsyncExitStack() as stack:
            b = await stack.enter_async_context(running_router(settings("b")))
            client = await stack.enter_async_context(httpx.AsyncClient(timeout=30))
            async with running_router(settings("a")) as first_a:
                await _ready(first_a, nc, subjects)
                await _ready(b, nc, subjects)
                await turn(client, first_a)
                await first_a.runtime.writer.flush()
                await asyncio.sleep(0.3)
                await turn(client, b)
                await b.runtime.writer.flush()
            stored = await asyncio.to_thread(get_session, b.runtime.engine, "default", "s")
            assert stored["turns"] == 2 and stored["latest_replica"] == "b"
            a = await stack.enter_async_context(running_router(settings("a")))
            await _ready(a, nc, subjects)
            assert a.runtime.sessions.get("default", "s") is not None  # restored
            received, sent_by_a = len(plugin.received), _sent(a)
            deadline = time.monotonic() + 10.0
            while b.runtime.sessions.get("default", "s").state != "ended":
                assert time.monotonic() < deadline, "B did not abandon it in 10 s"
                await asyncio.sleep(0.1)
                for router in (a, b):
                    await router.runtime.lifecycle.tick()
            for _ in range(5):  # A's ticks past B's abandonment too
                await asyncio.sleep(0.1)
                for router in (a, b):
                    await router.runtime.lifecycle.tick()
            await asyncio.sleep(0.3)  # the last sends reach w0
            releases = [payload for _id, payload in plugin.received[received:]
                        if getattr(payload, "priority", None) == 0]
            assert len(releases) == 1, releases
            assert _sent(a) == sent_by_a
            assert _yielded(a) == 1 and _yielded(b) == 0
            assert a.runtime.sessions.get("default", "s") is None
    finally:
        beating.cancel()
        await nc.drain()
