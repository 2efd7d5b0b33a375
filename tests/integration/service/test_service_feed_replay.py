"""A restarted router replays the events stream (real NATS JetStream): every batch is
applied, but one published longer ago than the liveness window proves nothing about its
worker now. Before, the ingestor could not tell replayed batches from live ones: a worker
dead before the router started looked alive (``plugin_alive``, its view exact) until a
window after the replay's last batch of it.

The ``ClusterFeed`` hands the ingestor each message's age from JetStream's timestamp
(the ingestor never sees the NATS message)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import nats
import pytest

from conftest import router_settings, running_router
from feed_helpers import status, stored, until
from kvhint.router.service.nats_link import NatsLink, StreamLimits
from kvhint.schemas import EventBatchMeta, Subjects

pytestmark = pytest.mark.usefixtures("throwaway_streams")

MiB = 1 << 20
HEARTBEAT_MISSES = 1  # the liveness window: 2 s (the default interval) before a heartbeat


async def _make_streams(url: str, subjects: Subjects) -> None:
    """The streams as the router makes them (the limits router_settings gives it)."""
    link = NatsLink(url, subjects, on_error=lambda _kind: None, on_lost=lambda _count: None,
                    limits=StreamLimits(events_max_bytes=8 * MiB, outcomes_max_bytes=8 * MiB,
                                        releases_max_bytes=8 * MiB), retry_s=0.1)

    async def nothing() -> None:
        return None

    link.start(nothing)
    try:
        assert await link.wait_connected(10.0)
        await link.ensure_streams()
    finally:
        await link.close()


async def test_a_dead_workers_replayed_history_does_not_make_it_alive(
        tmp_path: Path, nats_url: str, subject_prefix: str) -> None:
    subjects = Subjects(subject_prefix)
    await _make_streams(nats_url, subjects)
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    heartbeats: asyncio.Task[None] | None = None
    try:
        # History from before the router started: "gone" died since, "up" still runs.
        for worker, hashes in (("gone", [1, 2, 3]), ("up", [7, 8])):
            for seq, h in enumerate(hashes, start=1):
                await js.publish(subjects.events(worker),
                                 stored([h], hashes[seq - 2] if seq > 1 else None, None),
                                 headers=EventBatchMeta(worker, "e1", seq).to_headers())
        published = time.monotonic()
        await asyncio.sleep(2.0 * HEARTBEAT_MISSES + 0.3 - (time.monotonic() - published))
        settings = router_settings(tmp_path, [], nats_url=nats_url,
                                   subject_prefix=subject_prefix,
                                   heartbeat_misses=HEARTBEAT_MISSES)
        async with running_router(settings) as router:
            runtime = router.runtime
            ingestor, index = runtime.ingestor, runtime.index
            await until(lambda: ingestor.stats().stream["batches_applied"] == 5)
            # All of the history is applied ...
            assert index.worker_block_counts("gone") == {"GPU": 3}
            assert index.worker_block_counts("up") == {"GPU": 2}
            # ... and proves no one alive (before: both plugin_alive, views exact).
            for worker in ("gone", "up"):
                state = runtime.workers.get(worker)
                assert state is None or not state.plugin_alive, worker
                assert not ingestor.view_exact(worker)

            async def heartbeat_up() -> None:
                while True:
                    await nc.publish(subjects.status("up"), status("up", "e1", 2))
                    await asyncio.sleep(0.2)

            heartbeats = asyncio.create_task(heartbeat_up())
            await until(lambda: runtime.workers.get("up") is not None
                        and runtime.workers.get("up").plugin_alive)
            # The dead one is declared dead a window after its first replayed batch, and
            # purged; the live one keeps its replayed view, exact now (no resync needed).
            await until(lambda: ingestor.worker_views()["gone"].phase == "dead",
                        timeout_s=5.0)
            assert index.worker_block_counts("gone") == {}
            assert index.worker_block_counts("up") == {"GPU": 2} and ingestor.view_exact("up")
            stream = ingestor.stats().stream
            assert stream["deaths"] == 1 and stream["resyncs_started"] == 0
    finally:
        if heartbeats is not None:
            heartbeats.cancel()
        await nc.drain()
