"""What the event ingestor asks its owner (the router service, or the simulator) to do.

The ingestor is pure: it never sends a message. Each ``on_*`` call returns a list of these
actions; the owner performs the I/O and reports back (``on_snapshot_page`` /
``on_snapshot_failed``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RequestSnapshot:
    """Ask ``worker_id`` for one snapshot page (``kvhint.v1.snapshot.<w>`` request/reply
    with ``SnapshotRequest(cursor, limit)``) and pass the reply to
    ``KvEventIngestor.on_snapshot_page`` (or the error to ``on_snapshot_failed``)."""

    worker_id: str
    cursor: int
    limit: int
    reason: str
    # The seq of the snapshot a page after the first continues (SnapshotRequest.seq).
    seq: int | None = None


@dataclass(frozen=True, slots=True)
class WorkerPurgedNotice:
    """The index forgot a worker's cache (engine restart, dead worker, resync start):
    the owner may log it, update metrics or re-plan hints for its sessions."""

    worker_id: str
    reason: str


@dataclass(frozen=True, slots=True)
class WorkerDead:
    """No heartbeat for ``silence_s`` (over the allowed misses): the worker is purged from
    the index and should not be routed to until it is heard again."""

    worker_id: str
    silence_s: float


@dataclass(frozen=True, slots=True)
class WorkerAlive:
    """A worker was heard (first time, or again after being declared dead)."""

    worker_id: str
    epoch: str


@dataclass(frozen=True, slots=True)
class WorkerIdConflict:
    """Two engines heartbeat under ``worker_id`` (reported once per conflict, once heard
    side by side for ``conflict_confirm_s``; see :mod:`.stream_sources`): the index
    follows ``epoch``, whose heartbeat gives ``url``, and refuses ``other_epoch``'s
    (``other_url``; None: the heartbeat names none). The owner warns: the servers need
    distinct worker ids."""

    worker_id: str
    epoch: str
    url: str | None
    other_epoch: str
    other_url: str | None


IngestAction = RequestSnapshot | WorkerPurgedNotice | WorkerDead | WorkerAlive | WorkerIdConflict
