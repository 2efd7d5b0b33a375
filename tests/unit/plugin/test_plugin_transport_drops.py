"""What the NATS transport loses or gives up is counted (never started: a stand-in
connection that refuses every publish, and nats-py's error callback called directly)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

import pytest
from nats.errors import Error as NatsError
from nats.errors import SlowConsumerError

from kvhint.engine_plugin import inbound_checks
from kvhint.engine_plugin import transport as transport_module
from kvhint.engine_plugin.config import LOGGER_NAME, PluginConfig
from kvhint.engine_plugin.counter_exports import EXPORTS, read_counters
from kvhint.engine_plugin.mailbox import Mailbox, SnapshotOut
from kvhint.engine_plugin.snapshot_pages import KeptSnapshots
from kvhint.engine_plugin.transport import NatsTransport
from kvhint.engine_plugin.transport_counters import NatsErrorLog, TransportCounters
from kvhint.schemas import HintOutcome, OutcomeStatus


def _transport(mailbox: Mailbox | None = None) -> NatsTransport:
    return NatsTransport(PluginConfig(worker_id="w0"), "w0", "e1",
                         mailbox or Mailbox(inbound_limit=4, outcome_limit=4,
                                            event_batch_limit=4),
                         lambda usage, seq: None, lambda ts, events: b"", 32)  # type: ignore[arg-type, return-value]


class _RefusingNats:
    """Connected, and refuses every publish; JetStream does not answer."""

    is_connected = True
    max_payload = 1 << 20

    async def publish(self, subject: str, payload: bytes, headers: Any = None) -> None:
        raise NatsError("nats: connection closed")

    def jetstream(self) -> Any:
        async def stream_info(name: str) -> None:
            raise NatsError("nats: no responders available for request")
        return SimpleNamespace(stream_info=stream_info)


def _exported(counters: TransportCounters) -> dict[str, Any]:
    return read_counters({cls: counters if cls is TransportCounters else None
                          for cls in EXPORTS})


@contextmanager
def _warnings() -> Iterator[list[str]]:
    lines: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    log = logging.getLogger(LOGGER_NAME)
    log.addHandler(handler)
    try:
        yield lines
    finally:
        log.removeHandler(handler)


def _slow_consumer() -> SlowConsumerError:
    sub: Any = None
    return SlowConsumerError(subject="kvhint.hints.w0", reply="", sid=1, sub=sub)


def test_nats_async_errors_are_counted_by_kind() -> None:
    """A slow consumer means nats-py discarded an inbound hint, advice or snapshot
    request; before, its error callback only logged it at DEBUG, uncounted."""
    transport = _transport()
    for exc in (_slow_consumer(), _slow_consumer(), NatsError("nats: stale connection")):
        asyncio.run(transport._on_error(exc))
    assert _exported(transport.counters)["nats_errors"] == {"slow_consumer": 2, "other": 1}


def test_nats_error_warnings_are_rate_limited_per_kind() -> None:
    now = [0.0]
    errors = NatsErrorLog(TransportCounters(), clock=lambda: now[0], every_s=30.0)
    with _warnings() as lines:
        errors.note(_slow_consumer())
        errors.note(_slow_consumer())  # within 30 s: counted, not warned
        errors.note(NatsError("nats: stale connection"))  # another kind: warned
        now[0] = 31.0
        errors.note(_slow_consumer())
    assert len(lines) == 3
    assert "slow consumer: 1 inbound" in lines[0] and "slow consumer: 2 inbound" in lines[2]
    assert errors.counters.nats_slow_consumer_errors == 3
    assert errors.counters.nats_other_errors == 1


def test_failed_publishes_are_counted_by_what_was_lost_or_retried(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A heartbeat or a snapshot page NATS refuses is lost for good (a queued item goes
    back and is retried); before, all three went into one counter never exported."""
    monkeypatch.setattr(transport_module, "encode_status", lambda status: b"{}")
    mailbox = Mailbox(inbound_limit=4, outcome_limit=4, event_batch_limit=4)
    transport = _transport(mailbox)
    nc = transport._nc = _RefusingNats()
    mailbox.put_outcomes([HintOutcome(message_id="m", action_id="a", action_type="kv.pin",
                                      worker_id="w0", status=OutcomeStatus.ACCEPTED,
                                      reason="", at=1.0)])
    failed = SnapshotOut(7, [], [], "_INBOX.r", -1, 0, error="bad request")

    async def run() -> None:
        await transport._heartbeat(nc)
        await transport._reply_page(failed, [], "_INBOX.r", 0, 10)
        await transport._flush_outbound(nc)

    asyncio.run(run())
    assert len(mailbox.outcomes) == 1  # put back for the next try
    assert _exported(transport.counters)["publish_errors"] == {
        "queued": 1, "heartbeat": 1, "snapshot_reply": 1, "oversize": 0}


def test_snapshot_requests_no_page_can_answer_are_counted_and_cost_no_copy() -> None:
    """A request without a reply subject was queued for the scheduler thread (which
    copies the whole index for it), then dropped uncounted."""
    mailbox = Mailbox(inbound_limit=4, outcome_limit=4, event_batch_limit=4)
    transport = _transport(mailbox)
    asyncio.run(transport._on_snapshot(SimpleNamespace(data=b"{}", reply="")))
    assert not mailbox.inbound
    asyncio.run(transport._reply_page(SnapshotOut(1, [], [], None, 0, 10), [], None, 0, 10))
    assert _exported(transport.counters)["snapshot_requests_unanswered"] == 2


def test_jetstream_not_answering_is_counted() -> None:
    """The events stream could not be looked up: batches go out as plain messages, not
    kept for replay; before, only a log line said so."""
    transport = _transport()
    asyncio.run(transport._ensure_stream(_RefusingNats()))
    assert _exported(transport.counters)["jetstream_unavailable"] == 1
    assert transport.counters.stream_create_failures == 0


def test_a_hints_message_the_decoder_fails_on_is_queued_to_be_answered_and_counted(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Before, an exception from the hints decoder (a bug: injected) left the transport's
    subscription callback: the message was lost, counted only as a NATS error, and never
    answered. Now it goes to the engine as a malformed message (answered rejected with
    the reason, in order with the others), the failure counted as an internal error."""
    def broken(data: Any) -> Any:
        raise RuntimeError("injected decoder bug")

    monkeypatch.setattr(inbound_checks, "decode_hints", broken)
    mailbox = Mailbox(inbound_limit=4, outcome_limit=4, event_batch_limit=4)
    transport = _transport(mailbox)

    async def run() -> None:
        transport._loop = asyncio.get_running_loop()
        transport._post("hints", SimpleNamespace(data=b'{"message_id": "m"}', reply=""))

    asyncio.run(run())
    (item,) = mailbox.inbound
    assert item.decoded.actions == [] and item.decoded.error is not None
    assert "could not be decoded (RuntimeError: injected decoder bug)" in item.decoded.error
    assert _exported(transport.counters)["internal_errors"] == 1


def _snapshot(seq: int) -> SnapshotOut:
    return SnapshotOut(seq, [(seq, None, 1, None)], [], None, 0, 10)


def test_kept_snapshots_let_go_by_count_or_age_are_counted() -> None:
    """Only those let go over snapshot_keep_blocks were counted (snapshots_dropped); a
    router paging one let go by the count (3) or age (120 s) bound also starts over."""
    now = [0.0]
    counters = TransportCounters()
    kept = KeptSnapshots(1_000, counters, clock=lambda: now[0])
    for seq in (1, 2, 3, 4):
        kept.keep(_snapshot(seq))
    assert kept.seqs == [2, 3, 4] and counters.snapshots_evicted == 1
    now[0] = 121.0
    kept.keep(_snapshot(5))
    assert kept.seqs == [5] and counters.snapshots_evicted == 4
    assert counters.snapshots_dropped == 0
    assert _exported(counters)["snapshots_evicted"] == 4
