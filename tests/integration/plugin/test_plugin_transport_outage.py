"""The plugin's NATS transport through outages, with real NATS servers stopped and started
again: NATS dropping while something is queued, NATS down at the engine's start, and a
bug in one round of the publisher."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import nats
import pytest
from nats.js.api import StorageType, StreamConfig

from kvhint.engine_plugin import transport as transport_module
from kvhint.engine_plugin import transport_connect
from kvhint.engine_plugin.config import LOGGER_NAME
from kvhint.engine_plugin.headless import tokens_for_block_ids
from kvhint.engine_plugin.transport import NatsTransport
from kvhint.router.devstack.nats_server import (
    NatsServerProcess,
    nats_server_binary,
    start_nats_on_free_port,
)
from scheduler_fixtures import nats_client, nats_plugin, until
from kvhint.schemas import (
    HintOutcome,
    KvHintsEnvelope,
    OutcomeStatus,
    PinPayload,
    Subjects,
    Target,
    decode_outcome,
    encode_hints,
    make_action,
)

BS = 32


def plugin(nats_url: str, prefix: str, **extra: Any) -> Any:
    return nats_plugin(nats_url, prefix, create_events_stream=False, **extra)


@contextmanager
def plugin_records() -> Iterator[list[logging.LogRecord]]:
    """The plugin's WARNING-and-up log records (vLLM's loggers do not propagate to the
    root, so caplog does not see them)."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append  # type: ignore[method-assign]
    log = logging.getLogger(LOGGER_NAME)
    log.addHandler(handler)
    try:
        yield records
    finally:
        log.removeHandler(handler)


def thread_cpu_s(thread: threading.Thread) -> float:
    assert thread.ident is not None
    return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))


def outcome(action_id: str) -> HintOutcome:
    return HintOutcome(message_id=f"m-{action_id}", action_id=action_id, action_type="kv.pin",
                       worker_id="w0", status=OutcomeStatus.ACCEPTED, at=time.time())


def stop_timed(transport: NatsTransport) -> tuple[float, threading.Thread]:
    thread = transport._thread
    assert thread is not None
    started = time.monotonic()
    transport.stop()
    return time.monotonic() - started, thread


async def test_an_outage_with_an_outcome_queued_costs_no_cpu_and_the_outcome_follows(
        own_nats: NatsServerProcess, subject_prefix: str) -> None:
    """Before, NATS dropping while anything was queued (an outcome, a release, a
    snapshot) made the publisher loop without ever awaiting: a core burnt, the idle
    engine was woken on every lap (1.4M WAKEUPs in 2 s), nats-py's reconnect never ran
    (the outcome was never delivered) and stop() timed out leaving the thread alive."""
    subjects = Subjects(subject_prefix)
    nc = await nats.connect(own_nats.url)
    # A stream keeps the outcome whenever the plugin publishes it after the restart; a
    # plain subscriber might not have reconnected by then.
    stream = f"OUTCOMES_{subject_prefix.replace('.', '_')}"
    await nc.jetstream().add_stream(StreamConfig(
        name=stream, subjects=[subjects.outcomes("w0")], storage=StorageType.FILE))
    await nc.drain()
    with plugin(own_nats.url, subject_prefix) as h:
        transport = h.connector.transport
        mailbox = h.connector.core.mailbox
        wakes: list[float] = []
        mailbox.wake_engine = lambda: wakes.append(time.monotonic())  # vLLM's WAKEUP put
        # Set up, not only connected: an outage during the set-up holds the publisher in
        # the stream's look (up to 5 s), and no wake-up comes meanwhile.
        await until(lambda: transport.set_up)
        thread = transport._thread
        own_nats.stop()
        await until(lambda: not transport.connected)
        mailbox.put_outcomes([outcome("during-outage")])  # a step settles a hint
        # An idle engine whose last step skipped a status refresh: one wake-up is asked.
        mailbox.status_refresh_at = time.time() - 1
        cpu = thread_cpu_s(thread)
        await asyncio.sleep(1.5)
        assert thread_cpu_s(thread) - cpu < 0.3  # was all of a core
        # One for the status refresh, and one for /metrics to show each change of the
        # connection (up: may have come before wake_engine was replaced; down); the NATS
        # errors of the reconnect attempts wake it no more (METRICS_WAKE_EVERY_S).
        assert 1 <= len(wakes) <= 3
        assert mailbox.outcomes  # waiting for NATS
        own_nats.start()
        await until(lambda: transport.connected, timeout_s=20)
        await until(lambda: not mailbox.outcomes)
        async with nats_client(own_nats.url) as nc:
            stored = await nc.jetstream().get_msg(stream, seq=1)
            assert decode_outcome(stored.data).action_id == "during-outage"
            await nc.jetstream().delete_stream(stream)
        # Down again with an outcome queued: the engine's shutdown is not held up.
        own_nats.stop()
        await until(lambda: not transport.connected)
        mailbox.put_outcomes([outcome("at-shutdown")])
        await asyncio.sleep(0.3)
        elapsed, thread = stop_timed(transport)
        assert elapsed < 1.5 and not thread.is_alive()
        # Stopped while nats-py reconnects: its drain and close refuse (the connection is
        # reconnecting, then reset), an expected end, not the plugin's bug.
        assert transport.counters.internal_errors == 0


async def test_nats_down_at_start_stops_at_once_warns_and_connects_when_it_comes_up(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before, nats-py retried the first connect forever inside the call: stop() could
    not interrupt it (5 s, then the thread outlived the engine) and the plugin's
    "unreachable" warning and backoff never ran."""
    server = NatsServerProcess(store_dir=tmp_path / "store", log_path=tmp_path / "nats.log")
    try:
        with plugin(server.url, "kvhinttest.down") as h:  # nothing listens on the port
            await asyncio.sleep(1.0)  # inside the first attempt (CONNECT_ATTEMPT_S = 5)
            elapsed, thread = stop_timed(h.connector.transport)
            assert elapsed < 1.0 and not thread.is_alive()
        monkeypatch.setattr(transport_connect, "CONNECT_ATTEMPT_S", 0.5)
        with plugin_records() as records, plugin(server.url, "kvhinttest.down") as h:
            transport = h.connector.transport
            await until(lambda: any("unreachable" in r.getMessage() for r in records))
            assert transport.counters.disconnects == 0  # attempts given up: no disconnect
            server.start()
            await until(lambda: transport.connected, timeout_s=15)
            assert transport.counters.connects == 1
    finally:
        server.close()


async def test_a_bug_in_one_publisher_round_is_counted_and_the_transport_goes_on(
        nats_url: str, subject_prefix: str) -> None:
    """Before, any exception but a NATS or socket error ended the transport thread for
    good (only nats_connected going to 0 said so). Nothing the plugin can receive makes
    the publisher raise anything else today: the guard is for bugs, so one is injected,
    an event encoder failing twice."""
    subjects = Subjects(subject_prefix)
    async with nats_client(nats_url) as nc:
        events = await nc.subscribe(subjects.events("w0"))
        with plugin_records() as records, plugin(nats_url, subject_prefix) as h:
            transport = h.connector.transport
            await until(lambda: transport.connected)
            encode, failures = transport._encode_events, [2]

            def faulty(ts: float, batch: list[Any]) -> bytes:
                if failures[0] > 0:
                    failures[0] -= 1
                    raise RuntimeError("injected encoder bug")
                return encode(ts, batch)

            transport._encode_events = faulty  # type: ignore[method-assign]
            for i, session in enumerate(("a", "b", "c")):
                h.run(h.make_request(tokens_for_block_ids([10 * i + 1], BS) + [3] * 5,
                                     session_id=session))
                await until(lambda: not h.connector.core.mailbox.event_batches)
            await events.next_msg(timeout=5)  # the third batch
            assert transport._thread is not None and transport._thread.is_alive()
            assert transport.counters.internal_errors == 2
            assert h.connector._read_stats()["internal_errors"] == 2
            errors = [r for r in records if r.levelno >= logging.ERROR]
            assert len(errors) == 1 and errors[0].exc_info is not None  # once, traceback
            assert "injected encoder bug" in str(errors[0].exc_info[1])


@contextmanager
def nats_without_jetstream() -> Iterator[str]:
    """A real nats-server without JetStream (NatsServerProcess always enables it): a
    JetStream request there is answered by whoever subscribes to its subject, or not."""
    proc, port = start_nats_on_free_port(
        lambda port: [nats_server_binary(), "-a", "127.0.0.1", "-p", str(port)])
    try:
        yield f"nats://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(10)


async def test_stop_cancels_a_stream_lookup_jetstream_does_not_answer(
        subject_prefix: str) -> None:
    """The events stream is looked up once connected; JetStream's stream_info waits up
    to 5 s for an answer. Before, that lookup ran outside anything stop() could cut
    short: stop() waited its whole 5 s and returned with the thread still alive."""
    with nats_without_jetstream() as url:
        async with nats_client(url) as nc:
            lookups = await nc.subscribe("$JS.API.STREAM.INFO.>")  # and never answers
            await nc.flush()  # on the server before the plugin (built blocking) asks
            with nats_plugin(url, subject_prefix, create_events_stream=True) as h:
                await lookups.next_msg(timeout=10)  # the plugin waits for the answer now
                await asyncio.sleep(0.3)
                elapsed, thread = stop_timed(h.connector.transport)
                assert elapsed < 1.5 and not thread.is_alive()


async def test_a_bug_in_the_transports_setup_is_counted_and_the_setup_retried(
        nats_url: str, subject_prefix: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Subscribing and the events stream's setup ran before the publisher's protected
    loop: any exception there but a NATS error (a bug: one is injected) ended the
    transport thread for good, the engine running on without NATS. Now it is counted
    and logged like a failed publisher round, and the setup is tried again (each
    subscription made once) until it goes through."""
    ensure, failures = transport_module.ensure_events_stream, [1]

    async def faulty(*args: Any) -> None:
        if failures[0] > 0:
            failures[0] -= 1
            raise RuntimeError("injected setup bug")
        await ensure(*args)

    monkeypatch.setattr(transport_module, "ensure_events_stream", faulty)
    subjects = Subjects(subject_prefix)
    async with nats_client(nats_url) as nc:
        outcomes = await nc.subscribe(subjects.outcomes("w0"))
        with plugin_records() as records, plugin(nats_url, subject_prefix) as h:
            transport = h.connector.transport
            await until(lambda: transport.counters.heartbeats_published > 0)
            assert transport._thread is not None and transport._thread.is_alive()
            assert transport.counters.internal_errors == 1
            errors = [r for r in records if r.levelno >= logging.ERROR]
            assert len(errors) == 1 and "injected setup bug" in str(errors[0].exc_info[1])
            await nc.publish(subjects.hints("w0"), encode_hints(KvHintsEnvelope(
                protocol_version="1", message_id="m1", actions=[make_action(
                    "p1", PinPayload(target=Target(session_id="s"), ttl_s=5))])))
            mailbox = h.connector.core.mailbox
            await until(lambda: bool(mailbox.inbound))
            await asyncio.sleep(0.2)
            assert len(mailbox.inbound) == 1  # subscribed once, not once per try
            h.step()
            answer = decode_outcome((await outcomes.next_msg(timeout=5)).data)
            assert (answer.action_id, answer.status.value) == ("p1", "missing")


@pytest.fixture(autouse=True)
def _quiet_nats_logs(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("ERROR", logger="nats")
