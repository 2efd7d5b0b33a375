"""``kvhint:events_kept``: whether the events stream existed at the plugin's latest look,
against the real NATS (JetStream on), the stream made, deleted and made again.

Before, the plugin looked for the stream at set-up only, and said what it found only
through counters: one failed look read as events not kept (KvhintPluginEventsNotKept
fired on an hour's increase) although the router made the stream a minute later, and a
stream deleted later went unnoticed and was never made again. Now the transport looks
again every EVENTS_STREAM_CHECK_S (shortened here), creates a missing one where
``create_events_stream`` is on, and the gauge says what it found."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import nats
import pytest
from nats.js.api import DiscardPolicy, StorageType, StreamConfig
from nats.js.errors import NotFoundError
from scheduler_fixtures import nats_plugin, until

from kvhint.engine_plugin import transport_setup
from kvhint.schemas import Subjects


@pytest.fixture(autouse=True)
def _quick_looks(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(transport_setup, "EVENTS_STREAM_CHECK_S", 0.2)
    caplog.set_level(logging.ERROR, logger="nats")


def _kept(h: Any) -> int:
    """The gauge as the plugin ships it to vLLM's /metrics."""
    return h.connector._read_stats()["events_kept"]


async def _make_stream(js: Any, subjects: Subjects) -> None:
    """The stream as the router makes it."""
    await js.add_stream(StreamConfig(
        name=subjects.events_stream, subjects=[subjects.all_of("events")],
        storage=StorageType.FILE, max_age=600, max_bytes=8 << 20, discard=DiscardPolicy.OLD))


async def _delete_stream(js: Any, subjects: Subjects) -> None:
    try:
        await js.delete_stream(subjects.events_stream)
    except NotFoundError:
        pass


async def test_the_gauge_follows_the_stream_the_router_makes_and_an_operator_deletes(
        nats_url: str, subject_prefix: str) -> None:
    """create_events_stream off: the plugin finds no stream at set-up (0), the router makes
    it a moment later (1 at the next look, not an hour later), an operator deletes it
    (0 again)."""
    subjects = Subjects(subject_prefix)
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    try:
        with nats_plugin(nats_url, subject_prefix, create_events_stream=False) as h:
            transport = h.connector.transport
            await until(lambda: transport.counters.heartbeats_published > 0)
            await asyncio.sleep(0.5)  # set-up and two looks: no stream
            assert _kept(h) == 0 and not transport.events_kept
            await _make_stream(js, subjects)
            await until(lambda: transport.events_kept, timeout_s=5)
            assert _kept(h) == 1
            await _delete_stream(js, subjects)
            await until(lambda: not transport.events_kept, timeout_s=5)
            assert _kept(h) == 0
            with pytest.raises(NotFoundError):  # not made: create_events_stream is off
                await js.stream_info(subjects.events_stream)
    finally:
        await _delete_stream(js, subjects)
        await nc.drain()


async def test_a_deleted_stream_is_made_again(nats_url: str, subject_prefix: str) -> None:
    """create_events_stream on: the plugin makes the stream at set-up, and again when it
    finds it gone (before, the events went out unkept until the engine restarted)."""
    subjects = Subjects(subject_prefix)
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    try:
        with nats_plugin(nats_url, subject_prefix, create_events_stream=True) as h:
            transport = h.connector.transport
            await until(lambda: transport.events_kept, timeout_s=10)
            assert _kept(h) == 1
            await _delete_stream(js, subjects)

            async def made_again() -> bool:
                try:
                    await js.stream_info(subjects.events_stream)
                    return True
                except NotFoundError:
                    return False
            for _ in range(50):
                if await made_again():
                    break
                await asyncio.sleep(0.1)
            assert await made_again()
            assert transport.events_kept and _kept(h) == 1
            assert transport.counters.stream_create_failures == 0
    finally:
        await _delete_stream(js, subjects)
        await nc.drain()
