"""A snapshot request the worker cannot serve, answered with ``SnapshotRefused``, read by
the router: real NATS, vLLM's real scheduler, the router's real ingestor, NATS link and
snapshot requester (IndexActions).

Before, the plugin answered an ad-hoc ``{"error": ...}`` with no wire type; the router
failed to decode it as a page, counted ``resyncs{result="failed"}`` (as for a timeout or
a reply it cannot read) and threw the reason away. It now counts ``refused``, logs the
worker's reason (throttled), and asks again as before (doubling, bounded).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Coroutine
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import pytest

from kvhint.router.kv_index import InMemoryClusterKvIndex, KvEventIngestor
from kvhint.router.kv_index.stream import StreamConfig
from kvhint.router.service.index_actions import IndexActions
from kvhint.router.service.metrics import RouterMetrics
from kvhint.router.service.nats_link import NatsLink
from kvhint.router.service.workers import WorkerRegistry
from kvhint.schemas import (
    Budgets,
    SnapshotRefused,
    Subjects,
    Usage,
    WorkerStatus,
    decode_snapshot_reply,
    encode_status,
    new_epoch,
)
from scheduler_fixtures import nats_client, pin_message, turn, until
from scheduler_fixtures import nats_plugin as plugin

# Far longer than the tests wait: a router that waits it out fails the test.
_SNAPSHOT_TIMEOUT_S = 30.0
_INDEX_ACTIONS_LOG = "kvhint.router.service.index_actions"


@pytest.fixture(autouse=True)
def _quiet_nats_logs(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("ERROR", logger="nats")
    caplog.set_level("WARNING", logger=_INDEX_ACTIONS_LOG)


@dataclass
class _Router:
    ingestor: KvEventIngestor
    metrics: RouterMetrics
    actions: IndexActions

    def resyncs(self, result: str) -> float:
        return self.metrics.resyncs.labels("w0", "snapshot", result)._value.get()


@asynccontextmanager
async def _router(nats_url: str, subjects: Subjects) -> AsyncIterator[_Router]:
    """The router's side: heartbeats of w0 fed to the ingestor, its actions performed."""
    tasks: set[asyncio.Task[None]] = set()

    def spawn(coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coro)
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    link = NatsLink(nats_url, subjects, on_error=lambda _kind: None,
                    on_lost=lambda _count: None)
    ingestor = KvEventIngestor(InMemoryClusterKvIndex(), clock=time.monotonic,
                               config=StreamConfig(snapshot_retry_s=0.1,
                                                   snapshot_retry_max_s=0.2),
                               subjects=subjects)
    metrics = RouterMetrics()
    router = _Router(ingestor, metrics, IndexActions(link, ingestor, WorkerRegistry([]),
                                                     metrics, _SNAPSHOT_TIMEOUT_S, spawn))

    async def on_status(msg: Any) -> None:
        router.actions.perform(ingestor.on_status_message(msg.data, subject=msg.subject))

    link.start()
    try:
        assert await link.wait_connected(5.0)
        await link.subscribe(subjects.status("w0"), on_status)
        yield router
    finally:
        for task in list(tasks):
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await link.close()


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == _INDEX_ACTIONS_LOG and r.levelno == logging.WARNING]


async def test_a_full_inbox_answers_a_snapshot_refused_naming_the_worker_and_why(
        nats_url: str, subject_prefix: str) -> None:
    subjects = Subjects(subject_prefix)
    async with nats_client(nats_url) as nc:
        with plugin(nats_url, subject_prefix, inbound_buffer=1,
                    create_events_stream=False) as h:
            await until(lambda: h.connector.transport.set_up)
            await nc.publish(subjects.hints("w0"), pin_message("f0"))  # fills the inbox
            await nc.flush()
            await until(lambda: len(h.connector.core.mailbox.inbound) == 1)
            reply = await nc.request(subjects.snapshot("w0"), b"", timeout=5)
            refused = decode_snapshot_reply(reply.data)
            assert isinstance(refused, SnapshotRefused), reply.data
            assert (refused.version, refused.worker_id) == ("1.0", "w0")
            assert "inbox full" in refused.error and "ask again" in refused.error


async def test_the_router_counts_a_full_inbox_refused_logs_why_and_resyncs_later(
        nats_url: str, subject_prefix: str, caplog: pytest.LogCaptureFixture) -> None:
    """A worker whose inbox stays full refuses each retry: every refusal counted
    ``refused`` (none ``failed``: no undecodable reply), the reason logged once (the
    throttle holds back the rest), the request asked again until the engine has room."""
    subjects = Subjects(subject_prefix)
    async with nats_client(nats_url) as nc:
        with plugin(nats_url, subject_prefix, inbound_buffer=1,
                    create_events_stream=False) as h:
            await until(lambda: h.connector.transport.set_up)
            turn(h, "s1", [1, 2])  # a session for the snapshot to carry
            h.connector.core.refresh_status()  # its last_event_seq: a new router resyncs
            assert h.connector.core.event_seq > 0
            await nc.publish(subjects.hints("w0"), pin_message("f0"))  # fills the inbox
            await nc.flush()
            mailbox = h.connector.core.mailbox
            await until(lambda: len(mailbox.inbound) == 1)
            async with _router(nats_url, subjects) as router:
                # The first heartbeat asks; refused at once. The router's ticks ask again
                # (0.1 s, then 0.2 s): refused each time while the engine does not step.
                await until(lambda: router.resyncs("refused") >= 1, timeout_s=5.0)
                deadline = time.monotonic() + 8.0
                while router.resyncs("refused") < 3:
                    assert time.monotonic() < deadline, "not asked again in time"
                    router.actions.perform(router.ingestor.tick())
                    await asyncio.sleep(0.05)
                assert router.resyncs("failed") == 0
                assert mailbox.counters.inbound_dropped >= 3
                logged = [m for m in _warnings(caplog) if "refused" in m]
                assert len(logged) == 1, _warnings(caplog)
                assert "w0" in logged[0] and "inbox full" in logged[0]
                # The engine steps (room in the inbox); the router's ticks ask again.
                while "w0" not in router.ingestor.live_workers():
                    assert time.monotonic() < deadline + 8.0, "resync not completed in time"
                    h.step()
                    router.actions.perform(router.ingestor.tick())
                    await asyncio.sleep(0.05)
                assert router.resyncs("loaded") == 1
                assert "w0" in router.ingestor.index.export_state().sessions["s1"]


async def test_an_older_plugins_error_reply_is_refused_and_an_unreadable_one_failed(
        nats_url: str, subject_prefix: str, caplog: pytest.LogCaptureFixture) -> None:
    """A responder stands in for the worker here: an older plugin's exact reply
    (``{"error": ...}``, no version) and a reply no plugin sends (garbage) cannot be had
    from this plugin. The first is a refusal, its reason logged; the second a failure."""
    subjects = Subjects(subject_prefix)
    # The first request gets the garbage, every later one the older plugin's refusal.
    replies = [b"<html>502</html>", b'{"error":"worker inbox full (1 messages waiting for '
               b'the scheduler); no snapshot taken, ask again"}']

    async def respond(msg: Any) -> None:
        await msg.respond(replies.pop(0) if len(replies) > 1 else replies[0])

    async with nats_client(nats_url) as nc:
        await nc.subscribe(subjects.snapshot("w0"), cb=respond)
        await nc.flush()
        async with _router(nats_url, subjects) as router:
            # Heartbeats naming events the router has not had: it asks for a snapshot
            # (sent until it does: the router's subscription may not be in place yet).
            epoch = new_epoch()
            deadline = time.monotonic() + 8.0
            while router.resyncs("failed") + router.resyncs("refused") < 1:
                assert time.monotonic() < deadline, "no snapshot asked"
                await nc.publish(subjects.status("w0"), encode_status(WorkerStatus(
                    worker_id="w0", epoch=epoch, model="tiny", cache_namespace="ns",
                    block_size=32, hash_algo="sha256", none_hash_seed="vllm-none-hash",
                    supported_actions={}, budgets=Budgets(
                        max_pinned_blocks=100, max_pin_ttl_s=600, max_retained_blocks=400,
                        max_retain_ttl_s=3600),
                    usage=Usage(gpu_blocks_total=512, gpu_blocks_free=400, kv_usage=0.2),
                    last_event_seq=3, interval_s=0.5, at=time.time())))
                await asyncio.sleep(0.1)
            while router.resyncs("refused") < 1:
                assert time.monotonic() < deadline, "not asked again in time"
                router.actions.perform(router.ingestor.tick())
                await asyncio.sleep(0.05)
            assert router.resyncs("failed") == 1  # the garbage, first
            logged = _warnings(caplog)
            assert any("no snapshot page nor refusal" in m and "not valid JSON" in m
                       for m in logged), logged
            assert any("refused" in m and "inbox full" in m for m in logged), logged
