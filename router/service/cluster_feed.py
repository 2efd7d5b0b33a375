"""NATS -> cluster KV index, worker registry and hint outcomes.

- ``<prefix>.v1.events.*``: a JetStream ordered consumer over the events stream from its
  start (replay rebuilds the index; where the stream no longer reaches back to a worker's
  ``seq`` 1, the ingestor asks for a snapshot instead);
- ``<prefix>.v1.status.*``: heartbeats (worker registry + stream liveness);
- ``<prefix>.v1.outcomes.*``: a JetStream ordered consumer from the last stream sequence
  the store recorded (a fresh store: from now on), so outcomes published while the router
  was down still land; each goes to the hint dispatcher, then (with the action it
  answers) to ``on_hint_outcome`` (the session lifecycle: what the session holds);
- ``<prefix>.v1.releases.*``: blocks workers let go of accepted Pins/Retains unasked, to
  the hint dispatcher (holdings) and ``on_hold_released`` (the session's protection);
  like outcomes, a JetStream ordered consumer from the store's cursor, so the holdings a
  restarted router rebuilds from the store shrink by what was released while it was down;
- snapshots: request/reply on ``<prefix>.v1.snapshot.<w>``, page by page, whenever the
  ingestor asks (gap, epoch change, joined mid-stream, missed tail): index_actions.py.

Heartbeats flow at once, the events replay takes a while (up to the stream's hour / GiB):
the ingestor is told the replay runs (``replay_started``, before heartbeats are taken) and
when it is over (``replay_caught_up``: a delivery with ``num_pending`` 0, an events stream
empty when the consumer was made, or JetStream failing and no replay at all), so a worker
heard before its replayed batches waits for them instead of taking a snapshot.

Where JetStream fails at set-up (disabled, out of storage, a stream of another name
holding the subjects) events, outcomes and releases flow on plain subscriptions meanwhile
(``replay`` False, counted as ``drops{what="jetstream_unavailable"}`` per failed try) and
:meth:`ClusterFeed.tick` tries again with backoff until it works; then the consumers take
over from the streams' ends and the plain subscriptions are drained.

A stream deleted (an operator, a NATS server restarted without its store) is made again
and its consumer started over on the new stream (stream_watch.py, from :meth:`tick`); after
nats-py reconnects, each consumer starts over at once from the message after the last it
handled.

The ingestor (``kvhint.router.kv_index``) decides; index_actions.py performs its actions.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import msgspec
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import Error as NatsError

from kvhint.router.kv_index import KvEventIngestor
from kvhint.router.service.hint_dispatch import HintDispatcher, SentAction
from kvhint.router.service.hint_records import MAX_STORED_AMOUNT, clamped_amounts
from kvhint.router.service.index_actions import IndexActions
from kvhint.router.service.log_throttle import PerKeyLogThrottle
from kvhint.router.service.metrics import RouterMetrics
from kvhint.router.service.nats_link import (
    NatsLink,
    StreamCheck,
    outcomes_stream_name,
    releases_stream_name,
)
from kvhint.router.service.stream_watch import StreamWatch, WatchedConsumer
from kvhint.router.service.task_set import TaskSet
from kvhint.router.service.worker_urls import HeartbeatUrlPolicy
from kvhint.router.service.workers import HeartbeatVerdict, WorkerRegistry
from kvhint.router.store.writer import StoreWriter
from kvhint.schemas import (
    WireDecodeError,
    HintOutcome,
    HoldRelease,
    WorkerStatus,
    decode_outcome,
    decode_releases,
    decode_status,
    is_unknown_status,
)

log = logging.getLogger(__name__)
# What a payload decoder reads (:meth:`ClusterFeed._decoded`).
_Decoded = TypeVar("_Decoded")

OUTCOMES_CURSOR = "outcomes_stream_seq"
RELEASES_CURSOR = "releases_stream_seq"

# Backoff of JetStream set-up retries after a failure (first, then doubled up to the cap).
JETSTREAM_RETRY_S = 2.0
JETSTREAM_RETRY_MAX_S = 60.0


def _stream_metadata(msg: Msg) -> Msg.Metadata | None:
    """A JetStream delivery's metadata; None for a plain subscription's message (nats-py
    raises on ``msg.metadata`` without a JetStream ack subject)."""
    if not (msg.reply or "").startswith("$JS.ACK."):
        return None
    return msg.metadata


class _StreamCursor:
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
        metadata = _stream_metadata(msg)
        if metadata is None:
            return
        self.seq = metadata.sequence.stream
        if self._writer is not None:
            self._writer.upsert("cursors", (self.name,), {
                "name": self.name, "value": self.seq, "updated_at": self._wall()})


class ClusterFeed:
    def __init__(self, link: NatsLink, ingestor: KvEventIngestor, workers: WorkerRegistry,
                 hints: HintDispatcher, metrics: RouterMetrics, writer: StoreWriter | None,
                 outcomes_last_seq: int | None, releases_last_seq: int | None,
                 snapshot_timeout_s: float,
                 on_hint_outcome: Callable[[SentAction, HintOutcome], None],
                 on_hold_released: Callable[[HoldRelease], None],
                 on_worker_forgotten: Callable[[str], None] | None = None,
                 wall_clock: Callable[[], float] = time.time,
                 jetstream_retry_s: float = JETSTREAM_RETRY_S,
                 url_policy: HeartbeatUrlPolicy = HeartbeatUrlPolicy(),
                 tasks: TaskSet | None = None) -> None:
        self._link = link
        self._subjects = link.subjects
        self.ingestor = ingestor
        self._workers = workers
        self._hints = hints
        self._on_hint_outcome = on_hint_outcome
        self._on_hold_released = on_hold_released
        # A worker forgotten (silent past forget_dead_after_s): what others keep of it goes.
        self._on_worker_forgotten = on_worker_forgotten
        self._metrics = metrics
        self._writer = writer
        self._wall = wall_clock
        # Its snapshot requests, JetStream retries and stream checks: the runtime's
        # (task_set.py), ended at its stop.
        self._tasks = tasks if tasks is not None else TaskSet()
        # What the ingestor decides, done (snapshot requests are tasks of this feed's).
        self._perform = IndexActions(link, ingestor, workers, metrics, snapshot_timeout_s,
                                     self._spawn).perform
        # Which http_url a heartbeat may give a worker not configured (worker_urls.py),
        # and the URL last refused per worker (logged once; dropped when it is forgotten).
        self._url_policy = url_policy
        self._refused_urls: dict[str, str] = {}
        # Malformed heartbeats (one a second; each counted) logged per subject, throttled.
        self.malformed_status_log = PerKeyLogThrottle()
        self.outcomes = _StreamCursor(OUTCOMES_CURSOR, outcomes_last_seq, writer, wall_clock)
        self.releases = _StreamCursor(RELEASES_CURSOR, releases_last_seq, writer, wall_clock)
        # False while JetStream set-up fails and the feed runs on plain subscriptions;
        # tick() retries it (jetstream_error says why it last failed).
        self.replay = True
        self.jetstream_error = ""
        self._plain: list[Subscription] = []
        self._retry_first_s = jetstream_retry_s
        self._retry_delay_s = jetstream_retry_s
        self._retry_at = 0.0
        self._retrying = False
        # The consumers, watched for their stream being made again, and started over
        # from their next message once nats-py reconnects (stream_watch.py; the runtime
        # puts :meth:`on_reconnected` on the link's ``on_reconnected``).
        self.streams = StreamWatch(link, on_remade=self._stream_remade)

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

    # --- messages -----------------------------------------------------------------------

    async def _on_events(self, msg: Msg) -> None:
        # The batch's age (JetStream's publish timestamp; None on a plain subscription,
        # which delivers live messages only): a batch replayed from the stream's history
        # is applied, but the ingestor takes no such one as proof its worker is alive now
        # (before, a dead worker's replay made it look alive). Clock skew between the NATS
        # server and this host shifts it; heartbeats (never replayed) prove life anyway.
        age_s = None
        metadata = _stream_metadata(msg)
        if metadata is not None and metadata.timestamp is not None:
            age_s = max(self._wall() - metadata.timestamp.timestamp(), 0.0)
            self._metrics.event_lag.observe(age_s)
        actions = self.ingestor.on_event_message(msg.headers, msg.data, subject=msg.subject,
                                                 age_s=age_s)
        self._perform(actions)
        if metadata is not None and metadata.num_pending == 0 and self.ingestor.replaying:
            # The consumer reached the stream's end: workers still waiting got nothing
            # from the replay and resync now (after this batch, which may be theirs).
            self._perform(self.ingestor.replay_caught_up())

    async def _on_status(self, msg: Msg) -> None:
        try:
            status = decode_status(msg.data)
        except WireDecodeError as exc:
            self.ingestor.note_malformed()
            held = self.malformed_status_log.admit(msg.subject)
            if held is not None:
                # repr'd as in _decoded (msgspec quotes the sender's text); once only counted.
                log.warning("malformed heartbeat on %r (%d more since its last logged, at "
                            "most one per %.0fs): %r", msg.subject, held,
                            self.malformed_status_log.every_s, str(exc)[:500])
            return
        # A heartbeat speaks for the worker of its subject only (as an event batch does):
        # before, one on w1's subject naming w0 moved w0's epoch, URL and liveness.
        if not self.ingestor.subject_matches(msg.subject, status.worker_id):
            return
        actions = self.ingestor.on_status(status)
        if not self.ingestor.follows(status.worker_id, status.epoch):
            # Refused by the index (an engine it moved past, or the other of two engines
            # under one id: counted there): the registry follows the same engine. Before,
            # two engines' heartbeats swapped the worker's epoch, address and status at
            # every beat, each swap a "restart" that reset the worker's hints.
            self._perform(actions)
            return
        verdict = self._workers.on_heartbeat(self._admitted(status))
        if verdict is HeartbeatVerdict.NEW_EPOCH:
            self._hints.reset_worker(status.worker_id, status.epoch)
        worker = self._workers.get(status.worker_id)
        if worker is not None and self._writer is not None:
            self._writer.upsert("workers", (worker.worker_id,), {
                "worker_id": worker.worker_id, "url": worker.url,
                "from_config": worker.from_config, "epoch": status.epoch,
                "model": status.model, "cache_namespace": status.cache_namespace,
                "block_size": status.block_size, "last_seen": status.at,
                "status": _status_dict(status)})
        self._perform(actions)

    def _admitted(self, status: WorkerStatus) -> WorkerStatus:
        """``status`` as the registry may take it: without its ``http_url`` where that may
        not be the address of a worker not configured (worker_urls.py; a configured
        worker's URL is never taken from a heartbeat). Each refused heartbeat is counted,
        logged once per worker and URL."""
        url = status.http_url
        worker = self._workers.get(status.worker_id)
        if url is None or (worker is not None and worker.from_config):
            return status
        reason = self._url_policy.refusal(url)
        if reason is None:
            self._refused_urls.pop(status.worker_id, None)
            return status
        self._metrics.drop("worker_url_refused")
        if self._refused_urls.get(status.worker_id) != url:
            self._refused_urls[status.worker_id] = url
            log.warning("worker %s: its heartbeat's http_url %r refused (%s): not routed "
                        "to there, no worker key sent; configure it in workers or allow its "
                        "host in heartbeat_worker_hosts", status.worker_id, url[:200], reason)
        return msgspec.structs.replace(status, http_url=None)

    def _decoded(self, msg: Msg, decode: Callable[[bytes], _Decoded], what: str,
                 drop: str) -> _Decoded | None:
        """``msg``'s payload as ``decode`` reads it, or None for a malformed one: logged
        (as ``what``) and counted as the drop ``drop``; the caller returns on None."""
        try:
            return decode(msg.data)
        except WireDecodeError as exc:
            # repr'd: msgspec's message quotes the sender's field names and values as is
            log.warning("malformed %s on %r: %r", what, msg.subject, str(exc)[:500])
            self._metrics.drop(drop)
            return None

    async def _on_outcome(self, msg: Msg) -> None:
        self.outcomes.handled(msg)  # only a JetStream delivery moves the cursor
        outcome = self._decoded(msg, decode_outcome, "outcome", "outcome_malformed")
        if outcome is None:
            return
        if is_unknown_status(outcome):
            # A newer plugin's status, read as a terminal rejection (schemas.outcomes).
            log.warning("outcome on %r: %r", msg.subject, outcome.reason[:200])
            self._metrics.drop("outcome_unknown_status")
        clamped = clamped_amounts(outcome)
        if clamped is not None:
            # Amounts past the store's 32-bit columns (a plugin that echoed an unbounded
            # prefix_tokens) would cost the action its row: held to the bound, counted.
            log.warning("outcome on %r: amounts %s/%s held to %d", msg.subject,
                        outcome.requested, outcome.applied, MAX_STORED_AMOUNT)
            self._metrics.drop("outcome_amount_clamped")
            outcome = clamped
        outcome = self._hints.effective(outcome)
        sent = self._hints.on_outcome(outcome)
        if sent is not None:
            self._on_hint_outcome(sent, outcome)

    async def _on_releases(self, msg: Msg) -> None:
        self.releases.handled(msg)  # only a JetStream delivery moves the cursor
        message = self._decoded(msg, decode_releases, "hold releases", "releases_malformed")
        if message is None:
            return
        if message.unreadable:
            # The rest of the message is applied (before, one bad entry lost them all).
            log.warning("hold releases on %r: %d unreadable dropped (%r)", msg.subject,
                        len(message.unreadable), "; ".join(message.unreadable)[:500])
            self._metrics.drop("release_unreadable", len(message.unreadable))
        for release in message.releases:
            self._hints.on_release(release)
            self._on_hold_released(release)

    def tick(self) -> None:
        if (not self.replay and not self._retrying and self._link.connected
                and time.monotonic() >= self._retry_at):
            self._retrying = True
            self._spawn(self._retry_jetstream())
        elif self.replay and self._link.connected and self.streams.due():
            self._spawn(self.streams.check())
        self._perform(self.ingestor.tick())
        # As long as the ingestor keeps a dead worker's stream (to refuse its replayed
        # history), then gone from the registry too.
        for worker_id in self._workers.forget_silent(time.monotonic(),
                                                     self.ingestor.config.forget_dead_after_s):
            log.info("worker %s silent for over %.0fs: forgotten", worker_id,
                     self.ingestor.config.forget_dead_after_s)
            self._metrics.forget_worker(worker_id)
            self._hints.forget_worker(worker_id)
            self._refused_urls.pop(worker_id, None)
            if self._writer is not None:
                # Its stored row too: a restarted router whose session_forget_s is longer
                # than forget_dead_after_s read it back and routed to the gone pod again.
                self._writer.delete("workers", (worker_id,))
            if self._on_worker_forgotten is not None:
                self._on_worker_forgotten(worker_id)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        self._tasks.spawn(coro)

    async def close(self) -> None:
        await self._tasks.close()


def _status_dict(status: WorkerStatus) -> dict[str, Any]:
    return msgspec.to_builtins(status)
