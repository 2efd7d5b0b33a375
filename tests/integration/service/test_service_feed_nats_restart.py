"""A NATS server restarted (with its store) while the router runs: the router's JetStream
consumers (events, outcomes, releases) resume at once, from the last message each handled.

Before, nats-py's reconnect kept the ordered consumers' subscriptions, but the consumers
behind them were gone with the old server process: nothing came until nats-py missed two
idle heartbeats and made each consumer again (measured ~19 s of silence; meanwhile a
worker's heartbeats naming batches not yet read looked like tail gaps, resyncs). Now
NatsLink.on_reconnected has the stream watch (stream_watch.py) restart each consumer from
the sequence after the last it handled: nothing skipped, nothing read twice."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import nats

from conftest import router_settings, running_router
from feed_helpers import status, stored, until
from kvhint.router.devstack.nats_server import NatsServerProcess
from kvhint.schemas import (
    Amount,
    EventBatchMeta,
    HintOutcome,
    HoldRelease,
    HoldsReleased,
    OutcomeStatus,
    ReleaseReason,
    Subjects,
    encode_outcome,
    encode_releases,
)

# Well under nats-py's own consumer reset (two idle heartbeats of 5 s, ~19 s measured).
RESUMED_WITHIN_S = 5.0


def _outcome(i: int) -> bytes:  # of an action no router sent: read (the cursor), dropped
    return encode_outcome(HintOutcome(message_id=f"m{i}", action_id=f"a{i}",
                                      action_type="kv.pin", worker_id="w0",
                                      status=OutcomeStatus.ACCEPTED, at=time.time()))


def _release(i: int) -> bytes:
    return encode_releases(HoldsReleased(worker_id="w0", at=time.time(), releases=[
        HoldRelease(action_id=f"r{i}", action_type="kv.pin", reason=ReleaseReason.PRESSURE,
                    released=Amount(blocks=1), held=Amount())]))


async def test_consumers_resume_from_their_last_message_right_after_a_nats_restart(
        tmp_path: Path, own_nats: NatsServerProcess, subject_prefix: str) -> None:
    subjects = Subjects(subject_prefix)
    settings = router_settings(tmp_path, [], nats_url=own_nats.url,
                               subject_prefix=subject_prefix)
    seq = 0
    nc = await nats.connect(own_nats.url, reconnect_time_wait=0.2,
                            max_reconnect_attempts=-1)

    async def beat() -> None:  # core NATS: what is published while the server is down is lost
        while True:
            if nc.is_connected:
                await nc.publish(subjects.status("w0"), status("w0", "e1", seq))
            await asyncio.sleep(0.25)

    async def publish(js: object, n: int) -> None:  # acked by the stream
        nonlocal seq
        for _ in range(n):
            await js.publish(subjects.events("w0"),  # type: ignore[attr-defined]
                             stored([seq + 1], seq or None, None),
                             headers=EventBatchMeta("w0", "e1", seq + 1).to_headers())
            seq += 1

    beating = asyncio.create_task(beat())
    try:
        async with running_router(settings) as router:
            runtime = router.runtime
            feed = runtime.feed
            assert await runtime.link.wait_set_up(10)
            counters = lambda: runtime.ingestor.worker_views()["w0"].counters  # noqa: E731
            await until(lambda: runtime.ingestor.live_workers() == ("w0",))
            js = nc.jetstream()
            await publish(js, 5)
            await js.publish(subjects.outcomes("w0"), _outcome(1))
            await js.publish(subjects.releases("w0"), _release(1))
            await until(lambda: runtime.ingestor.worker_views()["w0"].applied_seq == 5
                        and feed.outcomes.seq == 1 and feed.releases.seq == 1)

            await asyncio.to_thread(own_nats.stop)
            await asyncio.to_thread(own_nats.start)
            # Published before the router is back (a fresh connection: the stream has it).
            early = await nats.connect(own_nats.url)
            try:
                early_js = early.jetstream()
                await publish(early_js, 3)
                await early_js.publish(subjects.outcomes("w0"), _outcome(2))
                await early_js.publish(subjects.releases("w0"), _release(2))
            finally:
                await early.drain()
            assert await runtime.link.wait_connected(10)
            await until(lambda: nc.is_connected)
            # Published after the router is back.
            await publish(js, 2)
            await js.publish(subjects.outcomes("w0"), _outcome(3))
            await js.publish(subjects.releases("w0"), _release(3))
            published_at = time.monotonic()
            # Before: ~19 s (nats-py's heartbeat-missed reset).
            await until(lambda: runtime.ingestor.worker_views()["w0"].applied_seq == 10
                        and feed.outcomes.seq == 3 and feed.releases.seq == 3,
                        timeout_s=RESUMED_WITHIN_S)
            assert time.monotonic() - published_at < RESUMED_WITHIN_S
            # Each from the message after the last it handled: nothing read twice.
            assert counters()["duplicates"] == 0 and counters()["resyncs_started"] == 0
            assert runtime.metrics.drops.labels("outcome_duplicate")._value.get() == 0
            assert feed.streams.resumed == 3
    finally:
        beating.cancel()
        await nc.drain()
