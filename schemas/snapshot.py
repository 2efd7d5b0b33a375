"""Snapshot request/reply on ``<prefix>.v1.snapshot.<worker>``.

A router that starts late, sees a sequence gap or a new epoch asks for the worker's full
residency and session index, page by page (NATS messages are bounded), then continues
from the event stream after ``seq``. A request the worker cannot serve now is answered
:class:`SnapshotRefused` (:func:`decode_snapshot_reply` reads either reply).
"""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta

from kvhint.schemas._codec import WireDecodeError, decode_json, encode_json
from kvhint.schemas.status import Epoch

MAX_SNAPSHOT_PAGE = 50_000
SNAPSHOT_REFUSED_VERSION = "1.0"


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


class SnapshotRefused(msgspec.Struct, frozen=True, kw_only=True):
    """The reply to a snapshot request the worker cannot serve now: its inbox full
    (``REJECTED_INBOX_FULL`` ...), the request malformed, or the plugin failing on it.
    The router counts it (``resyncs{result="refused"}``), logs ``error`` and asks again
    (after 1 s, doubled at each failure in a row up to its ``snapshot_retry_max_s``).

    Versions: 1.0 (this). ``error`` is the key of the untyped reply plugins sent before
    it (``{"error": "..."}``, nothing else): a router reads that as a refusal too (no
    ``version`` on the wire: read as 1.0; ``worker_id`` None). A router before it reads
    this reply as a page, which it is not (no ``epoch``, ``seq``, ``blocks``...): its
    request failed, asked again as before. New optional fields may follow (a receiver
    ignores fields it does not know). Golden JSON: ``tests/golden/snapshot_refused.json``."""

    version: str = SNAPSHOT_REFUSED_VERSION
    # None: the untyped reply of a plugin before 1.0.
    worker_id: str | None = None
    # Why, for the router's log (free text; the sender's, so shown repr'd and cut short).
    error: str


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


def encode_snapshot_refused(refused: SnapshotRefused) -> bytes:
    return encode_json(refused)


def decode_snapshot_refused(data: bytes | str) -> SnapshotRefused:
    return decode_json(data, SnapshotRefused, "snapshot refusal")


def decode_snapshot_reply(data: bytes | str) -> WorkerSnapshot | SnapshotRefused:
    """A snapshot request's reply: a page, or the worker's refusal (1.0, or the untyped
    ``{"error": ...}`` before it).
    Anything else raises the page's :class:`WireDecodeError`. A page is tried first (a
    refusal is decoded again only once that failed: the page is the large one)."""
    try:
        return decode_snapshot(data)
    except WireDecodeError as exc:
        page_error = exc
    try:
        return decode_snapshot_refused(data)
    except WireDecodeError:
        raise page_error from page_error.__cause__
