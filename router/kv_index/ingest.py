"""The one object the router service feeds every KV-related message to.

``KvEventIngestor`` joins the adapter (bytes -> domain events), the per-worker stream rules
(:mod:`.stream`) and the index. It does no I/O: each ``on_*`` call returns the actions the
owner must perform (:mod:`.actions`), typically ``RequestSnapshot`` pages. The clock is
injected. Everything dropped is counted (:meth:`KvEventIngestor.stats`).

Typical wiring (the service owns NATS)::

    ingestor = KvEventIngestor(InMemoryClusterKvIndex(), clock=time.monotonic)
    # events.<w> (core NATS or a JetStream consumer; age_s from JetStream's timestamp):
    actions = ingestor.on_event_message(msg.headers, msg.data, subject=msg.subject,
                                        age_s=seconds_since_published)
    # status.<w>:
    actions = ingestor.on_status_message(msg.data, subject=msg.subject)
    # every second or so:
    actions = ingestor.tick()
    # replaying the events stream's history (a router's start, a link set up again):
    ingestor.replay_started()             # before heartbeats are taken
    actions = ingestor.replay_caught_up() # the consumer reached the stream's end
    # for RequestSnapshot(w, cursor, limit): request snapshot.<w> and then
    # (decode_snapshot_reply: a page, or the worker's SnapshotRefused)
    actions = ingestor.on_snapshot_page(page)   # or on_snapshot_failed (refused, timed out)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields, replace

from kvhint.router.kv_index.actions import (
    IngestAction,
    RequestSnapshot,
    WorkerAlive,
    WorkerDead,
    WorkerIdConflict,
    WorkerPurgedNotice,
)
from kvhint.router.kv_index.adapter import EventBatchAdapter, snapshot_to_event
from kvhint.router.kv_index.events import WorkerPurged
from kvhint.router.kv_index.protocol import ClusterKvIndex
from kvhint.router.kv_index.stream import (
    BatchVerdict,
    Decision,
    StreamConfig,
    StreamCounters,
    StreamPhase,
    WorkerStream,
)
from kvhint.schemas import WireDecodeError
from kvhint.schemas.events import EventBatchMeta
from kvhint.schemas.snapshot import WorkerSnapshot
from kvhint.schemas.status import WorkerStatus, decode_status
from kvhint.schemas.subjects import Subjects

# An event batch as a worker's stream buffers it: (the KV-cache group its headers name,
# vLLM's msgpack payload).
_Batch = tuple[int, bytes]


@dataclass(frozen=True, slots=True)
class IdConflictView:
    """A conflict reported and held over a worker's id (two engines heartbeat under it;
    see :mod:`.stream_sources`): the engine not followed, and how long ago the conflict
    was found and that engine last heard."""

    other_epoch: str
    other_url: str | None
    found_s_ago: float
    other_heard_s_ago: float


@dataclass(frozen=True, slots=True)
class WorkerStreamView:
    """A worker's stream state, for the admin API and metrics."""

    worker_id: str
    phase: str
    epoch: str | None
    applied_seq: int
    last_heard: float | None
    last_status: WorkerStatus | None
    counters: Mapping[str, int]
    conflict: IdConflictView | None = None


@dataclass(frozen=True, slots=True)
class IngestStats:
    """Totals over all workers (stream counters, adapter counters, message-level drops)."""

    stream: Mapping[str, int]
    adapter: Mapping[str, int]
    malformed_messages: int
    subject_mismatches: int
    unknown_worker_pages: int


class KvEventIngestor:
    """Feeds one :class:`ClusterKvIndex` from the workers' event, status and snapshot
    messages, keeping each worker's stream consistent (see :mod:`.stream`)."""

    def __init__(self, index: ClusterKvIndex, clock: Callable[[], float],
                 config: StreamConfig | None = None, subjects: Subjects | None = None) -> None:
        self.index = index
        self._clock = clock
        self.config = config or StreamConfig()
        self._subjects = subjects
        self._adapter = EventBatchAdapter()
        self._streams: dict[str, WorkerStream[_Batch]] = {}
        self._malformed = 0
        self._subject_mismatch = 0
        self._unknown_pages = 0
        # Counters of the streams forgotten (long dead), so totals never go back.
        self._forgotten_counters = dict.fromkeys((f.name for f in fields(StreamCounters)), 0)
        # When the owner began replaying the events stream's history; None: not replaying.
        self._replay_since: float | None = None

    # --- messages -------------------------------------------------------------------

    def on_event_message(self, headers: Mapping[str, str] | None, payload: bytes,
                         subject: str | None = None, age_s: float | None = None
                         ) -> list[IngestAction]:
        """One ``events.<w>`` message: NATS headers (worker, epoch, seq) + vLLM msgpack.
        ``age_s``: seconds since it was published (JetStream's timestamp), None when not
        known (a plain subscription: live). One older than the worker's liveness window
        is a replay of the stream's history: applied, but no proof the worker is alive
        (:mod:`.stream`)."""
        try:
            meta = EventBatchMeta.from_headers(dict(headers) if headers else None)
        except WireDecodeError:
            self._malformed += 1
            return []
        if not self.subject_matches(subject, meta.worker_id):
            return []
        return self.on_event_batch(meta, payload, age_s)

    def on_event_batch(self, meta: EventBatchMeta, payload: bytes,
                       age_s: float | None = None) -> list[IngestAction]:
        """Same, with the headers already parsed."""
        stream = self._streams.get(meta.worker_id) or self._stream(meta.worker_id)
        was_alive = stream.alive
        # The KV-cache group travels with the payload: a batch buffered during a resync is
        # applied later, by the group its own headers named.
        batch = (meta.group, payload)
        decision = stream.on_batch(meta.epoch, meta.seq, batch, self._clock(), len(payload),
                                   age_s)
        if was_alive and decision.purge_reason is None and decision.resync_reason is None:
            # The hot path: an in-order batch (or a dropped one) of a known worker.
            if decision.verdict is BatchVerdict.APPLY:
                return self._apply_payload(stream, batch)
            return []
        actions = self._alive_actions(stream, was_alive)
        actions += self._carry_out(stream, decision)
        if decision.verdict is BatchVerdict.APPLY:
            actions += self._apply_payload(stream, batch)
        return actions

    def on_status_message(self, payload: bytes,
                          subject: str | None = None) -> list[IngestAction]:
        try:
            status = decode_status(payload)
        except WireDecodeError:
            self.note_malformed()
            return []
        if not self.subject_matches(subject, status.worker_id):
            return []
        return self.on_status(status)

    def note_malformed(self) -> None:
        """A message a caller could not decode (counted in ``malformed_messages``)."""
        self._malformed += 1

    def subject_matches(self, subject: str | None, worker_id: str) -> bool:
        """Whether a message naming ``worker_id`` came on that worker's own subject (None:
        not known, taken as it is); a mismatch (a misconfigured or stray publisher
        speaking for another worker) is counted (``subject_mismatches``) and the message
        is to be dropped."""
        if subject is None or self._subjects is None:
            return True
        try:
            subject_worker = self._subjects.worker_of(subject)
        except WireDecodeError:
            subject_worker = None
        if subject_worker != worker_id:
            self._subject_mismatch += 1
            return False
        return True

    def on_status(self, status: WorkerStatus) -> list[IngestAction]:
        stream = self._stream(status.worker_id)
        was_alive = stream.alive
        decision = stream.on_status(status.epoch, status.last_event_seq, status.interval_s,
                                    self._clock(), status, replaying=self.replaying,
                                    url=status.http_url)
        return self._alive_actions(stream, was_alive) + self._carry_out(stream, decision)

    def on_snapshot_page(self, page: WorkerSnapshot, cursor: int | None = None
                         ) -> list[IngestAction]:
        """The reply to the last ``RequestSnapshot`` for ``page.worker_id``. Pass the
        request's ``cursor`` when you have it: a page answering any other request (a late
        reply to one that timed out) is then ignored and counted."""
        stream = self._streams.get(page.worker_id)
        if stream is None:
            self._unknown_pages += 1
            return []
        was_alive = stream.alive  # a reply is heard live: it proves a replayed worker alive
        awaited = stream.resync_cursor
        answered = awaited if cursor is None else cursor
        outcome, pages = stream.on_snapshot_page(page.epoch, page.seq,
                                                 answered if answered is not None else -1,
                                                 page.next_cursor, page, self._clock())
        actions = self._alive_actions(stream, was_alive)
        if outcome in ("ignored", "invalid"):  # "invalid": retried from tick()
            return actions
        if outcome in ("more", "restart"):
            return actions + [self._request_page(
                stream, "snapshot continues" if outcome == "more"
                else "another snapshot's page; restarting")]
        assert pages is not None
        ready, decision = stream.finish_resync(self._clock())
        # A snapshot of a newer epoch: the old engine's view is purged (and noticed) first,
        # as for a live batch's new epoch; then the snapshot, then what was buffered.
        actions += self._carry_out(stream, replace(decision, resync_reason=None))
        self.index.apply(snapshot_to_event(pages, self._adapter.counters))  # type: ignore[arg-type]
        for batch in ready:
            actions += self._apply_payload(stream, batch)
        if decision.resync_reason:  # a hole after the snapshot
            actions.append(self._request_page(stream, decision.resync_reason))
        return actions

    def on_snapshot_failed(self, worker_id: str, reason: str = "") -> list[IngestAction]:
        """The snapshot request failed, was refused or timed out; it is retried from
        :meth:`tick`."""
        stream = self._streams.get(worker_id)
        if stream is not None:
            stream.on_snapshot_failed(self._clock())
        return []

    def remember_dead_for(self, seconds: float) -> None:
        """Keep a dead worker's stream state (epoch, retired epochs, counters) for
        ``seconds`` after it was last heard, instead of ``config.forget_dead_after_s``:
        as long as the events stream can still replay its messages, so a replayed batch
        of a forgotten engine is never taken for a new one's. Streams already open read
        the ingestor's setting at every tick, so it applies to them too."""
        self.config = replace(self.config, forget_dead_after_s=float(seconds))

    # --- the replay of the events stream's history ---------------------------------

    @property
    def replaying(self) -> bool:
        """Whether the owner is replaying the events stream's history (see
        :meth:`replay_started`)."""
        return self._replay_since is not None

    def replay_started(self) -> None:
        """The owner begins replaying the events stream's history (a router's start, its
        link set up again), before it takes heartbeats. Until :meth:`replay_caught_up` (or
        ``config.replay_wait_s``), a heartbeat of a worker with no batch applied waits for
        the worker's replayed batches instead of asking for a snapshot (:mod:`.stream`)."""
        self._replay_since = self._clock()

    def replay_caught_up(self) -> list[IngestAction]:
        """The replay reached the stream's end (or there was none: an empty stream, no
        JetStream). Workers still waiting for their batches resync now. Idempotent."""
        return self._end_replay(expired=False)

    def _end_replay(self, expired: bool) -> list[IngestAction]:
        if self._replay_since is None:
            return []
        self._replay_since = None
        now = self._clock()
        actions: list[IngestAction] = []
        for stream in self._streams.values():
            actions += self._carry_out(stream, stream.on_replay_over(now, expired))
        return actions

    # --- timers ---------------------------------------------------------------------

    def tick(self) -> list[IngestAction]:
        """Call periodically (about once per second): dead workers, snapshot retries and
        timeouts, heartbeats that show lost trailing batches, a replay past its bound."""
        now = self._clock()
        actions: list[IngestAction] = []
        for stream in list(self._streams.values()):
            was_heard = stream.silent_since
            if stream.phase is StreamPhase.DEAD and (
                    was_heard is None or now - was_heard > self.config.forget_dead_after_s):
                self._forget_stream(stream)
                continue
            decision, request_page = stream.tick(now, self.replaying)
            if stream.phase is StreamPhase.DEAD and decision.purge_reason:
                self.index.apply(WorkerPurged(stream.worker_id, decision.purge_reason))
                actions.append(WorkerDead(stream.worker_id,
                                          now - (was_heard if was_heard is not None else now)))
                continue
            actions += self._carry_out(stream, decision)
            if request_page:
                actions.append(self._request_page(stream, "retrying snapshot"))
        # After liveness: a waiting worker gone silent is dead, not resynced.
        if (self._replay_since is not None
                and now - self._replay_since > self.config.replay_wait_s):
            actions += self._end_replay(expired=True)
        return actions

    def forget_worker(self, worker_id: str, reason: str = "removed") -> None:
        """The worker left the configuration: drop its stream state and index entries."""
        stream = self._streams.get(worker_id)
        if stream is not None:
            self._forget_stream(stream)
        self.index.apply(WorkerPurged(worker_id, reason))

    # --- views ----------------------------------------------------------------------

    def worker_views(self) -> dict[str, WorkerStreamView]:
        now = self._clock()
        return {w: WorkerStreamView(
            worker_id=w, phase=s.phase.value, epoch=s.epoch, applied_seq=s.applied_seq,
            last_heard=s.last_heard,
            last_status=s.last_status if isinstance(s.last_status, WorkerStatus) else None,
            counters=_as_dict(s.counters), conflict=self._conflict_view(s, now))
            for w, s in self._streams.items()}

    def conflicting_workers(self) -> tuple[str, ...]:
        """The workers over whose id a conflict is reported and held now, sorted (one
        found but not yet heard for ``conflict_confirm_s`` is not: a rollout, maybe)."""
        now = self._clock()
        return tuple(sorted(w for w, s in self._streams.items() if s.conflict(now)))

    def follows(self, worker_id: str, epoch: str) -> bool:
        """Whether the worker's stream follows ``epoch`` now: a heartbeat of it was taken
        (not refused as stale, or as another engine's under the same id)."""
        stream = self._streams.get(worker_id)
        return stream is not None and stream.epoch == epoch

    def live_workers(self) -> tuple[str, ...]:
        """Workers whose stream is consistent (LIVE), sorted: route by their overlap."""
        return tuple(sorted(w for w, s in self._streams.items()
                            if s.phase is StreamPhase.LIVE))

    def view_exact(self, worker_id: str) -> bool:
        """Whether what the index holds of ``worker_id`` is exact now (its stream LIVE and
        heard lately; :meth:`WorkerStream.view_exact`). False for a worker never heard, a
        resyncing one (its view is from before the gap) and a silent one: an overlap read
        from such a view is an estimate, not to be reported or learnt from as exact."""
        stream = self._streams.get(worker_id)
        return stream is not None and stream.view_exact(self._clock())

    def stats(self) -> IngestStats:
        totals = dict(self._forgotten_counters)
        for stream in self._streams.values():
            for name, value in _as_dict(stream.counters).items():
                totals[name] += value
        return IngestStats(stream=totals, adapter=_as_dict(self._adapter.counters),
                           malformed_messages=self._malformed,
                           subject_mismatches=self._subject_mismatch,
                           unknown_worker_pages=self._unknown_pages)

    # --- internals ------------------------------------------------------------------

    def _forget_stream(self, stream: WorkerStream[_Batch]) -> None:
        del self._streams[stream.worker_id]
        stream.forget()  # first: it counts the batches its buffer drops
        for name, value in _as_dict(stream.counters).items():
            self._forgotten_counters[name] += value

    def _stream(self, worker_id: str) -> WorkerStream[_Batch]:
        stream = self._streams.get(worker_id)
        if stream is None:
            stream = self._streams[worker_id] = WorkerStream(worker_id, self.config)
        return stream

    def _alive_actions(self, stream: WorkerStream[_Batch], was_alive: bool) -> list[IngestAction]:
        """A worker that came alive with this message; none for a message its stream
        dropped (a stale epoch's leaves a dead worker dead) or a replayed batch (no proof
        the worker runs now)."""
        if was_alive or stream.epoch is None or not stream.alive:
            return []
        return [WorkerAlive(stream.worker_id, stream.epoch)]

    def _carry_out(self, stream: WorkerStream[_Batch], decision: Decision) -> list[IngestAction]:
        actions: list[IngestAction] = []
        if decision.id_conflict and (held := stream.conflict(self._clock())) is not None \
                and stream.epoch is not None:
            actions.append(WorkerIdConflict(stream.worker_id, stream.epoch,
                                            _url_of(stream.last_status), held.other.epoch,
                                            _url_of(held.other.status)))
        if decision.purge_reason:
            self.index.apply(WorkerPurged(stream.worker_id, decision.purge_reason))
            actions.append(WorkerPurgedNotice(stream.worker_id, decision.purge_reason))
        if decision.resync_reason:
            actions.append(self._request_page(stream, decision.resync_reason))
        return actions

    @staticmethod
    def _conflict_view(stream: WorkerStream[_Batch], now: float) -> IdConflictView | None:
        held = stream.conflict(now)
        if held is None:
            return None
        return IdConflictView(other_epoch=held.other.epoch, other_url=_url_of(held.other.status),
                              found_s_ago=now - held.since,
                              other_heard_s_ago=now - held.other.heard)

    def _request_page(self, stream: WorkerStream[_Batch], reason: str) -> RequestSnapshot:
        stream.page_requested(self._clock())
        cursor = stream.resync_cursor
        return RequestSnapshot(stream.worker_id, cursor if cursor is not None else 0,
                               self.config.snapshot_page_limit, reason, stream.resync_seq)

    def _apply_payload(self, stream: WorkerStream[_Batch], batch: _Batch) -> list[IngestAction]:
        group, payload = batch
        try:
            events = self._adapter.decode(stream.worker_id, payload, group)
        except WireDecodeError:
            # The batch is lost for good: its effect on the cache is unknown, so resync.
            decision = stream.force_resync("undecodable event batch", self._clock())
            return self._carry_out(stream, decision)
        self.index.apply_all(events)
        return []


def _url_of(status: object | None) -> str | None:
    return status.http_url if isinstance(status, WorkerStatus) else None


def _as_dict(obj: object) -> dict[str, int]:
    return {f.name: getattr(obj, f.name) for f in fields(obj)}  # type: ignore[arg-type]
