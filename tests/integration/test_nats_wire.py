"""Wire messages over a real NATS server (with JetStream)."""

from __future__ import annotations

import asyncio

import nats
from nats.js.api import StreamConfig

from kvhint import schemas as s


async def test_hint_envelope_published_and_received_decoded(nats_url: str,
                                                            subject_prefix: str) -> None:
    subjects = s.Subjects(subject_prefix)
    nc = await nats.connect(nats_url)
    try:
        received: asyncio.Queue[bytes] = asyncio.Queue()

        async def on_msg(msg) -> None:
            await received.put(msg.data)

        await nc.subscribe(subjects.hints("w0"), cb=on_msg)
        envelope = s.KvHintsEnvelope(protocol_version="1", message_id="m-1", actions=[
            s.make_action("a-1", s.PinPayload(target=s.Target(session_id="t/s1"), ttl_s=20.0)),
            s.make_action("a-2", s.RetainPayload(target=s.Target(block_hashes=[2**64 - 1]),
                                                 priority=90)),
        ])
        await nc.publish(subjects.hints("w0"), s.encode_hints(envelope))
        decoded = s.decode_hints(await asyncio.wait_for(received.get(), timeout=5))
    finally:
        await nc.drain()
    assert decoded.error is None and decoded.message_id == "m-1"
    pin, retain = decoded.actions
    assert isinstance(pin, s.ParsedAction) and pin.payload == s.PinPayload(
        target=s.Target(session_id="t/s1"), ttl_s=20.0)
    assert isinstance(retain, s.ParsedAction)
    assert retain.payload.target.block_hashes == [2**64 - 1]


async def test_event_batches_replay_from_jetstream_with_headers(nats_url: str,
                                                                subject_prefix: str) -> None:
    subjects = s.Subjects(subject_prefix)
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    stream = subjects.events_stream
    try:
        await js.add_stream(StreamConfig(name=stream, subjects=[subjects.all_of("events")],
                                         max_msgs=1000))
        for seq in (1, 2, 3):
            batch = s.KVEventBatch(ts=float(seq), events=[
                s.BlockStored(block_hashes=[seq], parent_block_hash=None, token_ids=[seq],
                              block_size=1, lora_id=None, medium="GPU", lora_name=None)])
            meta = s.EventBatchMeta("w0", "epoch-a", seq)
            await js.publish(subjects.events("w0"), s.encode_event_batch(batch),
                             headers=meta.to_headers())
        sub = await js.subscribe(subjects.all_of("events"), ordered_consumer=True)
        decoder = s.EventBatchDecoder()
        seen = []
        for _ in range(3):
            msg = await sub.next_msg(timeout=5)
            meta = s.EventBatchMeta.from_headers(msg.headers)
            seen.append((meta.seq, decoder.decode(msg.data).events[0].block_hashes))
        assert seen == [(1, [1]), (2, [2]), (3, [3])]
    finally:
        await js.delete_stream(stream)
        await nc.drain()
