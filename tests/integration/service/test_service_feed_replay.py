"""A restarted router replays the events stream (real NATS JetStream): every batch is
applied, but one published longer ago than the liveness window proves nothing about its
worker now. Before, the ingestor could not tell replayed batches from live ones: a worker
dead before the router started looked alive (``plugin_alive``, its view exact) until a
window after the replay's last batch of it.

The ``ClusterFeed`` hands the ingestor each message's age from JetStream's timestamp
(the ingestor never sees the NATS message), and tells it when the replay runs and when it
caught up with the stream: a worker whose heartbeat beats its replayed history waits for
it instead of asking its plugin for a snapshot."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import nats
import pytest
from pydantic import ValidationError

from conftest import router_settings, running_router
from feed_helpers import router_beside_blocking_stream, status, stored, until
from kvhint.router.kv_index import KvEventIngestor
from kvhint.router.service.nats_link import NatsLink, StreamLimits
from kvhint.schemas import (
    EventBatchMeta,
    KVEventBatch,
    SnapshotBlock,
    Subjects,
    WorkerSnapshot,
    encode_event_batch,
    encode_snapshot,
)

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


FILLER = 20_000  # other workers' history ahead of w's: a replay of ~0.5 s


async def test_workers_heard_before_their_replayed_history_take_no_snapshot(
        tmp_path: Path, nats_url: str, subject_prefix: str) -> None:
    """At a router's start, heartbeats flow at once while the replay takes its time: "w"
    (history seq 1-3, behind others' history) and "bare" (at seq 2, no history left) are
    heard before the replay reaches them. Before, both were asked for a snapshot at once
    (w's replay then buffered and thrown away); now w takes its view from the replay and
    only bare is asked, once the replay is over."""
    subjects = Subjects(subject_prefix)
    await _make_streams(nats_url, subjects)
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    running: list[KvEventIngestor] = []  # the router's, once it runs
    requests: dict[str, list[int]] = {"w": [], "bare": []}  # batches applied at each

    def on_request(worker: str) -> None:
        # -1: asked while the router was still starting (its feed starts before it serves).
        requests[worker].append(running[0].stats().stream["batches_applied"] if running
                                else -1)

    async def answer_w(msg) -> None:  # noqa: ANN001
        on_request("w")  # unanswered: it must never be asked

    async def answer_bare(msg) -> None:  # noqa: ANN001
        on_request("bare")
        await msg.respond(encode_snapshot(WorkerSnapshot(
            worker_id="bare", epoch="e1", seq=2, block_size=32,
            blocks=[SnapshotBlock(70, None, "GPU"), SnapshotBlock(71, 70, "GPU")],
            sessions=[])))

    await nc.subscribe(subjects.snapshot("w"), cb=answer_w)
    await nc.subscribe(subjects.snapshot("bare"), cb=answer_bare)
    empty = encode_event_batch(KVEventBatch(ts=time.time(), events=[]))
    acks = [await js.publish_async(subjects.events("busy"), empty,
                                   headers=EventBatchMeta("busy", "e1", seq).to_headers())
            for seq in range(1, FILLER + 1)]
    for seq, (h, parent) in enumerate([(1, None), (2, 1), (3, 2)], start=1):
        acks.append(await js.publish_async(subjects.events("w"), stored([h], parent, None),
                                           headers=EventBatchMeta("w", "e1", seq).to_headers()))
    await asyncio.gather(*acks)

    async def heartbeats() -> None:
        while True:
            await nc.publish(subjects.status("w"), status("w", "e1", 3))
            await nc.publish(subjects.status("bare"), status("bare", "e1", 2))
            await asyncio.sleep(0.05)

    beating = asyncio.create_task(heartbeats())
    await nc.flush()
    try:
        settings = router_settings(tmp_path, [], nats_url=nats_url,
                                   subject_prefix=subject_prefix)
        async with running_router(settings) as router:
            ingestor, index = router.runtime.ingestor, router.runtime.index
            running.append(ingestor)

            def progress() -> int:  # the history's batches handled, this way or that
                stream = ingestor.stats().stream
                return (stream["batches_applied"] + stream["buffered"]
                        + stream["dead_worker_dropped"])

            await until(lambda: progress() >= FILLER + 3, timeout_s=30.0)
            await until(lambda: index.worker_block_counts("bare") == {"GPU": 2})
            await asyncio.sleep(0.5)  # a late request would show by now
            # w: no snapshot request, its view from the replay (before: asked at once,
            # its replayed batches buffered behind the snapshot).
            assert requests["w"] == []
            assert index.worker_block_counts("w") == {"GPU": 3} and ingestor.view_exact("w")
            # bare: asked once, after the whole history was applied (before: at once).
            assert requests["bare"] == [ingestor.stats().stream["batches_applied"]]
            views = ingestor.worker_views()
            # Heard before its history came (else this proved nothing), and waited.
            assert views["w"].counters["resyncs_deferred"] == 1
            assert views["w"].counters["resyncs_avoided"] == 1
            assert views["w"].counters["resyncs_started"] == 0
            assert views["bare"].counters["resyncs_deferred"] == 1
            assert not ingestor.replaying
    finally:
        beating.cancel()
        await nc.drain()


async def _asked_at_once(router, nc, subjects: Subjects) -> None:  # noqa: ANN001
    """With no replay to wait for, a worker heard at seq > 0 is asked for a snapshot at
    once, as before replays were waited for."""
    asked = asyncio.Event()

    async def answer(msg) -> None:  # noqa: ANN001
        asked.set()

    await nc.subscribe(subjects.snapshot("w"), cb=answer)
    await nc.flush()
    await nc.publish(subjects.status("w"), status("w", "e1", 4))
    await asyncio.wait_for(asked.wait(), timeout=5.0)
    assert router.runtime.ingestor.worker_views()["w"].counters["resyncs_deferred"] == 0


async def test_an_empty_events_stream_has_no_replay_to_wait_for(
        tmp_path: Path, nats_url: str, subject_prefix: str) -> None:
    """No message will ever say the replay caught up: the feed reads the stream empty."""
    subjects = Subjects(subject_prefix)
    nc = await nats.connect(nats_url)
    settings = router_settings(tmp_path, [], nats_url=nats_url, subject_prefix=subject_prefix)
    try:
        async with running_router(settings) as router:
            runtime = router.runtime
            # Set up, not only connected: replaying is False until the set-up starts the
            # replay (the wait below held at once), and the heartbeat below found no
            # subscription.
            assert await runtime.link.wait_set_up(10)
            # Before: waiting for the replay_wait_s bound (60 s).
            await until(lambda: not runtime.ingestor.replaying, timeout_s=5.0)
            assert runtime.feed.replay
            await _asked_at_once(router, nc, subjects)
    finally:
        await nc.drain()


async def test_without_jetstream_there_is_no_replay_to_wait_for(
        tmp_path: Path, nats_url: str, subject_prefix: str) -> None:
    """JetStream set-up fails (a stream of another name holds the events subjects): the
    feed runs on plain subscriptions, with no replay."""
    subjects = Subjects(subject_prefix)
    async with router_beside_blocking_stream(tmp_path, nats_url, subject_prefix,
                                             "events") as (router, nc, _js, _blocker):
        runtime = router.runtime
        await until(lambda: runtime.feed is not None and runtime.feed.jetstream_error)
        assert not runtime.feed.replay and not runtime.ingestor.replaying
        await _asked_at_once(router, nc, subjects)


async def test_the_replay_wait_is_a_router_setting(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """KVHINT_ROUTER_REPLAY_WAIT_S reaches the ingestor the router runs with (before, the
    bound was StreamConfig's 60 s, not a setting); out of its bounds it is refused,
    naming it."""
    for bad in ("0", "-1", "3601"):
        monkeypatch.setenv("KVHINT_ROUTER_REPLAY_WAIT_S", bad)
        with pytest.raises(ValidationError) as refused:
            router_settings(tmp_path, [])
        assert "replay_wait_s" in str(refused.value)
    monkeypatch.setenv("KVHINT_ROUTER_REPLAY_WAIT_S", "7.5")
    async with running_router(router_settings(tmp_path, [])) as router:
        assert router.runtime.ingestor.config.replay_wait_s == 7.5
