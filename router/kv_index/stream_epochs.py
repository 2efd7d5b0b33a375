"""Which engine's messages a worker's stream takes (pure; part of :mod:`.stream`).

An epoch names one engine's run: a message of an epoch the stream moved past (retired,
or of an engine started before the current one's) is stale; another source's, while the
one followed is alive and a conflict is held (:mod:`.stream_sources`), is held off; a new
epoch taken replaces the one followed (a restart: its purge reason). :class:`EpochRules`
is :class:`~.stream.WorkerStream`'s, over its state.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from kvhint.router.kv_index.stream_sources import OtherSource, SourceConflict
from kvhint.router.kv_index.stream_types import StreamConfig, StreamCounters, StreamPhase
from kvhint.schemas.status import epoch_is_older

# Phases in which the worker was heard live; phases with nothing of its epoch applied.
HEARD_PHASES = (StreamPhase.LIVE, StreamPhase.RESYNCING, StreamPhase.AWAITING_REPLAY)
_NOTHING_APPLIED = (StreamPhase.NEW, StreamPhase.DEAD, StreamPhase.AWAITING_REPLAY)


class EpochRules:
    """The epoch rules of :class:`~.stream.WorkerStream`, which sets these up and
    supplies ``_reset_stream`` (forget the epoch's progress)."""

    config: StreamConfig
    phase: StreamPhase
    epoch: str | None
    interval_s: float
    last_heard: float | None
    last_status: object | None
    url: str | None
    counters: StreamCounters
    _retired: deque[str]
    _sources: SourceConflict
    _reset_stream: Callable[..., None]

    @property
    def liveness_window_s(self) -> float:
        """Silence longer than this is death; a batch older than this is a replay."""
        return self.interval_s * self.config.heartbeat_misses


    def _is_stale(self, epoch: str, heartbeat: bool = False) -> bool:
        """Of an engine we moved past: retired, or started before the current one.

        Except a heartbeat once the current engine is dead: heartbeats are not replayed
        (core NATS), so one proves its engine runs now. An epoch that looks older is an
        engine started after its host's clock stepped back (NTP, a VM restored); a
        retired one, the other of two engines under one id, the one followed gone.
        Before, their every message was dropped and the worker stayed dead until
        forgotten, an hour later. Their batches count once their heartbeat is taken."""
        if heartbeat and self.phase is StreamPhase.DEAD:
            return False
        if epoch in self._retired:
            return True
        return (self.epoch is not None and epoch != self.epoch
                and epoch_is_older(epoch, self.epoch))

    def _held_off(self, epoch: str, now: float, url: str | None = None) -> bool:
        """Another source's epoch while the source followed is alive (heard within its
        window): refused while a conflict is held, unless a heartbeat's ``url`` is the
        followed server's (its restart), or if it is of a server that came back."""
        return (self.epoch is not None and epoch != self.epoch
                and (self._sources.held(now) and not self._sources.same_server(url, self.url)
                     or self._sources.came_back(url, self.url, now))
                and self._heard_within_window(now))

    def _heard_within_window(self, now: float) -> bool:
        """The source followed was heard live within its liveness window."""
        return (self.phase in HEARD_PHASES and self.last_heard is not None
                and now - self.last_heard <= self.liveness_window_s)

    def _note_source(self, epoch: str) -> None:
        """A message of ``epoch`` is taken (before it changes the stream): tell the
        conflict record when it replaces the source followed."""
        if self.epoch is not None and epoch != self.epoch:
            left = None if self.last_heard is None else OtherSource(
                self.epoch, self.last_heard, self.liveness_window_s, self.last_status, self.url)
            self._sources.adopted(epoch, left)

    def _observe_epoch(self, epoch: str) -> str | None:
        """Take ``epoch`` as current; the purge reason when it replaces a live one (a
        waiting one has nothing applied to purge)."""
        if self.phase in _NOTHING_APPLIED or self.epoch is None:
            self._adopt_epoch(epoch)
            return None
        if epoch == self.epoch:
            return None
        reason = self._count_restart(self.epoch, epoch)
        self._adopt_epoch(epoch)
        return reason

    def _count_restart(self, old: str, new: str) -> str:
        self.counters.epoch_changes += 1
        return f"engine restarted (epoch {old} -> {new})"

    def _adopt_epoch(self, epoch: str) -> None:
        if self.epoch is not None and self.epoch != epoch:
            self._retired.append(self.epoch)
        if epoch in self._retired:  # taken back (a dead worker's heartbeat, _is_stale)
            self._retired.remove(epoch)
        if self.epoch != epoch:
            self._reset_stream()
            self.url = None  # another engine's: its heartbeat names its own
        self.epoch = epoch
        if self.phase is StreamPhase.DEAD:
            self.phase = StreamPhase.NEW
