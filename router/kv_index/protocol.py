"""The cluster KV index interface and the values it answers with.

Every implementation must pass the one shared suite in ``tests/unit/index/`` (parametrized
over implementations). Reads never do I/O; writes happen only through :meth:`apply`.

Semantics every implementation shares:

- GPU residency is a set per worker: storing a hash already there is a no-op (counted
  as ``duplicate_stores``), removing an absent one is a no-op (``missing_removes``). vLLM
  can hold two physical copies of one hash and re-reports reused blocks with
  ``kv_cache_report_mode="full"``; set semantics turn the rare duplicate into a false miss
  (conservative) rather than a permanent false hit.
- Every other tier (CPU, STORAGE, OTHER) counts references: each store of a hash held
  already adds one (``repeat_stores``), each removal takes one (``repeat_removes`` while
  others are left) and the hash leaves the tier with its last. vLLM's offloading tier
  announces a hash once per chunk that holds it (chunks overlapping a shared prefix that
  is not chunk-aligned, one chunk resident in several tiers of one medium) and fans a
  chunk's eviction out to all of its hashes: its events' documentation asks consumers to
  reference-count (vllm/distributed/kv_transfer/kv_connector/v1/offloading/events.py).
  With a set, the second chunk's hashes were dropped at the first one's eviction.
  A snapshot lists such a block once per reference.
- ``AllBlocksCleared`` drops one tier of the worker (the GPU's, as vLLM's does); its
  session placements go too once the worker holds no block in any tier.
- Session placements: each ``BlocksStored`` with a session id moves that session's
  frontier on the worker to the run's last hash (replacing the frontier the run extends,
  else adding a branch; at most ``max_frontiers`` per session and worker, oldest dropped).
  Sessions are bounded (least recently stored evicted first, counted). A frontier is not
  removed when its block is evicted: check :meth:`ClusterKvIndex.has_block`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol, runtime_checkable

from kvhint.router.kv_index.events import IndexEvent


class WorkerOverlap(NamedTuple):
    """How much of a block-hash chain one worker can serve without recomputing.

    ``gpu_blocks``: leading blocks resident in the worker's GPU tier (vLLM's local prefix
    hit). ``external_blocks``: the blocks right after those that sit in a non-GPU tier
    (CPU, storage), which an offloading connector would load instead of recompute.
    (A NamedTuple: a lookup builds one per matching worker, and a frozen dataclass costs
    ~1 µs each to build here.)
    """

    gpu_blocks: int
    external_blocks: int = 0

    @property
    def total_blocks(self) -> int:
        return self.gpu_blocks + self.external_blocks


NO_OVERLAP = WorkerOverlap(0, 0)


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """Result of :meth:`ClusterKvIndex.match_prefix` for one chain.

    ``workers`` holds only workers with ``total_blocks > 0``; every other worker has
    :data:`NO_OVERLAP`. Multiply by the worker's block size for tokens.
    """

    num_blocks: int
    workers: Mapping[str, WorkerOverlap]

    def of(self, worker_id: str) -> WorkerOverlap:
        return self.workers.get(worker_id, NO_OVERLAP)


@dataclass(frozen=True, slots=True)
class SessionPlacement:
    """Where a session's KV was last stored on one worker: its frontier hashes (deepest
    stored block of each branch, most recent last)."""

    worker_id: str
    frontiers: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class IndexStats:
    """Size and counters; counters only grow (everything dropped is counted here)."""

    distinct_blocks: int
    entries: int  # (worker, tier, hash) residencies
    entries_by_tier: Mapping[str, int]
    workers: int
    sessions: int
    stored_blocks: int = 0
    removed_blocks: int = 0
    duplicate_stores: int = 0
    missing_removes: int = 0
    cleared_workers: int = 0
    purged_workers: int = 0
    snapshots_loaded: int = 0
    sessions_evicted: int = 0
    frontiers_dropped: int = 0
    # Reference-counted tiers: stores of a hash held already, removals that left others.
    repeat_stores: int = 0
    repeat_removes: int = 0


@dataclass(frozen=True)
class IndexState:
    """Canonical, comparable state: which (worker, tier) holds each hash (and how many
    references it has past the first in a reference-counted tier), and each session's
    frontiers per worker. Used to prove that replaying events rebuilds the index.

    Equal states answer the residency reads the same (``match_prefix``, ``tier_prefix``,
    ``locate``, ``has_block``, ``worker_block_counts``, ``worker_ids``) and hold the same
    session frontiers. Not covered: session recency. ``sessions`` maps ignore order, so two
    indexes with equal states can list a session's placements in a different order
    (``session_placements``: most recently stored worker last) and evict different
    sessions next; a snapshot restore rebuilds recency in load order, not in the order the
    live index saw. Nor the counters of :meth:`ClusterKvIndex.stats`."""

    blocks: Mapping[str, Mapping[str, frozenset[int]]] = field(default_factory=dict)
    sessions: Mapping[str, Mapping[str, tuple[int, ...]]] = field(default_factory=dict)
    # worker -> tier -> hash -> references beyond the first (reference-counted tiers).
    refs: Mapping[str, Mapping[str, Mapping[int, int]]] = field(default_factory=dict)


@runtime_checkable
class ClusterKvIndex(Protocol):
    """Block hash -> workers and tiers; session -> workers and frontiers."""

    def apply(self, event: IndexEvent) -> None:
        """Apply one domain event. Never raises for well-typed events."""

    def apply_all(self, events: Iterable[IndexEvent]) -> None:
        """Apply events in order (a batch fast path where the implementation has one)."""

    def match_prefix(self, block_hashes: Sequence[int]) -> PrefixMatch:
        """Per-worker longest prefix of ``block_hashes`` (a request's parent-chained hash
        chain, first block first) resident on GPU, then continued in other tiers."""

    def tier_prefix(self, block_hashes: Sequence[int], tier: str) -> Mapping[str, int]:
        """Per-worker number of leading blocks of the chain resident in ``tier`` alone
        (workers with 0 left out)."""

    def locate(self, block_hash: int) -> Mapping[str, frozenset[str]]:
        """worker -> tiers holding ``block_hash`` (empty when nobody has it)."""

    def has_block(self, worker_id: str, block_hash: int, tier: str | None = None) -> bool:
        """Whether the worker holds the hash (in ``tier``, or in any tier when None)."""

    def session_placements(self, session_id: str) -> tuple[SessionPlacement, ...]:
        """The session's placements, most recently stored worker last."""

    def worker_ids(self) -> tuple[str, ...]:
        """Workers with any resident block or session placement, sorted."""

    def worker_block_counts(self, worker_id: str) -> Mapping[str, int]:
        """tier -> resident blocks on the worker (tiers with 0 left out)."""

    def stats(self) -> IndexStats:
        """Sizes and counters."""

    def export_state(self) -> IndexState:
        """The canonical state (O(size); for tests, debugging and snapshots)."""
