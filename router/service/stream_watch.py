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

A NATS server restarted with its store keeps the streams, but not the consumers behind
the subscriptions nats-py's reconnect makes again: nothing came until nats-py missed two
idle heartbeats and made each consumer again (~19 s measured; meanwhile a worker's
heartbeats naming batches not yet read were tail gaps, resyncs). So on each reconnect
(:meth:`StreamWatch.reconnected`, from ``NatsLink.on_reconnected``) every consumer starts
over at once from the message after the last one it handled (each delivery moves
:attr:`WatchedConsumer.next_seq` before its handler runs): nothing skipped, nothing read
twice. One that fails (JetStream still starting) is tried again at the next tick.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from nats.aio.msg import Msg
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
    """A stream's consumer: the ``created`` of the stream it was made on, and the first
    stream sequence it has not handled (where it starts over after a reconnect)."""

    subject: str
    handler: Handler
    created: datetime.datetime | None
    next_seq: int
    sub: Subscription | None = None
    # Started over (from next_seq) at the next check: nats-py reconnected, or a start
    # over failed half way (the old consumer ended, no new one yet).
    resume: bool = False

    async def deliver(self, msg: Msg) -> None:
        """The subscription's callback: the message counts as handled once its handler
        starts (the feed's handlers do not await: a subscription ended meanwhile cannot
        cut one short), so a start over never reads it again."""
        if (msg.reply or "").startswith("$JS.ACK."):
            self.next_seq = msg.metadata.sequence.stream + 1
        await self.handler(msg)


class StreamWatch:
    """See the module doc. Single event loop; ``clock`` is monotonic seconds."""

    def __init__(self, link: NatsLink, every_s: float = STREAM_CHECK_S,
                 clock: Callable[[], float] = time.monotonic,
                 on_remade: Callable[[str], None] | None = None) -> None:
        self._link = link
        # Told the stream's name once its consumer started over on it made again (the
        # feed counts it: kvhint_router_streams_remade_total).
        self._on_remade = on_remade
        self.every_s = every_s
        self._clock = clock
        self._consumers: dict[str, WatchedConsumer] = {}
        self._looked_at = clock()
        self._checking = False
        # One check at a time (a tick's and a reconnect's may overlap).
        self._lock = asyncio.Lock()
        # Consumers started over on a stream made again (a log line says which).
        self.restarted = 0
        # Consumers started over after a reconnect, from their next sequence.
        self.resumed = 0

    async def created(self, stream: str) -> datetime.datetime | None:
        """The stream's identity now (read before its consumer is made)."""
        return (await self._link.js.stream_info(stream)).created

    async def subscribe(self, subject: str, stream: str, handler: Handler,
                        start_seq: int | None, last_seq: int,
                        created: datetime.datetime | None) -> WatchedConsumer:
        """``NatsLink.subscribe_stream`` from ``start_seq``, its deliveries followed
        (``last_seq``: the stream's last sequence, read before: where a consumer of new
        messages only, ``start_seq`` None, starts)."""
        consumer = WatchedConsumer(subject, handler, created,
                                   last_seq + 1 if start_seq is None else max(start_seq, 1))
        consumer.sub = await self._link.subscribe_stream(subject, stream, consumer.deliver,
                                                         start_seq=start_seq)
        return consumer

    def follow(self, consumers: dict[str, WatchedConsumer]) -> None:
        """The consumers a JetStream set-up made, by stream name (replacing any before)."""
        self._consumers = dict(consumers)

    def reconnected(self) -> bool:
        """nats-py reconnected: every consumer starts over from its next sequence at the
        next :meth:`check`, which the caller runs now where this returns True."""
        for consumer in self._consumers.values():
            consumer.resume = True
        return bool(self._consumers)

    def due(self) -> bool:
        """Whether a look is due now (none running); the caller then runs :meth:`check`.
        A start over still to do (a failed one) is due at once."""
        now = self._clock()
        if self._checking or not self._consumers:
            return False
        if (now - self._looked_at < self.every_s
                and not any(c.resume for c in self._consumers.values())):
            return False
        self._checking = True
        self._looked_at = now
        return True

    async def check(self) -> None:
        """Look at each stream; start a consumer over where its stream was made again
        (from its start) or nats-py reconnected (from its next sequence). NATS failing
        here is logged and tried again at the next look."""
        try:
            async with self._lock:
                await self._look()
        except (NatsError, asyncio.TimeoutError, RuntimeError) as exc:
            # RuntimeError: the link went down meanwhile ("NATS not connected").
            log.warning("looking at the JetStream streams failed: %r; trying again in %.0fs",
                        exc, self.every_s)
        finally:
            self._checking = False

    async def _look(self) -> None:
        made_again = False
        for name, consumer in list(self._consumers.items()):
            if self._consumers.get(name) is not consumer:
                continue  # a set-up since followed another (a new link's)
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
            if created != consumer.created:
                log.warning("JetStream stream %s was made again (created %s, was %s): its "
                            "consumer starts over from the new stream's first message", name,
                            created, consumer.created)
                await self._start_over(name, consumer, created, from_start=True)
                self.restarted += 1
                if self._on_remade is not None:
                    self._on_remade(name)
            elif consumer.resume:
                await self._start_over(name, consumer, created)
                log.info("NATS reconnected: the consumer of JetStream stream %s resumed at "
                         "sequence %d", name, consumer.next_seq)
                self.resumed += 1

    async def _start_over(self, name: str, consumer: WatchedConsumer,
                          created: datetime.datetime | None, from_start: bool = False
                          ) -> None:
        """End ``consumer``'s subscription, then make one from its ``next_seq`` (read
        after the end: nothing is delivered to the old one in between), or from the
        stream's first message (``from_start``: a stream made again). Where making it
        fails, ``resume`` stays set (and ``created`` the old one): the next look tries
        again."""
        consumer.resume = True
        old, consumer.sub = consumer.sub, None
        if old is not None:
            try:
                await self._link.unsubscribe(old)
            except NatsError as exc:  # the old consumer went with its stream: nothing to end
                log.info("ending the old consumer of stream %s: %r", name, exc)
        if from_start:
            consumer.next_seq = 1
        consumer.sub = await self._link.subscribe_stream(
            consumer.subject, name, consumer.deliver, start_seq=consumer.next_seq)
        consumer.created = created
        consumer.resume = False
