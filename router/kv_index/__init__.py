"""The router's cluster KV index (DESIGN §4): block hash -> workers and tiers, session ->
workers and frontiers, fed by the workers' KV event streams.

Layers (llm-d style): :mod:`.events` (pure domain events) -> :mod:`.protocol` (the
``ClusterKvIndex`` interface) with :class:`InMemoryClusterKvIndex` (fast) and
:class:`NaiveClusterKvIndex` (reference/baseline); :mod:`.adapter` turns wire messages
into domain events; :mod:`.stream` keeps each worker's stream ordered and consistent;
:class:`KvEventIngestor` ties them together for the service. No NATS, HTTP or msgpack in
the index itself.
"""

from kvhint.router.kv_index.actions import (
    IngestAction,
    RequestSnapshot,
    WorkerAlive,
    WorkerDead,
    WorkerIdConflict,
    WorkerPurgedNotice,
)
from kvhint.router.kv_index.adapter import AdapterCounters, EventBatchAdapter, snapshot_to_event
from kvhint.router.kv_index.events import (
    TIER_CPU,
    TIER_GPU,
    TIER_OTHER,
    TIER_STORAGE,
    TIERS,
    AllBlocksCleared,
    BlocksRemoved,
    BlocksStored,
    IndexEvent,
    SnapshotBlock,
    SnapshotLoaded,
    WorkerPurged,
    tier_of_medium,
)
from kvhint.router.kv_index.ingest import (
    IdConflictView,
    IngestStats,
    KvEventIngestor,
    WorkerStreamView,
)
from kvhint.router.kv_index.memory import InMemoryClusterKvIndex
from kvhint.router.kv_index.naive import NaiveClusterKvIndex
from kvhint.router.kv_index.protocol import (
    NO_OVERLAP,
    ClusterKvIndex,
    IndexState,
    IndexStats,
    PrefixMatch,
    SessionPlacement,
    WorkerOverlap,
)
from kvhint.router.kv_index.stream import BatchVerdict, StreamConfig, StreamPhase, WorkerStream

__all__ = [
    "NO_OVERLAP",
    "TIERS",
    "TIER_CPU",
    "TIER_GPU",
    "TIER_OTHER",
    "TIER_STORAGE",
    "AdapterCounters",
    "AllBlocksCleared",
    "BatchVerdict",
    "BlocksRemoved",
    "BlocksStored",
    "ClusterKvIndex",
    "EventBatchAdapter",
    "InMemoryClusterKvIndex",
    "IdConflictView",
    "IndexEvent",
    "IndexState",
    "IndexStats",
    "IngestAction",
    "IngestStats",
    "KvEventIngestor",
    "NaiveClusterKvIndex",
    "PrefixMatch",
    "RequestSnapshot",
    "SessionPlacement",
    "SnapshotBlock",
    "SnapshotLoaded",
    "StreamConfig",
    "StreamPhase",
    "WorkerAlive",
    "WorkerDead",
    "WorkerIdConflict",
    "WorkerOverlap",
    "WorkerPurged",
    "WorkerPurgedNotice",
    "WorkerStream",
    "WorkerStreamView",
    "snapshot_to_event",
    "tier_of_medium",
]
