"""What the NATS transport sets up on its connection: the events stream, and a runner
that lets ``stop`` cancel a setup step.

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
from kvhint.engine_plugin.transport_counters import TransportCounters
from kvhint.schemas import Subjects

logger = logging.getLogger(LOGGER_NAME)


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
                               counters: TransportCounters) -> None:
    """Create the events stream when missing (the router creates the same one). NATS
    not answering is counted, and the events go out as plain NATS messages."""
    if not config.create_events_stream:
        return
    js = nc.jetstream()
    name = subjects.events_stream
    try:
        await js.stream_info(name)
        return
    except NotFoundError:
        pass
    except (NatsError, asyncio.TimeoutError) as exc:
        counters.jetstream_unavailable += 1
        logger.warning("kvhint: JetStream not available (%s); events go out as plain "
                       "NATS messages", exc)
        return
    try:
        await js.add_stream(StreamConfig(
            name=name, subjects=[subjects.all_of("events")],
            storage=StorageType.FILE, max_age=config.events_stream_max_age_s,
            max_bytes=config.events_stream_max_bytes, discard=DiscardPolicy.OLD))
        logger.info("kvhint: created JetStream stream %s", name)
        return
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
        logger.warning("kvhint: could not create stream %s: %s; events go out as plain "
                       "NATS messages (captured once the router creates it)", name,
                       create_error)
        return
    logger.info("kvhint: JetStream stream %s was created meanwhile by the router or "
                "another worker (%s): using it", name, create_error)
