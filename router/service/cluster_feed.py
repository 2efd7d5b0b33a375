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

This module says what each message means; how they come (the consumers, their cursors,
the plain subscriptions meanwhile, the retries) is :mod:`.feed_jetstream`
(:class:`~.feed_jetstream.FeedJetStream`, a part of :class:`ClusterFeed`), whose
constants are exported here too.

The ingestor (``kvhint.router.kv_index``) decides; index_actions.py performs its actions.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import msgspec
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from kvhint.router.kv_index import KvEventIngestor
from kvhint.router.service.feed_jetstream import (
    JETSTREAM_RETRY_MAX_S,
    JETSTREAM_RETRY_S,
    OUTCOMES_CURSOR,
    RELEASES_CURSOR,
    FeedJetStream,
    StreamCursor,
    stream_metadata,
)
from kvhint.router.service.hint_dispatch import HintDispatcher, SentAction
from kvhint.router.service.hint_records import MAX_STORED_AMOUNT, clamped_amounts
from kvhint.router.service.index_actions import IndexActions
from kvhint.router.service.log_throttle import PerKeyLogThrottle
from kvhint.router.service.metrics import RouterMetrics
from kvhint.router.service.nats_link import NatsLink
from kvhint.router.service.stream_watch import StreamWatch
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

__all__ = ["JETSTREAM_RETRY_MAX_S", "JETSTREAM_RETRY_S", "OUTCOMES_CURSOR",
           "RELEASES_CURSOR", "ClusterFeed"]

log = logging.getLogger(__name__)
# What a payload decoder reads (:meth:`ClusterFeed._decoded`).
_Decoded = TypeVar("_Decoded")


class ClusterFeed(FeedJetStream):
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
        self.outcomes = StreamCursor(OUTCOMES_CURSOR, outcomes_last_seq, writer, wall_clock)
        self.releases = StreamCursor(RELEASES_CURSOR, releases_last_seq, writer, wall_clock)
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

    # --- messages -----------------------------------------------------------------------

    async def _on_events(self, msg: Msg) -> None:
        # The batch's age (JetStream's publish timestamp; None on a plain subscription,
        # which delivers live messages only): a batch replayed from the stream's history
        # is applied, but the ingestor takes no such one as proof its worker is alive now
        # (before, a dead worker's replay made it look alive). Clock skew between the NATS
        # server and this host shifts it; heartbeats (never replayed) prove life anyway.
        age_s = None
        metadata = stream_metadata(msg)
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
