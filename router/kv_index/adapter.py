"""Wire -> domain: vLLM event batches and snapshot pages into index events.

The only part of the index package that knows the wire contract (``kvhint.schemas``).
Batch-level fast path: one ``BlocksStored`` per vLLM ``BlockStored`` (a whole run of
hashes), and consecutive ``BlockRemoved`` events of one tier (vLLM sends one hash each)
merged into a single ``BlocksRemoved``; no per-block objects.

Dropped on purpose, and counted in :class:`AdapterCounters`: events of a KV-cache group
other than the one followed (``other_group_events``: hybrid models repeat each hash per
group and the groups evict apart; the batch's ``Kvhint-Group`` header names the group to
follow, the engine's first full-attention group, by ``schemas.events.follows_group``) and
event types we do not know.

``AllBlocksCleared`` names no medium. In vLLM 0.32 only ``BlockPool.reset_prefix_cache``
emits it, once per pool that ``KVCacheCoordinator.reset_prefix_cache`` resets, into the
one event queue: the GPU pool, and with HiSparse its host pool too. So the first clear of
a run of clears clears the GPU tier and each further one the CPU tier, the rule the
plugin reads its own stream by (``schemas.events.cleared_medium``). (Two resets of a
GPU-only engine with no step between them, an idle engine, read the same way: the CPU
tier's view is lost, a false miss.)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvhint.router.kv_index.events import (
    TIER_GPU,
    TIER_OTHER,
    TIERS,
    AllBlocksCleared,
    BlocksRemoved,
    BlocksStored,
    IndexEvent,
    SnapshotBlock,
    SnapshotLoaded,
    tier_of_medium,
)
from kvhint.schemas import events as wire
from kvhint.schemas.events import external_hash_to_int
from kvhint.schemas.snapshot import WorkerSnapshot


@dataclass(slots=True)
class AdapterCounters:
    batches: int = 0
    events: int = 0
    decode_errors: int = 0
    unknown_events: int = 0
    other_group_events: int = 0
    unknown_medium_events: int = 0
    # A session a snapshot listed again (on another page, or twice on one), or a frontier
    # listed twice in one session's entry: read once (:func:`snapshot_to_event`).
    snapshot_session_repeats: int = 0


def _ints(values: Sequence[int | bytes]) -> Sequence[int]:
    """Every hash as an int. Publishers send all ints (vLLM's default) or all bytes; a run
    that mixes them is converted element by element (the type check runs in C), so no
    bytes key ever reaches the index."""
    if not values or (type(values[0]) is int and bytes not in set(map(type, values))):
        return values  # type: ignore[return-value]
    return [external_hash_to_int(v) for v in values]


_STORED, _REMOVED, _CLEARED = 1, 2, 3
# Event classes we understand, by identity: our summaries, our full wire types, and (by
# name, added lazily) vLLM's own classes, which share names and fields.
_KINDS: dict[type, int] = {
    wire.BlockStoredSummary: _STORED, wire.BlockRemovedSummary: _REMOVED,
    wire.AllBlocksClearedSummary: _CLEARED, wire.BlockStored: _STORED,
    wire.BlockRemoved: _REMOVED, wire.AllBlocksCleared: _CLEARED}
_KIND_BY_NAME = {"BlockStored": _STORED, "BlockRemoved": _REMOVED, "AllBlocksCleared": _CLEARED}


class EventBatchAdapter:
    """Decodes one worker's vLLM ``KVEventBatch`` payloads into domain events.

    Reuse one instance (it keeps the msgspec decoder, a small cache and the counters).
    """

    # Medium spellings remembered besides TIERS' own (a publisher inventing a new medium
    # per event must not grow the cache without bound).
    _MAX_LEARNT_MEDIUMS = 32

    def __init__(self) -> None:
        self._decoder = wire.EventSummaryDecoder()
        self.counters = AdapterCounters()
        self._tiers: dict[str | None, str] = {None: TIER_GPU, **{t: t for t in TIERS}}
        self._kinds = dict(_KINDS)

    def decode(self, worker_id: str, payload: bytes, group: int = 0) -> list[IndexEvent]:
        """Raises ``kvhint.schemas.WireDecodeError`` (counted) for undecodable bytes.
        ``group``: the KV-cache group followed (the batch's ``Kvhint-Group`` header)."""
        try:
            batch = self._decoder.decode(payload)
        except wire.WireDecodeError:
            self.counters.decode_errors += 1
            raise
        counters = self.counters
        counters.batches += 1
        counters.unknown_events += batch.unknown_events
        return self.convert_events(worker_id, batch.events, group)

    def convert_events(self, worker_id: str, events: Sequence[object],
                       group: int = 0) -> list[IndexEvent]:
        """Events as decoded by ``kvhint.schemas`` or vLLM's own event objects (the
        simulator passes those); unknown types, and events of a KV-cache group other than
        ``group``, are counted and skipped."""
        self.counters.events += len(events)
        out: list[IndexEvent] = []
        removed: list[int] = []
        removed_tier = ""
        kinds, tiers = self._kinds, self._tiers
        for ev in events:
            kind = kinds.get(type(ev)) or self._learn_kind(ev)
            if kind == _REMOVED:
                if (ev.group_idx or 0) != group:  # type: ignore[attr-defined]
                    self.counters.other_group_events += 1
                    continue
                tier = tiers.get(ev.medium) or self._tier(ev.medium)  # type: ignore[attr-defined]
                if tier != removed_tier and removed:
                    out.append(BlocksRemoved(worker_id, removed, removed_tier))
                    removed = []
                removed_tier = tier
                removed += _ints(ev.block_hashes)  # type: ignore[attr-defined]
                continue
            if kind == 0:
                continue
            if removed:
                out.append(BlocksRemoved(worker_id, removed, removed_tier))
                removed = []
            if kind == _CLEARED:
                again = bool(out) and type(out[-1]) is AllBlocksCleared
                out.append(AllBlocksCleared(worker_id, tier_of_medium(
                    wire.cleared_medium(again))))
                continue
            if (ev.group_idx or 0) != group:  # type: ignore[attr-defined]
                self.counters.other_group_events += 1
                continue
            tier = tiers.get(ev.medium) or self._tier(ev.medium)  # type: ignore[attr-defined]
            hashes = _ints(ev.block_hashes)  # type: ignore[attr-defined]
            parent = ev.parent_block_hash  # type: ignore[attr-defined]
            if parent is not None and type(parent) is not int:
                parent = external_hash_to_int(parent)
            out.append(BlocksStored(worker_id, hashes, parent, tier,
                                    ev.session_id,  # type: ignore[attr-defined]
                                    len(hashes) * ev.block_size))  # type: ignore[attr-defined]
        if removed:
            out.append(BlocksRemoved(worker_id, removed, removed_tier))
        return out

    def _learn_kind(self, ev: object) -> int:
        kind = _KIND_BY_NAME.get(type(ev).__name__, 0)
        if kind:
            self._kinds[type(ev)] = kind
        else:
            self.counters.unknown_events += 1
        return kind

    def _tier(self, medium: str | None) -> str:
        """A medium not spelt as in TIERS: another case of a known one ("cpu", as
        vLLM's Mooncake store connector sends) is that tier; only one that is none of
        them is counted unknown (kept under OTHER)."""
        tier = tier_of_medium(medium)
        if tier == TIER_OTHER and (medium or "").upper() != TIER_OTHER:
            self.counters.unknown_medium_events += 1
        elif len(self._tiers) < len(TIERS) + 1 + self._MAX_LEARNT_MEDIUMS:
            self._tiers[medium] = tier
        return tier


def snapshot_to_event(pages: Sequence[WorkerSnapshot],
                      counters: AdapterCounters | None = None) -> SnapshotLoaded:
    """Join a worker's snapshot pages into one ``SnapshotLoaded`` (pages in cursor order).

    A worker lists each session once, with each of its frontiers once. A session listed
    again (pages read from two copies of the worker's index, as a plugin before paging by
    ``seq`` served them; a worker's bug) is one session: its frontiers are those of every
    listing, each once, at its last place (most recent last). Each session listed again,
    and each frontier listed twice in one entry, is counted in
    ``counters.snapshot_session_repeats``. Before, the listings were concatenated: the
    session's placement named a frontier twice, and the copies took places of its
    branches under the index's ``max_frontiers`` (counted as frontiers dropped, a real
    branch lost with them). Blocks are taken as listed: a GPU block listed
    twice is one (the index counts the repeat as a duplicate store), a block of another
    medium listed twice two references (:class:`~kvhint.schemas.WorkerSnapshot`)."""
    if not pages:
        raise ValueError("a snapshot needs at least one page")
    worker_id = pages[0].worker_id
    blocks = [SnapshotBlock(b.block_hash, b.parent_hash, tier_of_medium(b.medium))
              for page in pages for b in page.blocks]
    sessions: dict[str, dict[int, None]] = {}
    repeats = 0
    for page in pages:
        for s in page.sessions:
            frontiers = sessions.get(s.session_id)
            if frontiers is None:
                frontiers = sessions[s.session_id] = {}
            else:
                repeats += 1
            repeats += len(s.frontiers) - len(set(s.frontiers))
            for frontier in s.frontiers:
                frontiers.pop(frontier, None)  # listed before: moved last
                frontiers[frontier] = None
    if counters is not None:
        counters.snapshot_session_repeats += repeats
    return SnapshotLoaded(worker_id, blocks,
                          tuple((sid, list(f)) for sid, f in sessions.items()))
