"""A snapshot request that finds the engine's inbox full, with a real NATS server, vLLM's
real scheduler and the router's real ingestor, NATS link and snapshot requester.

The full inbox turns the request away (counted, ``inbound_dropped``). Before, it got no
reply: the router waited out its whole snapshot timeout before asking again, the worker's
view stale all that while. It is now answered at once with a refusal (``SnapshotRefused``;
an ``{"error": ...}`` reply before it, which routers took for a failed request; see
test_plugin_snapshot_refused.py), and the router asks again after
``snapshot_retry_s`` and completes its resync once the engine has room. The test steps the
headless scheduler itself where the engine would; while it does not, the inbox stays full.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Coroutine
from typing import Any

import pytest

from kvhint.router.kv_index import InMemoryClusterKvIndex, KvEventIngestor
from kvhint.router.kv_index.stream import StreamConfig
from kvhint.router.service.index_actions import IndexActions
from kvhint.router.service.metrics import RouterMetrics
from kvhint.router.service.nats_link import NatsLink
from kvhint.router.service.workers import WorkerRegistry
from kvhint.schemas import Subjects
from scheduler_fixtures import nats_client, pin_message, turn, until
from scheduler_fixtures import nats_plugin as plugin

# Far longer than the test waits: a router that waits it out fails the test.
_SNAPSHOT_TIMEOUT_S = 30.0


@pytest.fixture(autouse=True)
def _quiet_nats_logs(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("ERROR", logger="nats")


async def test_a_snapshot_request_finding_the_inbox_full_is_answered_at_once(
        nats_url: str, subject_prefix: str) -> None:
    subjects = Subjects(subject_prefix)
    async with nats_client(nats_url) as nc:
        with plugin(nats_url, subject_prefix, inbound_buffer=1,
                    create_events_stream=False) as h:
            await until(lambda: h.connector.transport.set_up)
            await nc.publish(subjects.hints("w0"), pin_message("f0"))  # fills the inbox
            await nc.flush()
            mailbox = h.connector.core.mailbox
            await until(lambda: len(mailbox.inbound) == 1)
            started = time.monotonic()
            reply = await nc.request(subjects.snapshot("w0"), b"", timeout=5)
            assert time.monotonic() - started < 2.0
            body = json.loads(reply.data)
            assert set(body) == {"version", "worker_id", "error"}, body
            assert "inbox full" in body["error"], body
            assert mailbox.counters.inbound_dropped == 1
            assert h.connector.transport.counters.inbound_rejected == 1


async def test_the_router_asks_again_soon_and_resyncs_once_the_engine_has_room(
        nats_url: str, subject_prefix: str) -> None:
    subjects = Subjects(subject_prefix)
    tasks: set[asyncio.Task[None]] = set()

    def spawn(coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coro)
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    async with nats_client(nats_url) as nc:
        with plugin(nats_url, subject_prefix, inbound_buffer=1,
                    create_events_stream=False) as h:
            await until(lambda: h.connector.transport.set_up)
            turn(h, "s1", [1, 2])  # a session for the snapshot to carry
            # The heartbeat's figures after the turn (a step refreshes them at most so
            # often): its last_event_seq makes a router new to w0 ask for a snapshot.
            h.connector.core.refresh_status()
            assert h.connector.core.event_seq > 0
            await nc.publish(subjects.hints("w0"), pin_message("f0"))  # fills the inbox
            await nc.flush()
            mailbox = h.connector.core.mailbox
            await until(lambda: len(mailbox.inbound) == 1)

            link = NatsLink(nats_url, subjects, on_error=lambda _kind: None,
                            on_lost=lambda _count: None)
            ingestor = KvEventIngestor(InMemoryClusterKvIndex(), clock=time.monotonic,
                                       config=StreamConfig(snapshot_retry_s=0.2),
                                       subjects=subjects)
            metrics = RouterMetrics()
            actions = IndexActions(link, ingestor, WorkerRegistry([]), metrics,
                                   _SNAPSHOT_TIMEOUT_S, spawn)

            async def on_status(msg: Any) -> None:
                actions.perform(ingestor.on_status_message(msg.data, subject=msg.subject))

            link.start()
            try:
                assert await link.wait_connected(5.0)
                await link.subscribe(subjects.status("w0"), on_status)
                # The first heartbeat asks for a snapshot; the full inbox answers it at
                # once, and the router counts a refusal (not a timeout 30 s later).
                refused = metrics.resyncs.labels("w0", "snapshot", "refused")
                await until(lambda: refused._value.get() >= 1, timeout_s=5.0)
                assert mailbox.counters.inbound_dropped >= 1
                # The engine steps (room in the inbox); the router's ticks ask again.
                deadline = time.monotonic() + 8.0
                while "w0" not in ingestor.live_workers():
                    assert time.monotonic() < deadline, "resync not completed in time"
                    h.step()
                    actions.perform(ingestor.tick())
                    await asyncio.sleep(0.05)
                loaded = metrics.resyncs.labels("w0", "snapshot", "loaded")
                assert loaded._value.get() == 1
                sessions = ingestor.index.export_state().sessions
                assert "w0" in sessions["s1"]
            finally:
                for task in list(tasks):
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                await link.close()
