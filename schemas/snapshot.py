"""Snapshot request/reply on ``<prefix>.v1.snapshot.<worker>``.

A router that starts late, sees a sequence gap or a new epoch asks for the worker's full
residency and session index, page by page (NATS messages are bounded), then continues
from the event stream after ``seq``.
"""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta

from kvhint.schemas._codec import decode_json, encode_json
from kvhint.schemas.status import Epoch

MAX_SNAPSHOT_PAGE = 50_000


class SnapshotRequest(msgspec.Struct, frozen=True, kw_only=True):
    """A page of the worker's snapshot. ``cursor`` 0 takes a new snapshot; a later page
    names the ``seq`` of the snapshot it continues (its first page's), so that routers
    paging at once each continue their own. ``seq`` None (routers before it): the
    worker's latest snapshot. A snapshot the worker no longer keeps is answered from a
    new one (another ``seq``: the router starts its paging over)."""

    cursor: Annotated[int, Meta(ge=0)] = 0
    limit: Annotated[int, Meta(gt=0, le=MAX_SNAPSHOT_PAGE)] = 20_000
    seq: Annotated[int, Meta(ge=0)] | None = None


class SnapshotBlock(msgspec.Struct, frozen=True, array_like=True):
    """``[hash, parent_hash | null, medium]``, parents listed before children."""

    block_hash: int
    parent_hash: int | None
    medium: str


class SnapshotSession(msgspec.Struct, frozen=True, array_like=True):
    """``[session_id, [frontier hash, ...]]``: the deepest resident block of each branch."""

    session_id: str
    frontiers: list[int]


class WorkerSnapshot(msgspec.Struct, frozen=True, kw_only=True):
    """One page of a worker's residency and session index.

    ``blocks`` lists a GPU-resident block once (the router keeps GPU residency as a set
    and reads a repeat as a duplicate store), and a block in any other medium (CPU,
    STORAGE, ...; medium names compare in any case) once per copy the worker holds there:
    the router counts references in those tiers, as vLLM's offloading connector
    announces a hash once per chunk holding it and removes it as often, so a hash listed
    twice there is two references, and a router resyncing from the snapshot ends with the
    counts of one that followed the event stream. A block both on GPU and in another
    medium appears once for the GPU and once per copy in the other."""

    worker_id: str
    epoch: Epoch
    # The last event sequence number this page reflects; replay events after it.
    seq: Annotated[int, Meta(ge=0)]
    block_size: int
    blocks: list[SnapshotBlock]
    sessions: list[SnapshotSession]
    # Cursor for the next page, None on the last page.
    next_cursor: int | None = None


def encode_snapshot_request(request: SnapshotRequest) -> bytes:
    return encode_json(request)


def decode_snapshot_request(data: bytes | str) -> SnapshotRequest:
    if not data:
        return SnapshotRequest()
    return decode_json(data, SnapshotRequest, "snapshot request")


def encode_snapshot(snapshot: WorkerSnapshot) -> bytes:
    return encode_json(snapshot)


def decode_snapshot(data: bytes | str) -> WorkerSnapshot:
    return decode_json(data, WorkerSnapshot, "worker snapshot")
