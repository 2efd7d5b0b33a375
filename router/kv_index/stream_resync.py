"""A worker's snapshot resync (pure; part of :mod:`.stream`): the paging of the snapshot
that ends it, and the batches buffered while it runs.

:class:`WorkerStream` starts a :class:`Resync` when it cannot go on from what it applied
(a gap, joining mid-stream, a tail gap, an undecodable batch) and drops it when the
worker dies, is removed or restarts, or when the last page of one snapshot has come: the
owner loads the pages, then the stream applies the buffered batches after the snapshot's
``seq`` in order (:meth:`Resync.release`); a hole among them starts the next resync with
the batches from the hole on.

Invariants:

- the stream is RESYNCING exactly while it holds a :class:`Resync`, and only a resync
  holds buffered batches: dropping one drops (and the stream counts) its buffer;
- the pages held are all of one snapshot (one ``page_epoch``, one ``base_seq``) and
  ``cursor`` is the next page's: a page of another snapshot restarts the paging at 0, one
  naming a next cursor not past its own drops the pages and retries the snapshot;
- a :class:`ResyncBuffer` holds each ``seq`` once and stays within its bounds, but for
  one batch, always taken however large (the buffer must be able to progress).

Time comes from the caller; nothing here does I/O.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Generic, TypeVar

from kvhint.router.kv_index.stream_types import BatchVerdict, StreamConfig, StreamCounters

T = TypeVar("T")


@dataclass(slots=True)
class BufferedBatch(Generic[T]):
    """A batch held during a resync."""

    seq: int
    item: T
    size: int = 0


class ResyncBuffer(Generic[T]):
    """The batches held while a resync runs, to apply after its snapshot.

    Bounded by ``max_batches`` and by ``max_bytes`` of payload (their ``size``; see
    :class:`StreamConfig`). The caller refuses a seq held already (:meth:`holds`).
    ``max_seq`` is the largest seq held (0: none), and ``bytes`` the sizes' total.
    """

    __slots__ = ("max_batches", "max_bytes", "_batches", "max_seq", "bytes")

    def __init__(self, max_batches: int, max_bytes: int,
                 held: Iterable[BufferedBatch[T]] = ()) -> None:
        self.max_batches = max_batches
        self.max_bytes = max_bytes
        self._batches: list[BufferedBatch[T]] = list(held)
        self.max_seq = max((b.seq for b in self._batches), default=0)
        self.bytes = sum(b.size for b in self._batches)

    def __len__(self) -> int:
        return len(self._batches)

    def holds(self, seq: int) -> bool:
        return seq <= self.max_seq and any(b.seq == seq for b in self._batches)

    def push(self, seq: int, item: T, size: int) -> bool:
        """Hold a batch not held yet; False (nothing held) when the buffer is full."""
        # One batch is always taken, however large: the buffer must be able to progress.
        if len(self._batches) >= self.max_batches or (
                self._batches and self.bytes + size > self.max_bytes):
            return False
        self._batches.append(BufferedBatch(seq, item, size))
        self.bytes += size
        self.max_seq = max(self.max_seq, seq)
        return True

    def take_sorted(self) -> list[BufferedBatch[T]]:
        """Every batch held, by seq; the buffer is left empty."""
        batches = sorted(self._batches, key=lambda b: b.seq)
        self.drop()
        return batches

    def drop(self) -> int:
        """Empty the buffer; returns how many batches it dropped (the caller counts them)."""
        dropped = len(self._batches)
        self._batches.clear()
        self.max_seq = 0
        self.bytes = 0
        return dropped


class Resync(Generic[T]):
    """One resync in progress (see the module doc); counts into its stream's counters.

    ``held``: batches buffered by the resync before it (a hole after its snapshot).
    """

    __slots__ = ("reason", "started_at", "cursor", "awaiting_since", "retry_at", "page_epoch",
                 "base_seq", "pages", "view_purged", "buffer", "failures_in_row", "_config",
                 "_counters")

    def __init__(self, reason: str, started_at: float, config: StreamConfig,
                 counters: StreamCounters, held: Iterable[BufferedBatch[T]] = ()) -> None:
        self.reason = reason
        self.started_at = started_at
        self.cursor = 0
        self.awaiting_since: float | None = None  # a page request is out
        self.retry_at: float | None = None        # set after a failure
        self.failures_in_row = 0                  # failed requests since the last page
        self.page_epoch: str | None = None
        self.base_seq: int | None = None          # the snapshot's seq (every page's)
        self.pages: list[object] = []
        self.view_purged = False                  # the stale view was purged (stalled)
        self.buffer: ResyncBuffer[T] = ResyncBuffer(config.max_buffered_batches,
                                                    config.max_buffered_bytes, held)
        self._config = config
        self._counters = counters

    # --- the snapshot's paging --------------------------------------------------------

    @property
    def paging_seq(self) -> int | None:
        """The seq of the snapshot being paged (None before its first page)."""
        return self.base_seq if self.cursor else None

    def page_requested(self, now: float) -> None:
        self.awaiting_since = now

    def request_failed(self, now: float) -> None:
        """The page request failed (the worker's refusal, such as its "inbox full"
        answered at once, a NATS error, a timeout): retried (from :meth:`due`) after
        ``snapshot_retry_s``, doubled for each failure in a row since the last page, up to
        ``snapshot_retry_max_s``: a busy worker is asked again soon, not hammered."""
        self._counters.snapshot_failures += 1
        self.awaiting_since = None
        config = self._config
        delay = min(config.snapshot_retry_s * 2.0 ** min(self.failures_in_row, 30),
                    max(config.snapshot_retry_s, config.snapshot_retry_max_s))
        self.failures_in_row += 1
        self.retry_at = now + delay

    def retry_soon(self, now: float) -> None:
        """The page request got a reply the stream refuses (another engine's under the
        worker's id): asked again after ``snapshot_retry_s``; not a failure."""
        self.awaiting_since = None
        self.retry_at = now + self._config.snapshot_retry_s

    def take_page(self, epoch: str, seq: int, cursor: int, next_cursor: int | None,
                  page: object, now: float) -> tuple[str, list[object] | None]:
        """The page awaited (at ``cursor``, of a source the stream takes). Returns
        ("invalid"|"restart"|"more"|"done", the pages when done).

        "invalid": the page names a next cursor not past its own; paging it on would ask
        for the same pages for ever, keeping each copy. The pages so far are dropped and
        the snapshot is retried from cursor 0 after ``snapshot_retry_s`` (from
        :meth:`due`), as after a failed request.

        "restart": the page is of another snapshot than the pages before it (another
        epoch, or another ``seq``: a late reply to an earlier request, or the worker
        took a new snapshot meanwhile); pagination restarts at 0. A snapshot's cursors
        hold only within it, so pages of two were joined with blocks lost or kept wrongly,
        and the stream then reported live.
        """
        self._counters.snapshot_pages += 1
        self.awaiting_since = None
        self.failures_in_row = 0
        if next_cursor is not None and next_cursor <= cursor:
            self._counters.snapshot_pages_invalid += 1
            self._counters.snapshot_failures += 1
            self._restart_paging()
            self.retry_at = now + self._config.snapshot_retry_s
            return "invalid", None
        if self.page_epoch is not None and (epoch != self.page_epoch or seq != self.base_seq):
            self._restart_paging()
            return "restart", None
        self.page_epoch = epoch
        self.base_seq = seq
        self.pages.append(page)
        if next_cursor is not None:
            self.cursor = next_cursor
            return "more", None
        return "done", self.pages

    def due(self, now: float) -> tuple[str | None, bool]:
        """Its timers. Returns (why the worker's stale view is to be purged now: once, when
        the resync has run past ``resync_view_trust_s``; whether to request a page now: a
        retry is due, or the page awaited is past ``snapshot_timeout_s``, a failure)."""
        stalled = None
        if not self.view_purged and now - self.started_at > self._config.resync_view_trust_s:
            self.view_purged = True
            self._counters.stalled_resync_purges += 1
            stalled = (f"resync stalled for {now - self.started_at:.1f}s ({self.reason}): "
                       f"stale view dropped")
        if self.retry_at is not None and now >= self.retry_at:
            self.retry_at = None
            return stalled, True
        if (self.awaiting_since is not None
                and now - self.awaiting_since > self._config.snapshot_timeout_s):
            self._counters.snapshot_failures += 1
            return stalled, True
        return stalled, False

    def _restart_paging(self) -> None:
        self.cursor, self.pages, self.base_seq, self.page_epoch = 0, [], None, None

    # --- the batches buffered meanwhile ----------------------------------------------

    def take_batch(self, seq: int, item: T, size: int) -> BatchVerdict:
        """Buffer a batch (the caller has refused duplicates); counted."""
        if not self.buffer.push(seq, item, size):
            self._counters.overflow_dropped += 1
            return BatchVerdict.OVERFLOW
        self._counters.buffered += 1
        return BatchVerdict.BUFFERED

    def release(self) -> tuple[list[T], list[BufferedBatch[T]]]:
        """After the snapshot (``base_seq``) is loaded, empty the buffer. Returns the items
        of the batches that follow the snapshot without a hole, in order (counted as
        applied), and the batches from the first hole on (empty: none; the hole counted as
        a gap). Batches the snapshot covers are dropped, counted."""
        assert self.base_seq is not None
        applied = self.base_seq
        ready: list[T] = []
        buffered = self.buffer.take_sorted()
        for i, entry in enumerate(buffered):
            if entry.seq <= applied:
                self._counters.covered_by_snapshot += 1
                continue
            if entry.seq != applied + 1:
                self._counters.gaps += 1
                self._counters.missing_batches += entry.seq - applied - 1
                return ready, buffered[i:]
            applied = entry.seq
            self._counters.batches_applied += 1
            ready.append(entry.item)
        return ready, []
