"""vLLM's connector reset empties the host tier without an event: the plugin drops it from
its index and tells the router, over the real NATS stream.

vLLM's real Scheduler with the plugin beside vLLM's real OffloadingConnector in a
MultiConnector (as in ``test_plugin_host_tier``; only the offloading worker's copy reports
are stood in for), ``Scheduler.reset_prefix_cache(reset_connector=True)`` as vLLM's API
calls it, and the router's real ``EventBatchAdapter`` and ``InMemoryClusterKvIndex`` fed
from the JetStream batches the plugin published; a second router index resyncs from the
plugin's snapshot pages over NATS and must hold the same blocks and references.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from kvhint.engine_plugin.headless import (
    HeadlessScheduler,
    HeadlessSchedulerSpec,
    build_scheduler,
    tokens_for_block_ids,
)
from kvhint.router.kv_index import EventBatchAdapter, InMemoryClusterKvIndex, snapshot_to_event
from scheduler_fixtures import events_stream_reader, until
from kvhint.schemas import (
    EventBatchMeta,
    SnapshotRequest,
    Subjects,
    decode_snapshot,
    encode_snapshot_request,
)

BS = 32


@contextmanager
def host_tier_plugin(nats_url: str, prefix: str, host_blocks: int = 40
                     ) -> Iterator[HeadlessScheduler]:
    h = build_scheduler(HeadlessSchedulerSpec(
        block_size=BS, num_blocks=64, connector_module="kvhint.engine_plugin.connector",
        connector_extra_config={"worker_id": "w0", "nats_url": nats_url,
                                "subject_prefix": prefix, "heartbeat_interval_s": 0.2},
        host_blocks=host_blocks))
    try:
        yield h
    finally:
        h.connector.shutdown()


def plugin(h: HeadlessScheduler) -> Any:
    return next(c for c in h.connector.sub_connectors if hasattr(c, "core"))


def turn(h: HeadlessScheduler, session: str, block_ids: list[int]) -> None:
    request = h.add(h.make_request(tokens_for_block_ids(block_ids, BS) + [3] * 5,
                                   session_id=session))
    while not request.is_finished():
        h.step()


class LiveRouter:
    """The router's index fed from the plugin's published batches, in sequence."""

    def __init__(self, sub: Any) -> None:
        self.sub = sub
        self.adapter = EventBatchAdapter()
        self.index = InMemoryClusterKvIndex()
        self.seq = 0

    async def catch_up(self, seq: int) -> None:
        while self.seq < seq:
            msg = await self.sub.next_msg(timeout=5)
            meta = EventBatchMeta.from_headers(msg.headers)
            assert meta.seq == self.seq + 1, "a batch went missing"
            self.seq = meta.seq
            self.index.apply_all(self.adapter.decode(meta.worker_id, msg.data))

    def tiers(self) -> dict[str, frozenset[int]]:
        return dict(self.index.export_state().blocks.get("w0", {}))


async def resynced(nc: Any, subjects: Subjects, h: HeadlessScheduler) -> InMemoryClusterKvIndex:
    """A fresh router index loaded from the plugin's snapshot, page by page over NATS."""
    pages: list[Any] = []
    cursor: int | None = 0
    while cursor is not None:
        request = asyncio.ensure_future(nc.request(subjects.snapshot("w0"), encode_snapshot_request(
            SnapshotRequest(cursor=cursor, limit=3, seq=pages[0].seq if pages else None)),
            timeout=5))
        while not request.done():  # the engine answers it in its next step
            h.step()
            await asyncio.sleep(0.01)
        pages.append(decode_snapshot((await request).data))
        assert pages[-1].next_cursor is None or pages[-1].next_cursor > cursor
        cursor = pages[-1].next_cursor
    index = InMemoryClusterKvIndex()
    index.apply(snapshot_to_event(pages))
    return index


def plugin_tiers(core: Any) -> dict[str, frozenset[int]]:
    tiers: dict[str, set[int]] = {}
    for key, _, medium in core.index.snapshot_blocks():
        tiers.setdefault(medium, set()).add(key)
    return {t: frozenset(s) for t, s in tiers.items()}


async def test_a_connector_reset_drops_the_host_tier_from_the_plugin_and_the_router(
        nats_url: str, subject_prefix: str) -> None:
    subjects = Subjects(subject_prefix)
    async with events_stream_reader(nats_url, subjects) as (nc, js):
        with host_tier_plugin(nats_url, subject_prefix) as h:
            connector = plugin(h)
            core = connector.core
            # The stream exists before the first batch: the router below reads it from
            # seq 1 (connected alone comes before the plugin's stream set-up).
            await until(lambda: connector.transport.events_kept)
            turn(h, "s", [1, 2, 3, 4])
            h.step()  # drains the last copies' events
            router = LiveRouter(await js.subscribe(subjects.events("w0"),
                                                   ordered_consumer=True))
            await router.catch_up(core.event_seq)
            keys = core.index.session_blocks("s")
            assert router.tiers()["CPU"] == frozenset(keys) == plugin_tiers(core)["CPU"]

            # As POST /reset_prefix_cache?reset_external=true does, on an idle engine.
            assert h.scheduler.reset_prefix_cache(reset_connector=True) is True
            assert not any(connector.host_tier.contains(k) for k in keys)  # vLLM's reset
            assert core.index.copies_in("CPU") == []
            assert not any(core.index.is_resident(k, "CPU") for k in keys)
            h.step()  # vLLM's own GPU clear is drained and published
            await router.catch_up(core.event_seq)
            assert router.tiers() == {} == plugin_tiers(core)
            assert core.counters.internal_errors == 0

            # The next turn fills both tiers again; live and resynced routers agree.
            turn(h, "s", [1, 2, 5])
            h.step()
            await router.catch_up(core.event_seq)
            assert router.tiers() == plugin_tiers(core)
            assert router.tiers()["CPU"] == frozenset(core.index.session_blocks("s"))
            again = await resynced(nc, subjects, h)
            await router.catch_up(core.event_seq)
            assert again.export_state().blocks == router.index.export_state().blocks
            assert again.export_state().refs == router.index.export_state().refs


async def test_a_failed_gpu_reset_drops_the_host_tier_and_keeps_the_gpu_view(
        nats_url: str, subject_prefix: str) -> None:
    """With a request running, vLLM's GPU reset fails (its blocks are in use) and the
    connector reset still runs: the host tier is emptied, the GPU cache is not. The plugin
    removes exactly its host copies; two clears would have cost the router its view of
    every block the GPU still caches."""
    subjects = Subjects(subject_prefix)
    async with events_stream_reader(nats_url, subjects) as (nc, js):
        with host_tier_plugin(nats_url, subject_prefix) as h:
            connector = plugin(h)
            core = connector.core
            # The stream exists before the first batch: the router below reads it from
            # seq 1 (connected alone comes before the plugin's stream set-up).
            await until(lambda: connector.transport.events_kept)
            turn(h, "s", [1, 2, 3, 4])
            running = h.add(h.make_request(tokens_for_block_ids([1, 2, 7], BS) + [3],
                                           session_id="r", max_tokens=50))
            for _ in range(3):
                h.step()
            assert not running.is_finished()
            router = LiveRouter(await js.subscribe(subjects.events("w0"),
                                                   ordered_consumer=True))
            await router.catch_up(core.event_seq)
            gpu = plugin_tiers(core)["GPU"]
            assert router.tiers()["CPU"] and router.tiers()["GPU"] == gpu

            assert h.scheduler.reset_prefix_cache(reset_connector=True) is False
            assert core.index.copies_in("CPU") == []
            await router.catch_up(core.event_seq)
            assert router.tiers() == {"GPU": gpu} == plugin_tiers(core)
            assert router.index.stats().missing_removes == 0

            # The running request copies its blocks again (vLLM restarts its stores).
            while not running.is_finished():
                h.step()
            h.step()
            await router.catch_up(core.event_seq)
            assert router.tiers() == plugin_tiers(core)
            assert "CPU" in router.tiers()


def test_reset_cache_is_a_no_op_success_without_a_host_tier_and_survives_a_plugin_error(
        ) -> None:
    plain = build_scheduler(HeadlessSchedulerSpec(
        block_size=BS, num_blocks=64, connector_module="kvhint.engine_plugin.connector",
        connector_extra_config={"worker_id": "w0"}))
    assert plain.connector.reset_cache() is None
    assert plain.scheduler.reset_prefix_cache(reset_connector=True) is True

    h = build_scheduler(HeadlessSchedulerSpec(
        block_size=BS, num_blocks=64, connector_module="kvhint.engine_plugin.connector",
        connector_extra_config={"worker_id": "w0"}, host_blocks=40))
    core = plugin(h).core
    turn(h, "s", [1, 2])

    # A plugin bug cannot be caused through vLLM: stand one in. The reset still succeeds
    # (a False would make a pause that clears the cache raise), the error is counted.
    def broken(medium: str) -> list[int]:
        raise RuntimeError("plugin bug")

    core.index.copies_in = broken
    assert h.scheduler.reset_prefix_cache(reset_connector=True) is True
    assert core.counters.internal_errors == 1
