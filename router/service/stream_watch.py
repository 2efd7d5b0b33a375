"""The replayed streams' consumers, watched for their stream being made again.

A JetStream stream deleted (an operator, a NATS server restarted without its store) and
made again numbers its messages from 1 again. nats-py's ordered consumer, its consumer gone
with the old stream, makes a new one two idle heartbeats (10 s) later that starts after
the *old* stream's last sequence, which the server takes as the new stream's end: every
message the new stream took before was skipped (event batches: a gap, a resync; outcomes
and releases: lost for good). A stream nobody makes again (the outcomes and releases
streams, which only the router makes; the events stream without a plugin's
``create_events_stream``) was not read again until the router restarted: outcomes and
releases lost, and every worker's heartbeat a tail gap, a resync from a snapshot (a copy
of the engine's index on its scheduler thread), again and again.

:class:`StreamWatch` keeps each consumer with the identity (``created``) of the stream it
was made on, and every ``every_s`` looks again: a stream gone is made again
(``NatsLink.ensure_streams``), and a consumer whose stream is no longer the one it was made
on starts over on the new one, from its first message (all of it came after the old one
was lost). What was published while no stream held it is lost; the event ingestor sees
the hole as a sequence gap and resyncs (counted there). Looked at more often than nats-py
resets its consumer, the watch mostly comes first; where nats-py's consumer read some of
the new stream before, those messages come again: batches are dropped as duplicates,
outcomes as ``outcome_duplicate`` (both counted), a release sets what is left once more.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from nats.aio.subscription import Subscription
from nats.errors import Error as NatsError
from nats.js.errors import NotFoundError

from kvhint.router.service.nats_link import Handler, NatsLink

log = logging.getLogger(__name__)

# How often the streams are looked at (one stream_info round trip each): before nats-py's
# own reset of an ordered consumer whose stream went (two idle heartbeats of 5 s).
STREAM_CHECK_S = 5.0


@dataclass(slots=True)
class WatchedConsumer:
    """A stream's consumer, and the ``created`` of the stream it was made on."""

    subject: str
    handler: Handler
    sub: Subscription
    created: datetime.datetime | None


class StreamWatch:
    """See the module doc. Single event loop; ``clock`` is monotonic seconds."""

    def __init__(self, link: NatsLink, every_s: float = STREAM_CHECK_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._link = link
        self.every_s = every_s
        self._clock = clock
        self._consumers: dict[str, WatchedConsumer] = {}
        self._looked_at = clock()
        self._checking = False
        # Consumers started over on a stream made again (a log line says which).
        self.restarted = 0

    async def created(self, stream: str) -> datetime.datetime | None:
        """The stream's identity now (read before its consumer is made)."""
        return (await self._link.js.stream_info(stream)).created

    def follow(self, consumers: dict[str, WatchedConsumer]) -> None:
        """The consumers a JetStream set-up made, by stream name (replacing any before)."""
        self._consumers = dict(consumers)

    def due(self) -> bool:
        """Whether a look is due now (none running); the caller then runs :meth:`check`."""
        now = self._clock()
        if self._checking or not self._consumers or now - self._looked_at < self.every_s:
            return False
        self._checking = True
        self._looked_at = now
        return True

    async def check(self) -> None:
        """Look at each stream; start a consumer over where its stream was made again.
        NATS failing here is logged and tried again at the next look."""
        try:
            made_again = False
            for name, consumer in list(self._consumers.items()):
                try:
                    created = await self.created(name)
                except NotFoundError:
                    if made_again:
                        continue  # ensure_streams could not make it: next look
                    # Gone: made again now, so what is published from now on is kept.
                    made_again = True
                    await self._link.ensure_streams()
                    try:
                        created = await self.created(name)
                    except NotFoundError:
                        continue
                if created == consumer.created:
                    continue
                await self._start_over(name, consumer, created)
        except (NatsError, asyncio.TimeoutError, RuntimeError) as exc:
            # RuntimeError: the link went down meanwhile ("NATS not connected").
            log.warning("looking at the JetStream streams failed: %r; trying again in %.0fs",
                        exc, self.every_s)
        finally:
            self._checking = False

    async def _start_over(self, name: str, consumer: WatchedConsumer,
                          created: datetime.datetime | None) -> None:
        log.warning("JetStream stream %s was made again (created %s, was %s): its consumer "
                    "starts over from the new stream's first message", name, created,
                    consumer.created)
        try:
            await self._link.unsubscribe(consumer.sub)
        except NatsError as exc:  # the old consumer went with its stream: nothing to end
            log.info("ending the consumer of the old stream %s: %r", name, exc)
        sub = await self._link.subscribe_stream(consumer.subject, name, consumer.handler,
                                                start_seq=1)
        self._consumers[name] = WatchedConsumer(consumer.subject, consumer.handler, sub,
                                                created)
        self.restarted += 1
