"""Per-worker event-stream bookkeeping: ordering, gaps, restarts, liveness (pure).

Each worker publishes event batches numbered ``seq = 1, 2, ...`` within an ``epoch`` that
changes whenever its engine (and so its cache) restarts, plus a status heartbeat every
``interval_s``. :class:`WorkerStream` turns those observations into verdicts:

- in-order batch -> apply; ``seq`` already applied -> duplicate (dropped, counted);
- a batch from an epoch we moved past, or of an engine started before the current one's
  (epochs carry their start, :func:`kvhint.schemas.epoch_is_older`; JetStream history
  replayed at a router's start, a late snapshot reply) -> stale (dropped, counted), never
  a restart;
- a new epoch -> the old cache is gone: purge; if the batch is ``seq == 1`` we have the whole
  new stream, else resync from a snapshot;
- a sequence gap, joining mid-stream, or a heartbeat reporting a ``last_event_seq`` we have
  not applied within a grace period -> resync: batches are buffered (bounded, overflow
  counted) until the snapshot's pages arrive, then buffered batches after the snapshot's
  ``seq`` are applied in order;
- a resync still unfinished ``resync_view_trust_s`` after it began (snapshots failing or
  timing out while the worker still heartbeats) -> purge once, and keep resyncing: until
  then the view from before the gap keeps answering (the best estimate there is: a gap
  loses a few batches of a cache of thousands of blocks), after it the view is too old to
  route on, and would otherwise be trusted for as long as the snapshots keep failing;
- no message for ``heartbeat_misses * interval_s`` (the liveness window) -> dead: purge;
- two engines heartbeating under one worker id: :mod:`.stream_sources`; a dead worker
  takes the next heartbeat heard, of a retired epoch too (heartbeats are never replayed);
- while the owner replays the events stream's history (``replaying``, from a router's start
  or a link set up again until it caught up, at most ``replay_wait_s``), a heartbeat of a
  worker none of whose batches is applied waits for them (AWAITING_REPLAY) instead of
  resyncing: its replay from seq 1 makes it LIVE, one from mid-epoch (history trimmed)
  resyncs, and the replay's end (:meth:`WorkerStream.on_replay_over`) resyncs it if none
  came. Before, every worker whose heartbeat beat its replayed batches took a snapshot
  and the replay of its history was buffered, then discarded: a snapshot storm at each
  router start. Tail gaps are not judged while the replay runs either (it has not reached
  the tail): the grace starts at its end.

A batch published longer ago than the liveness window (its ``age_s``: the events stream's
history, replayed when a router starts or its link is set up again) is ordered and applied
like any other, but it is no evidence that the worker is alive now: it neither refreshes
``last_heard`` nor revives a dead worker (it is dropped then, counted as
``dead_worker_dropped``: a dead worker's blocks leave the index), nor replaces the engine
followed while that one was heard live within its window (another epoch's history then is
another engine's under the same id, one stopped: ``stale_epoch``). A worker known only from
such batches is not alive (:attr:`WorkerStream.alive`) and is declared dead one window after
its first one unless a heartbeat or a live batch is heard. Before, a dead worker's replayed
history made it look alive for a window after the replay's last batch.

What the index says of a worker is *exact* (:meth:`WorkerStream.view_exact`) only while
its stream is LIVE and heard within ``exact_heartbeat_misses`` heartbeat intervals: a
resyncing worker's view misses what the lost and the buffered batches did, and a silent
one's may miss what it is doing now. Routing may still use an inexact view; what it
predicts from one must not be reported, or learnt from, as exact.

The resync itself (the snapshot's paging, the batches buffered meanwhile) is :mod:`.stream_resync`;
the rules of which engine's messages are taken (stale, held off, a restart), :mod:`.stream_epochs`.

Time comes from the caller (an injected clock); nothing here does I/O.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Generic, TypeVar

from kvhint.router.kv_index.stream_epochs import HEARD_PHASES, EpochRules
from kvhint.router.kv_index.stream_resync import BufferedBatch, Resync
from kvhint.router.kv_index.stream_sources import IdConflict, OtherSource, SourceConflict
from kvhint.router.kv_index.stream_types import (
    BatchVerdict,
    Decision,
    StreamConfig,
    StreamCounters,
    StreamPhase,
    heartbeat_interval,
)

__all__ = ["BatchVerdict", "Decision", "StreamConfig", "StreamCounters", "StreamPhase",
           "WorkerStream"]

T = TypeVar("T")


_APPLY = Decision(BatchVerdict.APPLY)  # the hot path's answer, built once
_NOTHING = Decision()


class WorkerStream(EpochRules, Generic[T]):
    """One worker's stream state. ``T`` is whatever the owner buffers per batch (raw
    payload bytes, usually), so nothing is decoded before it is needed.

    The phase is RESYNCING exactly while a :class:`Resync` is held (``_resync``), and
    ``applied_seq`` is the last batch of ``epoch`` applied in order (0: none).
    """

    def __init__(self, worker_id: str, config: StreamConfig) -> None:
        self.worker_id = worker_id
        self.config = config
        self.phase = StreamPhase.NEW
        self.epoch: str | None = None
        self.applied_seq = 0
        self.last_heard: float | None = None
        self.interval_s = config.default_interval_s
        self.counters = StreamCounters()
        self.last_status: object | None = None
        self.url: str | None = None  # the address the followed engine's heartbeat names
        self._retired: deque[str] = deque(maxlen=config.max_retired_epochs)
        self._resync: Resync[T] | None = None
        self._behind: tuple[int, float] | None = None  # (worker's seq, since)
        self._reported_seq: int | None = None  # this epoch's last heartbeat's last_event_seq
        # When a never-heard stream got its first replayed batch: its silence runs from
        # there (a worker heard of only through its history is dead one window later).
        self._unproven_since: float | None = None
        self._sources = SourceConflict(config.conflict_hold_s, config.conflict_confirm_s,
                                       self.counters)

    # --- observations -------------------------------------------------------------

    @property
    def alive(self) -> bool:
        """Heard live (a heartbeat, a fresh batch, a snapshot reply) and not declared dead
        since: a stream fed only replayed batches is not."""
        return self.last_heard is not None and self.phase in HEARD_PHASES

    @property
    def silent_since(self) -> float | None:
        """When the worker was last heard live; for one never heard, when its first
        replayed batch came (None: nothing came)."""
        return self.last_heard if self.last_heard is not None else self._unproven_since

    def on_batch(self, epoch: str, seq: int, item: T, now: float, size: int = 0,
                 age_s: float | None = None) -> Decision:
        """A batch; ``size`` is what buffering ``item`` costs (its payload's bytes), and
        ``age_s`` how long ago it was published (None: not known, taken as live). A batch
        older than the liveness window is a replay (see the module doc)."""
        if self._is_stale(epoch):
            self.counters.stale_epoch += 1
            return Decision(BatchVerdict.STALE_EPOCH)
        if self._held_off(epoch, now):
            self.counters.other_source_dropped += 1
            return Decision(BatchVerdict.OTHER_SOURCE)
        if (epoch == self.epoch and self._reported_seq is not None
                and seq > self._reported_seq + self.config.max_seq_ahead_of_heartbeat):
            self.counters.implausible_seq += 1
            return Decision(BatchVerdict.IMPLAUSIBLE)
        replayed = age_s is not None and age_s > self.liveness_window_s
        if replayed and self.phase is StreamPhase.DEAD:
            self.counters.dead_worker_dropped += 1
            return Decision(BatchVerdict.DEAD_WORKER)
        if replayed and epoch != self.epoch and self._heard_within_window(now):
            # Another engine's history: the engine followed was heard live within its
            # window, so one that replaced it would be heard live too, not only
            # replayed (two engines under one id, a router starting after one stopped).
            self.counters.stale_epoch += 1
            return Decision(BatchVerdict.STALE_EPOCH)
        self._note_source(epoch)
        if not replayed:
            self.last_heard = now
        elif self.last_heard is None and self._unproven_since is None:
            self._unproven_since = now
        purge = self._observe_epoch(epoch)
        if self.phase is StreamPhase.RESYNCING:
            return self._buffer_batch(seq, item, purge, size)
        if self.phase is not StreamPhase.LIVE:  # first batch of this epoch
            if seq == 1:
                if self.phase is StreamPhase.AWAITING_REPLAY:
                    self._wait_ended_by_replay(now)
                self.phase = StreamPhase.LIVE
            else:
                return self._begin_resync(seq, item, purge,
                                          f"joined mid-stream at seq {seq}", now, size)
        if seq <= self.applied_seq:
            self.counters.duplicates += 1
            return Decision(BatchVerdict.DUPLICATE, purge)
        if seq == self.applied_seq + 1:
            self.applied_seq = seq
            self.counters.batches_applied += 1
            if self._behind is not None:
                self._clear_behind_if_caught_up()
                if replayed and self._behind is not None:
                    # A replay catching up on what a heartbeat reported: no tail gap while
                    # it progresses (before, a replay longer than the grace resynced, and
                    # the rest of it was buffered, then discarded as covered).
                    self._behind = (self._behind[0], now)
            return _APPLY if purge is None else Decision(BatchVerdict.APPLY, purge)
        self.counters.gaps += 1
        self.counters.missing_batches += seq - self.applied_seq - 1
        return self._begin_resync(seq, item, purge,
                                  f"sequence gap: expected {self.applied_seq + 1}, got {seq}",
                                  now, size)

    def on_status(self, epoch: str, last_event_seq: int, interval_s: float, now: float,
                  status: object | None = None, replaying: bool = False,
                  url: str | None = None) -> Decision:
        """A heartbeat naming ``url``; a decision with no verdict (there is no batch).
        ``replaying``: the owner is replaying the events stream's history (module doc): a
        worker with nothing applied waits for it instead of resyncing."""
        stale = self._is_stale(epoch, heartbeat=True)
        if stale or self._held_off(epoch, now, url):  # counted there
            window = (heartbeat_interval(interval_s, self.config.default_interval_s)
                      * self.config.heartbeat_misses)
            return Decision(id_conflict=self._sources.refused(
                OtherSource(epoch, now, window, status, url), self.last_heard, self.url, stale))
        self._note_source(epoch)
        self.last_heard = now
        self.interval_s = heartbeat_interval(interval_s, self.config.default_interval_s)
        if interval_s > 0 and self.interval_s != interval_s:
            self.counters.status_interval_bounded += 1
        purge = self._observe_epoch(epoch)
        self.last_status, self.url = status, url
        self._sources.followed_at(url)
        self._reported_seq = last_event_seq
        if self.phase is StreamPhase.RESYNCING:
            return Decision(None, purge)
        if self.phase is not StreamPhase.LIVE:
            if last_event_seq == 0:
                self.phase = StreamPhase.LIVE  # nothing published yet: empty cache
                return Decision(None, purge)
            if replaying:  # its batches may be in the history still to come
                if self.phase is not StreamPhase.AWAITING_REPLAY:
                    self.phase = StreamPhase.AWAITING_REPLAY
                    self.counters.resyncs_deferred += 1
                return Decision(None, purge)
            return self._begin_resync(None, None, purge,
                                      f"joined mid-stream (worker at seq {last_event_seq})",
                                      now)
        if last_event_seq > self.applied_seq:
            if self._behind is None:  # keep the oldest claim we have not caught up with
                self._behind = (last_event_seq, now)
        else:
            self._behind = None
        return Decision(None, purge) if purge else self._check_tail_gap(now, replaying)

    def tick(self, now: float, replaying: bool = False) -> tuple[Decision, bool]:
        """Liveness and timers (``replaying``: as for :meth:`on_status`). Returns
        (decision, request_page_now)."""
        self._sources.expire(now)
        heard = self.silent_since
        if self.phase in (StreamPhase.NEW, StreamPhase.DEAD) or heard is None:
            return _NOTHING, False
        if now - heard > self.liveness_window_s:
            self.counters.deaths += 1
            silence = now - heard
            self._reset_stream(gone=True)
            self.phase = StreamPhase.DEAD
            return Decision(None, f"no heartbeat for {silence:.1f}s"), False
        if self._resync is not None:
            stalled, request_now = self._resync.due(now)
            return (_NOTHING if stalled is None else Decision(None, stalled)), request_now
        return self._check_tail_gap(now, replaying), False

    def on_replay_over(self, now: float, expired: bool = False) -> Decision:
        """The owner's replay of the history ended: caught up with the stream, or given up
        after ``replay_wait_s`` (``expired``). A worker still waiting got none of its
        batches from it: resync now. A LIVE one behind what its heartbeat reported gets
        the tail-gap grace from now (not judged during the replay)."""
        if self.phase is StreamPhase.LIVE and self._behind is not None:
            self._behind = (self._behind[0], now)
            return _NOTHING
        if self.phase is not StreamPhase.AWAITING_REPLAY:
            return _NOTHING
        if expired:
            self.counters.replay_waits_expired += 1
            why = f"the replay was not over after {self.config.replay_wait_s:.0f}s"
        else:
            why = "the replay held none of its batches"
        return self._begin_resync(None, None, None, f"joined mid-stream (worker at seq "
                                                    f"{self._reported_seq}): {why}", now)

    # --- resync -------------------------------------------------------------------

    @property
    def resync_cursor(self) -> int | None:
        return None if self._resync is None else self._resync.cursor

    @property
    def resync_seq(self) -> int | None:
        """The seq of the snapshot being paged (None before its first page)."""
        return None if self._resync is None else self._resync.paging_seq

    def page_requested(self, now: float) -> None:
        if self._resync is not None:
            self._resync.page_requested(now)

    def on_snapshot_failed(self, now: float) -> None:
        if self._resync is not None:
            self._resync.request_failed(now)

    def on_snapshot_page(self, epoch: str, seq: int, cursor: int, next_cursor: int | None,
                         page: object, now: float) -> tuple[str, list[object] | None]:
        """Returns ("ignored"|"invalid"|"restart"|"more"|"done", pages when done):
        "ignored" for a page not awaited (no resync, another cursor) or of an engine the
        stream does not take; else as :meth:`Resync.take_page` says."""
        # A late reply from an engine we moved past, or another source's (both engines
        # under one id answer the snapshot subject).
        held_off = self._held_off(epoch, now)
        stale = self._is_stale(epoch) or held_off
        if not stale:
            self.last_heard = now
        resync = self._resync
        if resync is None or cursor != resync.cursor or stale:
            self.counters.snapshot_pages_ignored += 1
            if held_off and resync is not None and cursor == resync.cursor:
                # The other engine answered first: the request got its one reply, and
                # the followed engine's is gone with it. Asked again soon, not after
                # snapshot_timeout_s (a resync in a conflict would run into its stall).
                resync.retry_soon(now)
            return "ignored", None
        return resync.take_page(epoch, seq, cursor, next_cursor, page, now)

    def finish_resync(self, now: float) -> tuple[list[T], Decision]:
        """After the snapshot is loaded: the buffered items to apply, in order, and a
        decision (a new resync if a hole remains after the snapshot)."""
        resync = self._resync
        assert resync is not None and resync.base_seq is not None and resync.page_epoch
        self.counters.resyncs_completed += 1
        purge = None
        if resync.page_epoch != self.epoch:
            # The engine restarted while we waited: buffered batches belong to the old one.
            # Handled as a live batch's new epoch is: counted in epoch_changes, and a purge
            # that the owner applies (and notices) before loading this snapshot.
            # The conflict record is told, as for a heartbeat taken (_note_source).
            self._note_source(resync.page_epoch)
            if self.epoch is not None:
                self._retired.append(self.epoch)
                purge = self._count_restart(self.epoch, resync.page_epoch)
            self.counters.stale_epoch += resync.buffer.drop()
            self.epoch, self.url = resync.page_epoch, None  # its address: from its heartbeat
        ready, rest = resync.release()
        self.applied_seq = resync.base_seq + len(ready)
        self._resync = None
        self._behind = None
        self.phase = StreamPhase.LIVE
        if rest:
            reason = f"hole after snapshot: expected {self.applied_seq + 1}, got {rest[0].seq}"
            return ready, self._begin_resync(None, None, purge, reason, now, held=rest)
        return ready, Decision(None, purge)

    def force_resync(self, reason: str, now: float) -> Decision:
        """Start a resync now (e.g. an applied batch could not be decoded)."""
        if self.phase is StreamPhase.RESYNCING:
            return Decision()
        return self._begin_resync(None, None, None, reason, now)

    def view_exact(self, now: float) -> bool:
        """Whether the index's view of this worker is exact now: LIVE, and heard within
        ``exact_heartbeat_misses`` heartbeat intervals (see the module doc)."""
        return (self.phase is StreamPhase.LIVE and self.last_heard is not None
                and now - self.last_heard <= self.interval_s * self.config.exact_heartbeat_misses)

    def forget(self) -> None:
        """Back to NEW (the owner removed the worker)."""
        self._reset_stream(gone=True)
        self.phase = StreamPhase.NEW
        self.last_heard = None
        self._unproven_since = None
        self._sources = SourceConflict(self.config.conflict_hold_s,
                                       self.config.conflict_confirm_s, self.counters)

    def conflict(self, now: float) -> IdConflict | None:
        """The conflict reported and held over this worker's id (:mod:`.stream_sources`)."""
        return self._sources.current(now)

    # --- internals ----------------------------------------------------------------

    def _reset_stream(self, gone: bool = False) -> None:
        """Forget this epoch's progress; the buffered batches are dropped, counted as
        ``dead_worker_dropped`` when ``gone`` (dead or removed), else as ``stale_epoch``
        (a new epoch replaced theirs)."""
        self.applied_seq = 0
        self._reported_seq = None
        dropped = 0 if self._resync is None else self._resync.buffer.drop()
        if gone:
            self.counters.dead_worker_dropped += dropped
        else:
            self.counters.stale_epoch += dropped
        self._resync = None
        self._behind = None
        self.phase = StreamPhase.NEW

    def _begin_resync(self, seq: int | None, item: T | None, purge: str | None,
                      reason: str, now: float, size: int = 0,
                      held: Sequence[BufferedBatch[T]] = ()) -> Decision:
        """Start a resync, buffering the batch ``seq`` (if any) that showed it is needed;
        ``held``: batches buffered already (from a hole after the last snapshot)."""
        self.phase = StreamPhase.RESYNCING
        self._resync = Resync(reason, now, self.config, self.counters, held)
        self._behind = None
        self.counters.resyncs_started += 1
        verdict = None
        if seq is not None:
            verdict = self._resync.take_batch(seq, item, size)  # type: ignore[arg-type]
        return Decision(verdict, purge, reason)

    def _buffer_batch(self, seq: int, item: T, purge: str | None, size: int) -> Decision:
        resync = self._resync
        assert resync is not None  # RESYNCING
        if seq <= self.applied_seq or resync.buffer.holds(seq):
            self.counters.duplicates += 1
            return Decision(BatchVerdict.DUPLICATE, purge)
        return Decision(resync.take_batch(seq, item, size), purge)

    def _clear_behind_if_caught_up(self) -> None:
        if self._behind is not None and self.applied_seq >= self._behind[0]:
            self._behind = None

    def _wait_ended_by_replay(self, now: float) -> None:
        """A waiting worker's replay began at its epoch's seq 1: no snapshot needed. What
        its heartbeat reported is to be caught up with, as if heard while LIVE."""
        self.counters.resyncs_avoided += 1
        if self._reported_seq:
            self._behind = (self._reported_seq, now)

    def _check_tail_gap(self, now: float, replaying: bool = False) -> Decision:
        if self._behind is None or self.phase is not StreamPhase.LIVE or replaying:
            return Decision()
        target, since = self._behind
        grace = self.config.tail_gap_grace_s
        grace = self.interval_s if grace is None else grace
        if self.applied_seq >= target:
            self._behind = None
            return Decision()
        if now - since < grace:
            return Decision()
        self.counters.gaps += 1
        self.counters.missing_batches += target - self.applied_seq
        return self._begin_resync(None, None, None,
                                  f"tail gap: worker reported seq {target}, applied "
                                  f"{self.applied_seq}", now)
