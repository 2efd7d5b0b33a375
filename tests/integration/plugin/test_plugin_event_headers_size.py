"""An event batch's headers count against NATS ``max_payload`` (the server adds them to
the payload; nats-py checks the payload alone). Against a real nats-server started with
a small ``max_payload``: a batch whose payload fits but whose payload and
``EventBatchMeta`` headers do not is dropped, counted (the router sees the gap and takes
a snapshot), and the connection stays up. Before, it was published: the server closed
the connection ("Maximum Payload Violation"), and the transport reconnected and sent
it again, for good."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from scheduler_fixtures import collect, nats_client, until
from scheduler_fixtures import nats_plugin as plugin
from vllm.distributed.kv_events import BlockStored

from kvhint.engine_plugin.mailbox import EventBatchOut
from kvhint.engine_plugin.transport_oversize import header_bytes
from kvhint.router.devstack.nats_server import nats_server_binary, start_nats_on_free_port
from kvhint.schemas import Subjects
from kvhint.schemas.events import EventBatchMeta

MAX_PAYLOAD = 64 * 1024


@pytest.fixture
def small_nats(tmp_path: Path) -> Iterator[str]:
    conf = tmp_path / "nats.conf"
    conf.write_text(f"max_payload: {MAX_PAYLOAD}\n")

    def command(port: int) -> list[str]:
        return [nats_server_binary(), "-a", "127.0.0.1", "-p", str(port), "-c", str(conf)]

    server, port = start_nats_on_free_port(command, tmp_path / "nats.log")
    try:
        yield f"nats://127.0.0.1:{port}"
    finally:
        server.terminate()
        server.wait(timeout=10)


@pytest.fixture(autouse=True)
def _quiet_nats_logs(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("ERROR", logger="nats")


def _batch(seq: int, tokens: int) -> EventBatchOut:
    return EventBatchOut(seq, time.time(), [BlockStored(
        block_hashes=[seq], parent_block_hash=None, token_ids=[7] * tokens, block_size=16,
        lora_id=None, medium="GPU", lora_name=None)])


def _sized(encode, seq: int, size: int) -> EventBatchOut:
    """A batch of ``seq`` whose payload is ``size`` bytes (token ids of 1 byte each)."""
    tokens = 1_000
    while (have := len(encode(0.0, _batch(seq, tokens).events))) != size:
        tokens += size - have
    return _batch(seq, tokens)


async def test_a_batch_past_max_payload_with_its_headers_is_dropped_not_sent(
        small_nats: str, subject_prefix: str) -> None:
    subjects = Subjects(subject_prefix)
    async with nats_client(small_nats) as nc:
        assert nc.max_payload == MAX_PAYLOAD
        events = await collect(nc, subjects.events("w0"))
        with plugin(small_nats, subject_prefix, create_events_stream=False) as h:
            transport, mailbox = h.connector.transport, h.connector.core.mailbox
            await until(lambda: transport.set_up)
            encode = transport._encode_events
            meta = EventBatchMeta("w0", transport.epoch, 1_000_000, transport._event_group)
            headers = header_bytes(meta.to_headers())
            assert 20 < headers < 200
            # Fits by its payload, not with its headers.
            near = _sized(encode, 1_000_000, MAX_PAYLOAD - headers // 2)
            # Exactly at the limit with its headers (the count is the client's own).
            fits = _sized(encode, 1_000_001, MAX_PAYLOAD - headers)
            dropped_before = mailbox.counters.event_batches_dropped
            mailbox.put_events(near)
            mailbox.put_events(fits)
            got = await asyncio.wait_for(events.get(), 5)
            assert EventBatchMeta.from_headers(got.headers).seq == 1_000_001
            assert len(got.data) == MAX_PAYLOAD - headers
            assert mailbox.counters.event_batches_dropped == dropped_before + 1
            assert transport.counters.disconnects == 0
            assert transport.counters.queued_publish_errors == 0
            assert events.empty()
