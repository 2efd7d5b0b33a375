"""The plugin's NATS connection with a real NATS server and vLLM's real scheduler: NATS
going down and coming back (the engine never blocks, events wait in a bounded buffer),
unreachable at start or not configured, the events stream created by a router meanwhile,
the transport loop starting again after a failure, and credentials kept out of the log.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import nats
import pytest
from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import NotFoundError

from kvhint.engine_plugin.config import LOGGER_NAME, PluginConfig
from kvhint.engine_plugin.headless import HeadlessSchedulerSpec, build_scheduler
from kvhint.engine_plugin.mailbox import Mailbox
from kvhint.engine_plugin.transport import NatsTransport
from kvhint.router.devstack.nats_server import NatsServerProcess, free_port
from kvhint.schemas import Subjects, decode_outcome, decode_status
from scheduler_fixtures import BS, collect, events_stream_reader, nats_client, pin_message
from scheduler_fixtures import nats_plugin as plugin
from scheduler_fixtures import turn, until


@pytest.fixture(autouse=True)
def _quiet_nats_logs(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("ERROR", logger="nats")


async def test_nats_down_never_blocks_the_engine_and_hints_flow_after_it_returns(
        own_nats: NatsServerProcess, subject_prefix: str) -> None:
    subjects = Subjects(subject_prefix)
    with plugin(own_nats.url, subject_prefix, event_buffer_batches=1000,
                pin_budget_fraction=0.2) as h:
        transport = h.connector.transport
        await until(lambda: transport.connected)
        turn(h, "s", [1, 2, 3])
        await until(lambda: transport.counters.event_batches_published >= 1)
        own_nats.stop()
        await until(lambda: not transport.connected)
        started = time.monotonic()
        for i in range(20):  # the engine runs on; batches wait in the bounded buffer
            turn(h, f"x{i}", [100 + 5 * i, 101 + 5 * i])
        assert time.monotonic() - started < 5.0
        waiting = len(h.connector.core.mailbox.event_batches)
        assert waiting >= 20
        own_nats.start()
        await until(lambda: transport.connected, timeout_s=20)
        await until(lambda: not h.connector.core.mailbox.event_batches)
        async with nats_client(own_nats.url) as nc:
            outcomes = await collect(nc, subjects.outcomes("w0"))
            js = nc.jetstream()
            info = await js.stream_info(subjects.events_stream)
            assert info.state.messages == h.connector.core.event_seq  # no gap, no loss
            await nc.publish(subjects.hints("w0"), pin_message("after"))
            await until(lambda: bool(h.connector.core.mailbox.inbound))
            h.step()
            outcome = decode_outcome((await asyncio.wait_for(outcomes.get(), 5)).data)
            assert (outcome.action_id, outcome.status.value) == ("after", "accepted")
        assert h.connector.core.mailbox.counters.events_dropped == 0


async def test_a_small_buffer_drops_oldest_batches_and_counts_them(
        own_nats: NatsServerProcess, subject_prefix: str) -> None:
    with plugin(own_nats.url, subject_prefix, event_buffer_batches=3,
                create_events_stream=False) as h:
        transport = h.connector.transport
        await until(lambda: transport.connected)
        own_nats.stop()
        await until(lambda: not transport.connected)
        for i in range(10):
            turn(h, f"x{i}", [100 + 5 * i])
        counters = h.connector.core.mailbox.counters
        assert len(h.connector.core.mailbox.event_batches) == 3
        assert counters.event_batches_dropped == h.connector.core.event_seq - 3
        assert counters.events_dropped >= counters.event_batches_dropped


async def test_unreachable_nats_at_start_leaves_the_engine_running() -> None:
    url = f"nats://127.0.0.1:{free_port()}"
    with plugin(url, "kvhinttest.unreachable") as h:
        turn(h, "s", [1, 2, 3])
        assert not h.connector.transport.connected
        assert h.connector.core.index.session_blocks("s")
    # shutdown returned (the connect loop is interruptible)


def test_without_nats_url_the_index_runs_and_nothing_is_queued() -> None:
    h = build_scheduler(HeadlessSchedulerSpec(
        block_size=BS, num_blocks=64, connector_module="kvhint.engine_plugin.connector",
        connector_extra_config={"worker_id": "w0"}))
    turn(h, "s", [1, 2])
    assert h.connector.transport is None and h.connector.core.mailbox is None
    assert len(h.connector.core.index.session_blocks("s")) == 2


class _RouterCreatesFirst:
    """The plugin's JetStream context, except that its first lookup of the missing events
    stream lets the router create it (with other limits) before answering NotFound: the
    create race between a router and a plugin, on cue, against the real server."""

    def __init__(self, js: Any, router_create: Callable[[], Any]) -> None:
        self._js = js
        self._router_create: Callable[[], Any] | None = router_create

    def __getattr__(self, name: str) -> Any:
        return getattr(self._js, name)

    async def stream_info(self, name: str, *args: Any, **kwargs: Any) -> Any:
        try:
            return await self._js.stream_info(name, *args, **kwargs)
        except NotFoundError:
            create, self._router_create = self._router_create, None
            if create is not None:
                await create()
            raise


async def test_a_stream_the_router_creates_meanwhile_is_used_not_reported_failed(
        nats_url: str, subject_prefix: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("INFO", logger=LOGGER_NAME)
    subjects = Subjects(subject_prefix)
    config = PluginConfig(worker_id="w0", nats_url=nats_url, subject_prefix=subject_prefix,
                          events_stream_max_bytes=16 << 20)
    transport = NatsTransport(config, "w0", "e", Mailbox(8, 8, 8), status_of=None,
                              encode_events=None, block_size=BS)  # type: ignore[arg-type]
    async with events_stream_reader(nats_url, subjects) as (_nc, js):

        async def router_create() -> None:
            await js.add_stream(StreamConfig(
                name=subjects.events_stream, subjects=[subjects.all_of("events")],
                storage=StorageType.FILE, retention=RetentionPolicy.LIMITS,
                discard=DiscardPolicy.OLD, max_age=600, max_bytes=8 << 20))

        class _Nc:
            def jetstream(self) -> Any:
                return _RouterCreatesFirst(js, router_create)

        await transport._ensure_stream(_Nc())
        # The plugin's create got 10058; the router's stream stands and is used.
        assert (await js.stream_info(subjects.events_stream)).config.max_bytes == 8 << 20
        messages = [r.getMessage() for r in caplog.records if r.name == LOGGER_NAME]
        # Without the fix: "could not create stream ...: 10058" (a false alarm).
        assert not any("could not create" in m for m in messages), messages
        assert any("created meanwhile" in m for m in messages), messages
        assert transport.counters.stream_create_failures == 0


async def test_a_nats_url_with_credentials_reaches_no_log_line(
        nats_url: str, subject_prefix: str, caplog: pytest.LogCaptureFixture) -> None:
    """README: NATS credentials go in ``nats_url``. Neither the engine's start-up line, the
    unreachable-server warning nor the connected line may show them (vLLM's log is
    often shipped off the worker)."""
    caplog.set_level(logging.INFO, logger=LOGGER_NAME)
    refused = f"nats://w0:n4ts-pw@127.0.0.1:{free_port()}"
    with_password = nats_url.replace("nats://", "nats://w0:n4ts-pw@")
    with plugin(f"{refused},{with_password}", subject_prefix,
                create_events_stream=False) as h:
        for _ in range(200):
            if any("connected to NATS" in r.getMessage() for r in caplog.records):
                break
            await asyncio.sleep(0.05)
        del h
    logged = "\n".join(r.getMessage() for r in caplog.records)
    # The server connected to, as nats-py has it: without the user info, which the
    # transport passes to nats-py apart (schemas/nats_address.py).
    assert "connected to NATS nats://127.0.0.1" in logged
    assert "n4ts-pw" not in logged


async def test_a_failure_that_ends_the_transport_loop_is_counted_and_it_starts_again(
        nats_url: str, subject_prefix: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """An exception outside the publisher's rounds (here: the first connect) ended the
    transport thread: the engine ran without NATS for good, one log line, no counter.
    Now it is counted in internal_errors and the loop starts again, connecting first.
    The fault is injected (the connect raises once): the one known real cause, a URL
    nats-py refuses, is now refused at start-up by the config."""
    from kvhint.engine_plugin import transport as transport_module

    real_connect = transport_module.connect_until_stopped
    calls = []

    async def connect_failing_once(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) == 1:
            raise AssertionError("nats-py refused the URL")  # as nats-py's own assert did
        return await real_connect(*args, **kwargs)

    monkeypatch.setattr(transport_module, "connect_until_stopped", connect_failing_once)
    subjects = Subjects(subject_prefix)
    nc = await nats.connect(nats_url)
    try:
        status = await collect(nc, subjects.status("w0"))
        with plugin(nats_url, subject_prefix) as h:
            transport = h.connector.transport
            await until(lambda: transport.connected, timeout_s=10)
            beat = decode_status((await asyncio.wait_for(status.get(), 5)).data)
            assert beat.worker_id == "w0"
            assert transport.counters.internal_errors == 1 and len(calls) == 2
    finally:
        try:
            await nc.jetstream().delete_stream(subjects.events_stream)
        except NotFoundError:
            pass
        await nc.drain()


async def test_credentials_in_nats_url_itself_are_warned_about(
        nats_url: str, subject_prefix: str, caplog: pytest.LogCaptureFixture) -> None:
    """vLLM logs --kv-transfer-config at start-up: a password written into nats_url is in
    its log. The plugin says so and names nats_url_env (the test server takes any user)."""
    with_user = nats_url.replace("nats://", "nats://someone:pw@", 1)
    with caplog.at_level(logging.WARNING, logger=LOGGER_NAME):
        with plugin(with_user, subject_prefix):
            pass
        warned = [r.getMessage() for r in caplog.records if "nats_url_env" in r.getMessage()]
        assert warned and "pw" not in warned[0]
        caplog.clear()
        with plugin(nats_url, subject_prefix):
            pass
        assert not [r for r in caplog.records if "nats_url_env" in r.getMessage()]
    nc = await nats.connect(nats_url)
    try:
        await nc.jetstream().delete_stream(Subjects(subject_prefix).events_stream)
    except NotFoundError:
        pass
    finally:
        await nc.drain()
