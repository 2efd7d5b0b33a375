"""JetStream streams deleted (an operator, a NATS server restarted without its store) while
the router runs, or while it is down.

A stream made again numbers its messages from 1 again. nats-py's ordered consumer, its
consumer gone with the old stream, makes a new one two idle heartbeats (10 s) later that
starts after the *old* stream's last sequence, which the server takes as the new stream's
end: every message the new stream took before was skipped (event batches: a gap and a
resync; outcomes and releases: lost). A stream nobody makes again (the router's outcomes
and releases streams; the events stream without a plugin's create_events_stream) was never
read again until the router restarted: its worker's heartbeats showed tail gaps, each a
resync from a snapshot, for ever. router/service/stream_watch.py now makes a stream gone
again and starts its consumer over on a new one; a stored cursor past a stream's end
(made again while the router was down) reads it from its start."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import nats
import pytest
from nats.js.errors import NotFoundError

from conftest import router_settings, running_router
from feed_helpers import router_hearing_nats, status, stored, until
from kvhint.router.service.nats_link import outcomes_stream_name
from kvhint.schemas import (
    EventBatchMeta,
    HintOutcome,
    OutcomeStatus,
    Subjects,
    encode_outcome,
)

pytestmark = pytest.mark.usefixtures("throwaway_streams")

TIMEOUT_S = 30.0  # nats-py's own consumer reset comes after 10 s (two idle heartbeats)


def remade(runtime: Any) -> dict[str, float]:
    """kvhint_router_streams_remade_total by stream, as /metrics exports it."""
    counter = runtime.metrics.streams_remade
    return {kind: counter.labels(kind)._value.get()
            for kind in ("events", "outcomes", "releases")}


@asynccontextmanager
async def w0_publishing(tmp_path: Path, nats_url: str, subject_prefix: str
                        ) -> AsyncIterator[tuple[Any, Any, Callable[[int], Awaitable[None]],
                                                 Callable[[], int]]]:
    """A router that has applied w0's batches 1..20 (a chain of blocks 1..20), w0
    heartbeating the seq it published; yields (runtime, JetStream context, publish(n):
    the next n blocks as one batch each, taken(): batches the ingestor took, applied or
    held for a resync)."""
    subjects = Subjects(subject_prefix)
    async with router_hearing_nats(tmp_path, nats_url, subject_prefix) as (router, _, nc):
        runtime = router.runtime
        runtime.feed.streams.every_s = 0.3  # looked at often (5 s by default)
        seq = 0

        async def beat() -> None:
            while True:
                await nc.publish(subjects.status("w0"), status("w0", "e1", seq))
                await asyncio.sleep(0.25)

        async def publish(n: int) -> None:
            nonlocal seq
            for _ in range(n):
                seq += 1
                await nc.publish(subjects.events("w0"),
                                 stored([seq], seq - 1 if seq > 1 else None, None),
                                 headers=EventBatchMeta("w0", "e1", seq).to_headers())

        def taken() -> int:
            counters = runtime.ingestor.worker_views()["w0"].counters
            return counters["batches_applied"] + counters["buffered"]

        beating = asyncio.create_task(beat())
        try:
            await until(lambda: runtime.ingestor.live_workers() == ("w0",))
            await publish(20)
            await until(lambda: runtime.ingestor.worker_views()["w0"].applied_seq == 20)
            yield runtime, nc.jetstream(), publish, taken
        finally:
            beating.cancel()


async def test_batches_in_an_events_stream_made_again_by_a_plugin_reach_the_index(
        tmp_path: Path, nats_url: str, subject_prefix: str) -> None:
    subjects = Subjects(subject_prefix)
    async with w0_publishing(tmp_path, nats_url, subject_prefix) as (runtime, js, publish,
                                                                       taken):
        await asyncio.sleep(1.0)  # several looks at the streams: none is made again yet
        assert runtime.feed.streams.restarted == 0
        config = (await js.stream_info(subjects.events_stream)).config
        await js.delete_stream(subjects.events_stream)
        # Made again, as the plugin's EventsStreamWatch does (the same config: a no-op
        # should the router's own look make it first).
        await js.add_stream(config)
        await publish(5)
        await until(lambda: taken() == 25, timeout_s=TIMEOUT_S)
        assert runtime.feed.streams.restarted == 1
        # Counted by what the stream holds (before, only logged), the others at 0.
        assert remade(runtime) == {"events": 1, "outcomes": 0, "releases": 0}


async def test_an_events_stream_gone_is_made_again_by_the_router_and_read(
        tmp_path: Path, nats_url: str, subject_prefix: str) -> None:
    subjects = Subjects(subject_prefix)
    async with w0_publishing(tmp_path, nats_url, subject_prefix) as (runtime, js, publish,
                                                                       taken):
        await js.delete_stream(subjects.events_stream)

        async def exists() -> bool:
            try:
                await js.stream_info(subjects.events_stream)
                return True
            except NotFoundError:
                return False
        for _ in range(100):
            if await exists():
                break
            await asyncio.sleep(0.1)
        assert await exists()
        await publish(5)
        await until(lambda: taken() == 25, timeout_s=TIMEOUT_S)


async def test_a_stored_cursor_past_a_stream_made_again_reads_the_new_one_from_its_start(
        tmp_path: Path, nats_url: str, subject_prefix: str) -> None:
    """The router stopped at outcomes stream sequence 5 (its store's cursor); the stream
    was made again meanwhile and took 3 outcomes: the next router reads the new stream from
    its start. Before, its consumer asked for sequence 6, which the server took as the
    stream's end: the 3 outcomes were never read."""
    subjects = Subjects(subject_prefix)
    settings = router_settings(tmp_path, [], nats_url=nats_url, subject_prefix=subject_prefix)
    nc = await nats.connect(nats_url)
    js = nc.jetstream()

    async def answer(n: int) -> None:  # outcomes of actions no router sent: read, dropped
        for i in range(n):
            await nc.publish(subjects.outcomes("w0"), encode_outcome(HintOutcome(
                message_id=f"m{i}", action_id=f"a{i}", action_type="kv.pin",
                worker_id="w0", status=OutcomeStatus.ACCEPTED, at=time.time())))
    try:
        async with running_router(settings) as router:
            assert await router.runtime.link.wait_set_up(10)
            await answer(5)
            await until(lambda: router.runtime.feed.outcomes.seq == 5)
        name = outcomes_stream_name(subjects)
        config = (await js.stream_info(name)).config
        await js.delete_stream(name)
        await js.add_stream(config)  # made again (another router replica, an operator)
        await answer(3)  # while this router is down: sequences 1..3 of the new stream
        async with running_router(settings) as router:
            assert await router.runtime.link.wait_set_up(10)
            await until(lambda: router.runtime.feed.outcomes.seq == 3, timeout_s=5)
            assert remade(router.runtime) == {"events": 0, "outcomes": 1, "releases": 0}
    finally:
        await nc.drain()


async def test_an_outcomes_stream_gone_is_made_again_and_read(
        tmp_path: Path, nats_url: str, subject_prefix: str) -> None:
    """Nobody but the router makes the outcomes stream: gone while the router runs, it was
    never made again, and no outcome reached the router until it restarted."""
    subjects = Subjects(subject_prefix)
    async with router_hearing_nats(tmp_path, nats_url, subject_prefix) as (router, _, nc):
        feed = router.runtime.feed
        feed.streams.every_s = 0.3  # looked at often (5 s by default)
        js = nc.jetstream()
        name = outcomes_stream_name(subjects)
        await js.delete_stream(name)
        for _ in range(100):
            if feed.streams.restarted:
                break
            await asyncio.sleep(0.1)
        assert (await js.stream_info(name)).state.messages == 0
        await nc.publish(subjects.outcomes("w0"), encode_outcome(HintOutcome(
            message_id="m", action_id="a", action_type="kv.pin", worker_id="w0",
            status=OutcomeStatus.ACCEPTED, at=time.time())))
        await until(lambda: feed.outcomes.seq == 1, timeout_s=TIMEOUT_S)
        assert remade(router.runtime) == {"events": 0, "outcomes": 1, "releases": 0}
