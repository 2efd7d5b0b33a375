"""A worker's hold release the router hears again (a second delivery of the same message;
JetStream replaying the releases stream from a cursor behind what the router applied)
counts its blocks in ``kvhint_router_hold_released_blocks_total`` once, as the holding
itself shrinks once; a later release of the same action counts its own blocks. Real NATS
JetStream and a SQLite store; the "plugin" is this test publishing wire messages."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import nats
import pytest
import sqlalchemy as sa

from conftest import StubWorker, router_settings, running_router
from feed_helpers import chat, plugin_registered, publish_accepted, publish_release, until
from kvhint.router.policy import Holdings
from kvhint.schemas import (
    Amount,
    HoldRelease,
    HoldsReleased,
    ReleaseReason,
    Subjects,
    decode_hints,
    encode_releases,
)

pytestmark = pytest.mark.usefixtures("throwaway_streams")


async def test_a_release_heard_again_counts_its_blocks_once(
        tmp_path: Path, nats_url: str, subject_prefix: str,
        stub_workers: list[StubWorker]) -> None:
    subjects = Subjects(subject_prefix)
    nc = await nats.connect(nats_url)
    held: list[tuple[str, str, str | None]] = []  # (message id, action id, session)

    async def plugin(msg) -> None:  # noqa: ANN001 - remembers; the test answers
        decoded = decode_hints(msg.data)
        held.extend((decoded.message_id, a.action_id, a.payload.target.session_id)
                    for a in decoded.actions if a.action_type.value == "kv.retain")

    await nc.subscribe(subjects.hints("w0"), cb=plugin)
    # No planner tick in the test's time (a re-protection would replace the holding).
    settings = router_settings(tmp_path, [("w0", stub_workers[0].url)], nats_url=nats_url,
                               subject_prefix=subject_prefix, hints={"tick_s": 3600.0})
    js = nc.jetstream()
    try:
        async with running_router(settings) as router, httpx.AsyncClient() as client:
            runtime = router.runtime
            await plugin_registered(runtime, nc, subjects)
            await chat(client, router.url, "agent", "x" * 400)
            await until(lambda: len(held) >= 1)
            message_id, action_id, session = held[0]
            await publish_accepted(nc, subjects, message_id, action_id, "kv.retain", 4)
            await until(lambda: action_id not in runtime.hints.pending)
            displaced = runtime.metrics.hold_releases.labels("kv.retain", "displaced")
            # 3 of its 4 blocks displaced, then the same message delivered again (a
            # plain subscription and a new JetStream consumer overlapping, a replay).
            release = encode_releases(HoldsReleased(worker_id="w0", at=time.time(), releases=[
                HoldRelease(action_id=action_id, action_type="kv.retain", session_id=session,
                            reason=ReleaseReason.DISPLACED, released=Amount(3, 96),
                            held=Amount(1, 32))]))
            await js.publish(subjects.releases("w0"), release)
            await js.publish(subjects.releases("w0"), release)
            await until(lambda: runtime.feed.releases.seq == 2)
            assert runtime.hints.holdings.worker("w0") == Holdings(0, 1)
            assert displaced._value.get() == 3  # before: 6
        # The stored releases cursor falls behind what the router applied (another
        # replica's older write to the shared cursor; a crash before its last write):
        # the next router replays the release again from the stream.
        engine = sa.create_engine(settings.database_url)
        try:
            with engine.begin() as conn:
                assert conn.execute(sa.text(
                    "SELECT value FROM cursors WHERE name = 'releases_stream_seq'"
                )).scalar_one() == 2
                conn.execute(sa.text(
                    "UPDATE cursors SET value = 1 WHERE name = 'releases_stream_seq'"))
        finally:
            engine.dispose()
        async with running_router(settings) as router:
            runtime = router.runtime
            holdings = runtime.hints.holdings
            assert await runtime.link.wait_set_up(10)
            await until(lambda: runtime.feed.releases.seq == 2)
            # Restored from the store at what is left; the replay removes nothing more.
            assert holdings.worker("w0") == Holdings(0, 1)
            assert runtime.metrics.hold_releases.labels(
                "kv.retain", "displaced")._value.get() == 0  # before: 3 again
            # The action's next release counts its own block.
            await publish_release(nc, subjects, action_id, "kv.retain", session, 1, 0,
                                  ReleaseReason.PRESSURE)
            await until(lambda: holdings.worker("w0") == Holdings())
            assert runtime.metrics.hold_releases.labels(
                "kv.retain", "pressure")._value.get() == 1
    finally:
        await nc.drain()
