"""The router's JetStream streams against a real NATS server: a stream that exists with
other limits (an operator's, an older router's) is reconciled, a create race with
another router is no failure, a JetStream set-up failure is retried until replay works
again, and dead workers are remembered as long as the events stream really keeps their
messages."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import nats
import pytest
from nats.js import api
from nats.js.errors import NotFoundError

from conftest import router_settings, running_router
from feed_helpers import router_beside_blocking_stream, until
from kvhint.router.service.nats_link import (
    NatsLink,
    StreamLimits,
    outcomes_stream_name,
)
from kvhint.schemas import HintOutcome, OutcomeStatus, Subjects, encode_outcome

LINK_LOGGER = "kvhint.router.service.nats_link"
MiB = 1 << 20
# Small streams: JetStream reserves max_bytes on the shared server's disk.
SMALL = {"outcomes_max_bytes": 8 * MiB, "releases_max_bytes": 8 * MiB}

pytestmark = pytest.mark.usefixtures("throwaway_streams")


async def _link(url: str, subjects: Subjects, **limits: Any) -> NatsLink:
    link = NatsLink(url, subjects, on_error=lambda _kind: None, on_lost=lambda _count: None,
                    limits=StreamLimits(**{**SMALL, **limits}), retry_s=0.1)

    async def nothing() -> None:
        return None

    link.start(nothing)
    assert await link.wait_connected(10.0)
    return link


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == LINK_LOGGER and r.levelno == logging.WARNING]


async def test_an_existing_stream_gets_raised_limits_and_a_warning_for_the_rest(
        nats_url: str, subject_prefix: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LINK_LOGGER)
    subjects = Subjects(subject_prefix)
    # An older router made the streams with 8 MiB / 600 s.
    old = await _link(nats_url, subjects, events_max_bytes=8 * MiB, events_max_age_s=600)
    try:
        await old.ensure_streams()
    finally:
        await old.close()
    assert not _warnings(caplog)

    # The operator raised the settings: applied, and said.
    raised = await _link(nats_url, subjects, events_max_bytes=32 * MiB,
                         events_max_age_s=7200)
    try:
        checks = await raised.ensure_streams()
        info = await raised.js.stream_info(subjects.events_stream)
        # Without the fix: 8 MiB / 600 s kept, nothing logged.
        assert (info.config.max_bytes, info.config.max_age) == (32 * MiB, 7200)
        check = checks[subjects.events_stream]
        assert not check.created and set(check.applied) == {"max_bytes", "max_age"}
        assert check.kept == () and check.config.max_age == 7200
        [warning] = _warnings(caplog)
        assert subjects.events_stream in warning
        assert "max_bytes" in warning and "max_age" in warning and "applied" in warning
    finally:
        await raised.close()

    # Lower settings are not applied (that would delete history others replay), only
    # warned about, field by field; other subjects (an operator's stream) likewise.
    nc = await nats.connect(nats_url)
    try:
        js = nc.jetstream()
        outcomes = outcomes_stream_name(subjects)
        await js.delete_stream(outcomes)
        await js.add_stream(api.StreamConfig(
            name=outcomes, subjects=[f"{subject_prefix}.v1.outcomes.>"],
            storage=api.StorageType.FILE, max_bytes=8 * MiB, max_age=24 * 3600))
        caplog.clear()
        lower = await _link(nats_url, subjects, events_max_bytes=4 * MiB,
                            events_max_age_s=300)
        try:
            checks = await lower.ensure_streams()
        finally:
            await lower.close()
        info = await js.stream_info(subjects.events_stream)
        assert (info.config.max_bytes, info.config.max_age) == (32 * MiB, 7200)
        assert set(checks[subjects.events_stream].kept) == {"max_bytes", "max_age"}
        assert checks[subjects.events_stream].applied == ()
        assert checks[outcomes].kept == ("subjects",)
        assert (await js.stream_info(outcomes)).config.subjects == \
            [f"{subject_prefix}.v1.outcomes.>"]
        warnings = _warnings(caplog)
        assert len(warnings) == 2
        events_warning = next(w for w in warnings if subjects.events_stream in w)
        assert "max_bytes" in events_warning and "max_age" in events_warning
        assert "kept" in events_warning
        assert any(outcomes in w and "subjects" in w for w in warnings)
    finally:
        await nc.drain()


class _OtherCreatesFirst:
    """A JetStream context whose first lookup of a missing stream lets ``other`` run
    before it answers NotFound: another router creating the stream between this one's
    lookup and its create (the race, on cue; everything else is the real server)."""

    def __init__(self, js: Any, other: Callable[[], Awaitable[Any]]) -> None:
        self._js = js
        self._other: Callable[[], Awaitable[Any]] | None = other

    def __getattr__(self, name: str) -> Any:
        return getattr(self._js, name)

    async def stream_info(self, name: str, *args: Any, **kwargs: Any) -> Any:
        try:
            return await self._js.stream_info(name, *args, **kwargs)
        except NotFoundError:
            other, self._other = self._other, None
            if other is not None:
                await other()
            raise


async def test_a_create_that_loses_the_race_uses_the_stream_that_won(
        nats_url: str, subject_prefix: str) -> None:
    subjects = Subjects(subject_prefix)
    winner = await _link(nats_url, subjects, events_max_bytes=8 * MiB)
    loser = await _link(nats_url, subjects, events_max_bytes=16 * MiB)
    try:
        loser._js = _OtherCreatesFirst(loser.js, winner.ensure_streams)  # type: ignore
        # Without the fix: BadRequestError err_code 10058 (the router then ran without
        # replay for good).
        checks = await loser.ensure_streams()
        check = checks[subjects.events_stream]
        assert not check.created and check.applied == ("max_bytes",)
        info = await winner.js.stream_info(subjects.events_stream)
        assert info.config.max_bytes == 16 * MiB
    finally:
        await winner.close()
        await loser.close()


def _drops(runtime: Any, what: str) -> float:
    return runtime.metrics.drops.labels(what)._value.get()


def _foreign_outcomes(runtime: Any) -> float:
    return runtime.metrics.foreign_messages.labels("outcome")._value.get()


async def test_a_failed_jetstream_set_up_is_retried_until_replay_works(
        tmp_path: Path, nats_url: str, subject_prefix: str) -> None:
    """A stream of another name holding the outcomes subjects makes the router's create
    fail: it runs on plain subscriptions, and once that stream is gone the next tries
    set JetStream up (the cursor moves again) without handling a message twice."""
    subjects = Subjects(subject_prefix)
    async with router_beside_blocking_stream(tmp_path, nats_url, subject_prefix,
                                             "outcomes") as (router, nc, js, blocker):
        runtime = router.runtime
        await until(lambda: runtime.feed is not None
                    and _drops(runtime, "jetstream_unavailable") >= 1)
        feed = runtime.feed
        assert not feed.replay
        error = getattr(feed, "jetstream_error", None)
        await js.delete_stream(blocker)
        # Without the fix replay stays off for the router's whole life.
        await until(lambda: feed.replay, timeout_s=15.0)
        assert error and "10065" in error  # why it failed, told until it works
        assert feed.jetstream_error == ""
        outcome = HintOutcome(message_id="m", action_id="nobody's", action_type="kv.pin",
                              worker_id="w0", status=OutcomeStatus.ACCEPTED, at=0.0)
        await nc.publish(subjects.outcomes("w0"), encode_outcome(outcome))
        last = await js.stream_info(outcomes_stream_name(subjects))
        await until(lambda: feed.outcomes.seq == last.state.last_seq)
        await until(lambda: _foreign_outcomes(runtime) >= 1)
        # Handled once: the plain subscription was drained, not kept beside.
        await nc.flush()
        await asyncio.sleep(0.5)
        assert _foreign_outcomes(runtime) == 1


async def test_dead_workers_are_remembered_as_long_as_the_events_stream_keeps_them(
        tmp_path: Path, nats_url: str, subject_prefix: str) -> None:
    """The events stream keeps messages 7200 s (made so before); the settings say 600 s,
    which is not applied (lower) and is counted: the ingestor follows the stream."""
    subjects = Subjects(subject_prefix)
    maker = await _link(nats_url, subjects, events_max_bytes=8 * MiB, events_max_age_s=7200)
    try:
        await maker.ensure_streams()
    finally:
        await maker.close()
    settings = router_settings(tmp_path, [], nats_url=nats_url, subject_prefix=subject_prefix,
                               events_stream_max_age_s=600)
    async with running_router(settings) as router:
        runtime = router.runtime
        await until(lambda: runtime.feed is not None and bool(runtime.link.streams))
        assert runtime.feed.replay
        # Without the fix: max(3600, 600) from the settings.
        assert runtime.ingestor.config.forget_dead_after_s == 7200
        assert _drops(runtime, "stream_setting_not_applied") == 1
