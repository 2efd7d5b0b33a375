"""How the cluster feed takes its messages: JetStream consumers, their cursors, and
plain subscriptions while JetStream fails.

:class:`FeedJetStream` is a part of :class:`~kvhint.router.service.cluster_feed.ClusterFeed`
(a mixin, split from it along this seam: the feed says what each message means; this
sets up and keeps up where the messages come from). Its contract:

- :meth:`FeedJetStream.on_connected` (once per (re)established link): the heartbeats'
  plain subscription, then the events stream from its start and the outcomes and releases
  streams from their :class:`StreamCursor` (the store's ``cursors`` table: a fresh store
  from new messages, a restart after the last handled), all or nothing;
- where JetStream fails at set-up (disabled, out of storage, a stream of another name
  holding the subjects) events, outcomes and releases flow on plain subscriptions
  meanwhile (``replay`` False, counted as ``drops{what="jetstream_unavailable"}`` per
  failed try) and the feed's ``tick`` calls :meth:`FeedJetStream._retry_jetstream`
  with backoff until it works; then the consumers take over from the streams' ends and
  the plain subscriptions are drained;
- a stream deleted (an operator, a NATS server restarted without its store) is made again
  and its consumer started over on the new stream (stream_watch.py, from ``tick``), as is
  one whose stored cursor lies past its end; after nats-py reconnects
  (:meth:`FeedJetStream.on_reconnected`), each consumer starts over at once from the
  message after the last it handled.

Contract with the feed: it owns the fields annotated below (``ClusterFeed.__init__`` sets
them) and the message handlers, ``_perform`` and ``_spawn``. It logs under the feed's
logger, as before the split.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import Error as NatsError

from kvhint.router.kv_index import IngestAction, KvEventIngestor
from kvhint.router.service.metrics import RouterMetrics
from kvhint.router.service.nats_link import (
    NatsLink,
    StreamCheck,
    outcomes_stream_name,
    releases_stream_name,
)
from kvhint.router.service.stream_watch import StreamWatch, WatchedConsumer
from kvhint.router.store.writer import StoreWriter
from kvhint.schemas import Subjects

# The feed's logger: these messages were the feed's before the split (log filters).
log = logging.getLogger("kvhint.router.service.cluster_feed")

OUTCOMES_CURSOR = "outcomes_stream_seq"
RELEASES_CURSOR = "releases_stream_seq"

# Backoff of JetStream set-up retries after a failure (first, then doubled up to the cap).
JETSTREAM_RETRY_S = 2.0
JETSTREAM_RETRY_MAX_S = 60.0


def stream_metadata(msg: Msg) -> Msg.Metadata | None:
    """A JetStream delivery's metadata; None for a plain subscription's message (nats-py
    raises on ``msg.metadata`` without a JetStream ack subject)."""
    if not (msg.reply or "").startswith("$JS.ACK."):
        return None
    return msg.metadata


class StreamCursor:
    """Where a replayed stream's consumer stands, kept in the store's ``cursors`` table:
    a fresh store starts at new messages; a restart resumes after the last one handled;
    a link set up again after a failure resumes, it does not replay."""

    def __init__(self, name: str, last_seq: int | None, writer: StoreWriter | None,
                 wall: Callable[[], float]) -> None:
        self.name = name
        # The last stream sequence handled (the store's cursor); None: start at new messages.
        self.seq = last_seq or None
        self._writer = writer
        self._wall = wall

    def start_seq(self) -> int | None:
        return None if self.seq is None else self.seq + 1

    def handled(self, msg: Msg) -> None:
        metadata = stream_metadata(msg)
        if metadata is None:
            return
        self.seq = metadata.sequence.stream
        if self._writer is not None:
            self._writer.upsert("cursors", (self.name,), {
                "name": self.name, "value": self.seq, "updated_at": self._wall()})


class FeedJetStream:
    """The JetStream set-up, retry and stream-remade side of a
    :class:`~kvhint.router.service.cluster_feed.ClusterFeed`."""

    # Set by ClusterFeed.__init__ (declared here for the methods below; no class values).
    _link: NatsLink
    _subjects: Subjects
    ingestor: KvEventIngestor
    _metrics: RouterMetrics
    _perform: Callable[[list[IngestAction]], None]
    outcomes: StreamCursor
    releases: StreamCursor
    replay: bool
    jetstream_error: str
    _plain: list[Subscription]
    _retry_first_s: float
    _retry_delay_s: float
    _retry_at: float
    _retrying: bool
    streams: StreamWatch

    # The feed's (what the messages mean; its tasks).
    async def _on_status(self, msg: Msg) -> None:
        raise NotImplementedError

    async def _on_events(self, msg: Msg) -> None:
        raise NotImplementedError

    async def _on_outcome(self, msg: Msg) -> None:
        raise NotImplementedError

    async def _on_releases(self, msg: Msg) -> None:
        raise NotImplementedError

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        raise NotImplementedError

    async def on_connected(self) -> None:
        """Streams and subscriptions; NatsLink calls this once per (re)established link
        (nats-py's own reconnects keep the subscriptions and do not call it)."""
        subjects = self._subjects
        # Before the heartbeats: one heard ahead of its worker's replayed batches waits.
        self.ingestor.replay_started()
        await self._link.subscribe(subjects.all_of("status"), self._on_status)
        self._plain = []
        try:
            await self._set_up_jetstream(events_start=1,
                                         outcomes_start=self.outcomes.start_seq(),
                                         releases_start=self.releases.start_seq())
        except (NatsError, asyncio.TimeoutError) as exc:
            self._perform(self.ingestor.replay_caught_up())  # no replay: nothing to wait for
            # No JetStream (disabled, out of storage, the subjects held by a stream of
            # another name): live messages still flow on plain subscriptions; what is
            # missed meanwhile is resynced from snapshots instead of replayed, and
            # outcomes sent while the router is down are lost. tick() tries again.
            self._jetstream_failed(exc)
            self._plain = [
                await self._link.subscribe(subjects.all_of("events"), self._on_events),
                await self._link.subscribe(subjects.all_of("outcomes"), self._on_outcome),
                await self._link.subscribe(subjects.all_of("releases"), self._on_releases)]
            return
        self.replay = True
        if not await self._events_history_exists():
            self._perform(self.ingestor.replay_caught_up())

    async def _events_history_exists(self) -> bool:
        """Whether the events stream held messages once its consumer was made: else no
        delivery will ever say the replay caught up. When it cannot be read, False: the
        waiting ends as it did before it existed (a heartbeat resyncs at once)."""
        try:
            info = await self._link.js.stream_info(self._subjects.events_stream)
        except (NatsError, asyncio.TimeoutError, RuntimeError) as exc:
            log.warning("events stream state unreadable (%r): not waiting for its replay",
                        exc)
            return False
        return info.state.messages > 0

    async def _set_up_jetstream(self, events_start: int | None, outcomes_start: int | None,
                                releases_start: int | None) -> None:
        """Streams, then one ordered consumer each; all or nothing (a consumer made before
        a later one failed is ended, so no subject is taken both ways for good)."""
        subjects = self._subjects
        checks = await self._link.ensure_streams()
        self._note_streams(checks)
        made: list[Subscription] = []
        watched: dict[str, WatchedConsumer] = {}
        try:
            for subject, stream, handler, start in (
                    (subjects.all_of("events"), subjects.events_stream, self._on_events,
                     events_start),
                    (subjects.all_of("outcomes"), outcomes_stream_name(subjects),
                     self._on_outcome, outcomes_start),
                    (subjects.all_of("releases"), releases_stream_name(subjects),
                     self._on_releases, releases_start)):
                info = await self._link.js.stream_info(stream)
                if start is not None and start > info.state.last_seq + 1:
                    # A stored cursor past the stream's end: one stream's sequences never
                    # go back, so this stream was made again since (an operator's delete,
                    # a NATS server restarted without its store) and all it holds is new.
                    # Before, the consumer asked for the old cursor's next sequence, which
                    # the server takes as the new stream's end: what it held was never read.
                    log.warning("JetStream stream %s ends at %d, before the stored cursor "
                                "%d: made again since; read from its start", stream,
                                info.state.last_seq, start - 1)
                    self._stream_remade(stream)
                    start = 1
                consumer = await self.streams.subscribe(subject, stream, handler, start,
                                                        info.state.last_seq, info.created)
                assert consumer.sub is not None
                made.append(consumer.sub)
                watched[stream] = consumer
        except (NatsError, asyncio.TimeoutError):
            for sub in made:
                try:
                    await self._link.unsubscribe(sub)
                except NatsError as cleanup:
                    # Left, it only duplicates what the plain subscription delivers
                    # (the ingestor and the dispatcher drop repeats, counted).
                    log.warning("ending a JetStream consumer after a failed set-up: %r",
                                cleanup)
            raise
        self.streams.follow(watched)

    def on_reconnected(self) -> None:
        """nats-py reconnected: the consumers start over now, not when nats-py misses
        their heartbeats (stream_watch.py). Plain subscriptions (no replay) need none."""
        if self.replay and self.streams.reconnected():
            self._spawn(self.streams.check())

    def _stream_remade(self, stream: str) -> None:
        """Count a stream found made again (stream_watch.py logged it) by what it holds."""
        kind = {self._subjects.events_stream: "events",
                outcomes_stream_name(self._subjects): "outcomes",
                releases_stream_name(self._subjects): "releases"}.get(stream)
        if kind is not None:  # the watch follows only these three
            self._metrics.streams_remade.labels(kind).inc()

    def _note_streams(self, checks: dict[str, StreamCheck]) -> None:
        """Count stream fields left unlike the settings (ensure_streams warned), and let
        the ingestor keep a dead worker as long as the events stream really keeps its
        messages (forget_dead_after_s came from the settings; the stream an operator or
        another router made may keep them longer)."""
        for check in checks.values():
            if check.kept:
                self._metrics.drop("stream_setting_not_applied", len(check.kept))
        events = checks.get(self._subjects.events_stream)
        max_age = events.config.max_age if events is not None else None
        config = self.ingestor.config
        # 0/None: no age limit (only max_bytes bounds it): no age to follow.
        if max_age and max_age > config.forget_dead_after_s:
            log.info("events stream keeps messages %.0fs: dead workers are forgotten after "
                     "that (not %.0fs)", max_age, config.forget_dead_after_s)
            self.ingestor.remember_dead_for(max_age)

    def _jetstream_failed(self, exc: BaseException) -> None:
        self._metrics.drop("jetstream_unavailable")
        # nats-py's API errors' repr() is empty ("BadRequestError()"); str() has the code.
        self.jetstream_error = f"{type(exc).__name__}: {exc}"
        self._retry_at = time.monotonic() + self._retry_delay_s
        if self.replay:
            log.error("JetStream unavailable (%s): events and outcomes without replay; "
                      "retrying every %.0f-%.0fs", self.jetstream_error, self._retry_first_s,
                      JETSTREAM_RETRY_MAX_S)
        else:
            log.warning("JetStream still unavailable (%s); next try in %.0fs",
                        self.jetstream_error, self._retry_delay_s)
        self._retry_delay_s = min(self._retry_delay_s * 2, JETSTREAM_RETRY_MAX_S)
        self.replay = False

    async def _retry_jetstream(self) -> None:
        """Hand the plain subscriptions over to JetStream consumers. Each consumer starts
        after the stream's last sequence read *before* it is made, and the plain
        subscriptions are drained only after: nothing published in between is lost; what
        was published in that one round trip may arrive twice (the ingestor drops repeated
        batches, the dispatcher repeated outcomes, both counted)."""
        try:
            try:
                await self._link.ensure_streams()
                starts = []
                for name in (self._subjects.events_stream,
                             outcomes_stream_name(self._subjects),
                             releases_stream_name(self._subjects)):
                    info = await self._link.js.stream_info(name)
                    starts.append(info.state.last_seq + 1)
                await self._set_up_jetstream(*starts)
            except (NatsError, asyncio.TimeoutError, RuntimeError) as exc:
                # RuntimeError: the link went down meanwhile ("NATS not connected").
                self._jetstream_failed(exc)
                return
            plain, self._plain = self._plain, []
            for sub in plain:
                try:
                    await self._link.unsubscribe(sub, drain=True)
                except NatsError as exc:
                    log.warning("draining a plain subscription after JetStream came back: "
                                "%r", exc)
            self.replay = True
            self.jetstream_error = ""
            self._retry_delay_s = self._retry_first_s
            log.info("JetStream set up: events, outcomes and releases replay again")
        finally:
            self._retrying = False
