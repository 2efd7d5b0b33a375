"""Domain events of the cluster KV index: what happened to which worker's cache.

Pure data, no wire format: the adapter (:mod:`kvhint.router.kv_index.adapter`) turns vLLM's
msgpack ``KVEventBatch`` payloads, snapshot pages and heartbeats into these, and the
simulator may build them directly. An index is a pure function of the sequence of events it
applied: replaying the same events into a fresh index gives the same state (tested).

Events are batch-shaped on purpose (one ``BlocksStored`` carries a whole parent-chained run
of hashes, one ``BlocksRemoved`` many hashes) so ingestion does not allocate an object per
block. They are immutable by contract but not ``frozen``: a frozen dataclass takes ~4x
longer to build (2 µs here), which is a tenth of the ingestion budget per block run.
Never mutate an event (or its hash list) after handing it to an index: replay relies on it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# Tiers are vLLM's ``medium`` strings, compared without case: vLLM's own are upper case
# ("GPU", "CPU", "STORAGE", vllm.distributed.kv_events.MEDIUM_*), but its Mooncake store
# connector publishes "cpu". ``None`` from vLLM means the GPU pool.
TIER_GPU = "GPU"
TIER_CPU = "CPU"
TIER_STORAGE = "STORAGE"
# Any other medium string a publisher may invent is kept under this tier (and counted).
TIER_OTHER = "OTHER"
TIERS: tuple[str, ...] = (TIER_GPU, TIER_CPU, TIER_STORAGE, TIER_OTHER)


def index_tier(tier: str) -> str:
    """``tier`` as the index keeps it: one of TIERS (any case), anything else OTHER."""
    if tier in TIERS:
        return tier
    tier = tier.upper()
    return tier if tier in TIERS else TIER_OTHER


def tier_of_medium(medium: str | None) -> str:
    """vLLM ``medium`` -> index tier: ``None`` is GPU, unknown strings are ``OTHER``."""
    return TIER_GPU if medium is None else index_tier(medium)


@dataclass(slots=True)
class BlocksStored:
    """A worker cached a parent-chained run of full blocks in ``tier``.

    ``block_hashes[0]``'s parent is ``parent_hash`` (None: the run starts the chain) and each
    later hash's parent is the one before it. ``session_id`` is the worker-visible session
    id of the request that stored them (None when the request had none). ``num_tokens`` is
    the number of tokens the run covers (len(block_hashes) * block_size for vLLM).
    """

    worker_id: str
    block_hashes: Sequence[int]
    parent_hash: int | None
    tier: str = TIER_GPU
    session_id: str | None = None
    num_tokens: int = 0


@dataclass(slots=True)
class BlocksRemoved:
    """A worker dropped these hashes from ``tier`` (evicted or replaced)."""

    worker_id: str
    block_hashes: Sequence[int]
    tier: str = TIER_GPU


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """Every block of the worker's ``tier`` is gone: vLLM's ``AllBlocksCleared``, which
    names no medium and comes from ``BlockPool.reset_prefix_cache``, the GPU pool's
    (vLLM 0.32). Other tiers keep their blocks: the offloading connector's host tier is
    reset by ``reset_cache`` (only with ``reset_connector``) and announces no event at
    all. The adapter maps a second clear of one batch to the CPU tier (HiSparse's host
    pool, see :mod:`.adapter`)."""

    worker_id: str
    tier: str = TIER_GPU


@dataclass(frozen=True, slots=True)
class WorkerPurged:
    """Forget everything about a worker: blocks in every tier and its session placements.
    Used on an engine restart (new epoch), a dead worker, or before a resync."""

    worker_id: str
    reason: str = ""


@dataclass(frozen=True, slots=True)
class SnapshotBlock:
    """One resident block in a snapshot; parents are listed before their children."""

    block_hash: int
    parent_hash: int | None
    tier: str = TIER_GPU


@dataclass(frozen=True, slots=True)
class SnapshotLoaded:
    """Replace a worker's whole state with a snapshot (all pages joined).

    ``sessions`` maps each worker-visible session id to its frontier hashes (the deepest
    resident block of each branch, most recent last).
    """

    worker_id: str
    blocks: Sequence[SnapshotBlock]
    sessions: Sequence[tuple[str, Sequence[int]]] = ()


IndexEvent = BlocksStored | BlocksRemoved | AllBlocksCleared | WorkerPurged | SnapshotLoaded
