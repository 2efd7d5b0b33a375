"""What the NATS transport sets up on its connection: the events stream (looked for
again every minute: :class:`EventsStreamWatch`), and a runner that lets ``stop`` cancel a
setup step.

The transport runs its setup (subscriptions, then :func:`ensure_events_stream`) inside its
publisher's protected loop: an exception there is counted and the setup retried after a
pause, as a failed publisher round is (before, one ended the transport thread for good),
and :func:`until_stopped` lets ``stop()`` cancel it midway (JetStream's ``stream_info``
waits up to 5 s for an answer, longer than ``stop()`` waits for the thread).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from typing import Any

from nats.errors import Error as NatsError
from nats.js.api import DiscardPolicy, StorageType, StreamConfig
from nats.js.errors import NotFoundError

from kvhint.engine_plugin.config import LOGGER_NAME, PluginConfig
from kvhint.engine_plugin.transport_counters import TransportCounters, note_internal_error
from kvhint.schemas import Subjects

logger = logging.getLogger(LOGGER_NAME)

# How often the transport looks again whether the events stream exists (EventsStreamWatch).
EVENTS_STREAM_CHECK_S = 60.0


async def until_stopped(stop: asyncio.Event, step: Awaitable[Any]) -> bool:
    """Await ``step``; True when it finished (its exception is raised), False when
    ``stop`` was set first: ``step`` is then cancelled, and awaited to its end."""
    task = asyncio.ensure_future(step)
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)  # its CancelledError
    if task.cancelled():
        return False
    task.result()
    return True


async def ensure_events_stream(nc: Any, config: PluginConfig, subjects: Subjects,
                               counters: TransportCounters, warn: bool = True) -> bool:
    """Whether the events stream exists now (its batches are kept for replay), created
    when missing and ``create_events_stream`` is on (the router creates the same one).
    NATS not answering and a failed create are counted, and the events go out as plain
    NATS messages; each is logged at WARNING, at DEBUG without ``warn`` (the watch's
    repeats of a failure already reported)."""
    level = logging.WARNING if warn else logging.DEBUG
    js = nc.jetstream()
    name = subjects.events_stream
    try:
        await js.stream_info(name)
        return True
    except NotFoundError:
        pass
    except (NatsError, asyncio.TimeoutError) as exc:
        counters.jetstream_unavailable += 1
        logger.log(level, "kvhint: JetStream not available (%s); events go out as plain "
                   "NATS messages, not kept for replay", exc)
        return False
    if not config.create_events_stream:
        logger.log(level, "kvhint: no stream %s, and create_events_stream is off: events go "
                   "out as plain NATS messages, kept once the router creates it", name)
        return False
    try:
        await js.add_stream(StreamConfig(
            name=name, subjects=[subjects.all_of("events")],
            storage=StorageType.FILE, max_age=config.events_stream_max_age_s,
            max_bytes=config.events_stream_max_bytes, discard=DiscardPolicy.OLD))
        logger.info("kvhint: created JetStream stream %s", name)
        return True
    except (NatsError, asyncio.TimeoutError) as exc:
        create_error: BaseException = exc
    # The router (or another worker) may have created it between our lookup and our
    # create: JetStream answers 10058 ("already in use with a different
    # configuration") when its limits differ from ours. The stream exists then, and
    # is the one to use (its owner's limits stand; the router reconciles them).
    try:
        await js.stream_info(name)
    except (NatsError, asyncio.TimeoutError):
        counters.stream_create_failures += 1
        logger.log(level, "kvhint: could not create stream %s: %s; events go out as plain "
                   "NATS messages (captured once the router creates it)", name, create_error)
        return False
    logger.info("kvhint: JetStream stream %s was created meanwhile by the router or "
                "another worker (%s): using it", name, create_error)
    return True


class EventsStreamWatch:
    """Whether the events stream existed at the latest look (``kept``: the gauge
    ``kvhint:events_kept``), and the task that looks again every ``every_s``, and soon
    after a reconnect, while the transport's loop runs. Before, the plugin looked at
    set-up only: one failure there read as events not kept until the engine restarted
    (a stream the router made later captured them unseen), and a stream deleted later
    went unnoticed. A missing stream is created again (``create_events_stream``)."""

    def __init__(self, config: PluginConfig, subjects: Subjects, counters: TransportCounters,
                 every_s: float | None = None) -> None:
        self.config, self.subjects, self.counters = config, subjects, counters
        self.every_s = EVENTS_STREAM_CHECK_S if every_s is None else every_s
        self.kept = False
        self._task: asyncio.Future[None] | None = None
        self._due: asyncio.Event | None = None

    def start(self, nc: Any) -> None:
        """Look again from now on (the transport's loop; a running watch is kept)."""
        if self._task is None or self._task.done():
            self._due = asyncio.Event()
            self._task = asyncio.ensure_future(self._run(nc, self._due))

    def check_soon(self) -> None:
        """Look again at once (after a reconnect: a restarted NATS may have lost it)."""
        if self._due is not None:
            self._due.set()

    async def cancel(self) -> None:
        task, self._task = self._task, None
        if task is not None and not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)  # its CancelledError

    async def _run(self, nc: Any, due: asyncio.Event) -> None:
        while True:
            try:
                await asyncio.wait_for(due.wait(), timeout=self.every_s)
            except asyncio.TimeoutError:
                pass
            due.clear()
            if not nc.is_connected:  # nothing is published meanwhile; looked at after
                continue
            try:
                kept = await ensure_events_stream(nc, self.config, self.subjects,
                                                  self.counters, warn=self.kept)
            except Exception:  # a bug: counted and logged; looked at again later
                note_internal_error(self.counters, "unexpected error looking for the events "
                                    "stream; looked for again later")
                continue
            if kept and not self.kept:
                logger.info("kvhint: stream %s found: event batches are kept for replay",
                            self.subjects.events_stream)
            self.kept = kept
