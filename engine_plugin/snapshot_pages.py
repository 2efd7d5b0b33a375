"""Snapshots served in pages: the snapshots kept for their later pages, and one page's
encoding. Runs on the transport (NATS) thread, off the scheduler thread.

Routers paging at once (replicas resyncing one worker) each continue their own snapshot
(``SnapshotRequest.seq``): a few are kept, for a while, within a bound on their blocks.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from kvhint.engine_plugin.mailbox import SnapshotOut
from kvhint.engine_plugin.snapshot_order import ordered_blocks
from kvhint.schemas import SnapshotBlock, SnapshotSession, WorkerSnapshot, encode_snapshot

# Snapshots kept for their later pages: a few routers resyncing at once, each for as long
# as paging a large index takes.
_SNAPSHOTS_KEPT = 3
_SNAPSHOT_KEPT_S = 120.0

OrderedBlocks = list[tuple[int, int | None, str]]


class SnapshotDropCounter(Protocol):
    snapshots_dropped: int  # let go over snapshot_keep_blocks
    snapshots_evicted: int  # let go by the count or age bound


@dataclass(slots=True, frozen=True)
class KeptSnapshot:
    snapshot: SnapshotOut
    blocks: OrderedBlocks
    taken_at: float  # monotonic


class KeptSnapshots:
    """The latest snapshots by seq, with their blocks in page order and when taken."""

    def __init__(self, max_blocks: int, counters: SnapshotDropCounter,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_blocks = max_blocks
        self.counters = counters
        self.clock = clock
        self._kept: OrderedDict[int, KeptSnapshot] = OrderedDict()

    @property
    def seqs(self) -> list[int]:
        """The kept snapshots' seqs, oldest first."""
        return list(self._kept)

    def get(self, seq: int | None) -> KeptSnapshot | None:
        """The kept snapshot of ``seq`` (None: the latest one)."""
        if seq is None:
            return next(reversed(self._kept.values()), None)
        return self._kept.get(seq)

    def keep(self, snapshot: SnapshotOut) -> OrderedBlocks:
        """``snapshot``'s blocks in page order, kept for its later pages (:meth:`kept`)."""
        return self.kept(snapshot).blocks

    def kept(self, snapshot: SnapshotOut) -> KeptSnapshot:
        """The copy every page of ``snapshot.seq`` is served from: ``snapshot``, or the
        copy of that seq kept already. Snapshots of one seq hold the same blocks (only
        events change the index): ordered once. Not the same sessions: a prefix-cache
        hit moves a session (its frontier, its place in the list) with no event, so no new
        seq; a router names the snapshot it pages by seq alone, so a page of a later copy
        of that seq would list the sessions otherwise than the pages before it, and a
        session would fall between them or be read twice. The first copy of a seq
        answers every page of it, the first pages of later requests included (their
        sessions are as old as that copy: the hits since it reach the router with the
        next snapshot of a newer seq, as the stream never carries them). Kept: the
        last ``_SNAPSHOTS_KEPT`` for ``_SNAPSHOT_KEPT_S``, and ``snapshot_keep_blocks``
        blocks in all (a 1M-block index is ~100 MB a copy); past that the oldest go,
        counted, and the latest always stays (else each of its pages would copy the
        index again on the scheduler thread). Every snapshot let go is counted: over the
        block bound in ``snapshots_dropped``, by count or age in ``snapshots_evicted``
        (a router still paging it starts over)."""
        kept = self._kept.get(snapshot.seq)
        if kept is None:
            kept = KeptSnapshot(snapshot, ordered_blocks(snapshot.raw_blocks), self.clock())
        self._kept[snapshot.seq] = kept
        self._kept.move_to_end(snapshot.seq)
        now = self.clock()
        total = sum(len(k.blocks) for k in self._kept.values())
        while len(self._kept) > 1:
            oldest = next(iter(self._kept.values()))
            over_blocks = total > self.max_blocks
            if not (over_blocks or len(self._kept) > _SNAPSHOTS_KEPT
                    or now - oldest.taken_at > _SNAPSHOT_KEPT_S):
                break
            self._kept.popitem(last=False)
            total -= len(oldest.blocks)
            if over_blocks:
                self.counters.snapshots_dropped += 1
            else:
                self.counters.snapshots_evicted += 1
        return kept


def snapshot_page(snapshot: SnapshotOut, ordered: OrderedBlocks, cursor: int, limit: int,
                  max_bytes: int, worker_id: str, epoch: str, block_size: int) -> bytes:
    """One page, encoded: items are the blocks then the sessions, ``cursor`` indexes that
    sequence; up to ``limit`` of them, halved until the page fits ``max_bytes``."""
    total = len(ordered) + len(snapshot.sessions)
    count = max(1, min(limit, total - cursor))
    while True:
        end = min(cursor + count, total)
        nb = len(ordered)
        blocks = [SnapshotBlock(*b) for b in ordered[min(cursor, nb):min(end, nb)]]
        sessions = [SnapshotSession(sid, fronts) for sid, fronts in
                    snapshot.sessions[max(cursor - nb, 0):max(end - nb, 0)]]
        body = encode_snapshot(WorkerSnapshot(
            worker_id=worker_id, epoch=epoch, seq=snapshot.seq, block_size=block_size,
            blocks=blocks, sessions=sessions, next_cursor=end if end < total else None))
        if len(body) <= max_bytes or count == 1:
            return body
        count = max(1, count // 2)
