"""The value types of the per-worker stream rules (:mod:`.stream`): phases, verdicts, the
tuning, a decision for the owner, and the counters. Pure data."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kvhint.schemas.status import MAX_HEARTBEAT_INTERVAL_S, MIN_HEARTBEAT_INTERVAL_S


class StreamPhase(enum.Enum):
    NEW = "new"              # never heard
    LIVE = "live"            # applying batches in order
    RESYNCING = "resyncing"  # waiting for snapshot pages; batches buffered
    # Heard (a heartbeat with last_event_seq > 0) while the feed replays the events
    # stream's history, none of its batches applied yet: waiting for them instead of a
    # snapshot. Alive; its view (empty) is not exact.
    AWAITING_REPLAY = "awaiting_replay"
    DEAD = "dead"            # silent too long; purged


class BatchVerdict(enum.Enum):
    APPLY = "apply"
    DUPLICATE = "duplicate"
    STALE_EPOCH = "stale_epoch"
    BUFFERED = "buffered"
    OVERFLOW = "overflow"    # resync buffer full: dropped (the resync will notice the hole)
    IMPLAUSIBLE = "implausible"  # seq far past what the worker's heartbeat says it sent
    # A replayed batch (older than the liveness window) of a worker declared dead: it
    # proves nothing about the worker now, and a dead worker's blocks leave the index.
    DEAD_WORKER = "dead_worker"
    # A batch of another engine publishing under this worker's id, while a conflict is
    # held and the engine followed runs (:mod:`.stream_sources`).
    OTHER_SOURCE = "other_source"


@dataclass(frozen=True, slots=True)
class StreamConfig:
    """Tuning of the stream rules; the defaults suit a heartbeat every 1-5 s."""

    heartbeat_misses: float = 3.0
    default_interval_s: float = 2.0
    max_buffered_batches: int = 10_000
    # The buffer's payload bytes are bounded too: a vLLM batch carries the token ids of
    # every block it stores, so the batch bound alone let a resyncing worker hold
    # gigabytes (10,000 batches of up to NATS's 1 MiB). Past either bound a batch is
    # dropped (counted as overflow) and the resync notices the hole it leaves.
    max_buffered_bytes: int = 128 << 20
    snapshot_page_limit: int = 20_000
    snapshot_retry_s: float = 1.0
    # Failed page requests in a row (a worker answering "inbox full" at once, NATS
    # errors) are asked again after snapshot_retry_s, doubled at each failure up to this.
    snapshot_retry_max_s: float = 8.0
    snapshot_timeout_s: float = 10.0
    # How long a heartbeat's last_event_seq may run ahead of what we applied before we
    # treat the difference as lost batches. None: one heartbeat interval.
    tail_gap_grace_s: float | None = None
    max_retired_epochs: int = 8
    # A batch numbered this far past the last heartbeat's last_event_seq cannot be the
    # worker's (it publishes at most one batch per engine step, a few hundred between
    # heartbeats): dropped and counted. Taken for a gap, one such batch sent the worker
    # into resyncs forever, every snapshot ending in a "hole" before it.
    max_seq_ahead_of_heartbeat: int = 100_000
    # A worker dead (silent) this long is forgotten by the ingestor: its stream state,
    # kept so far to refuse its old engines' replayed messages, goes. Past the events
    # stream's age limit (1 h by default) no such message is left to replay.
    forget_dead_after_s: float = 3600.0
    # A resync unfinished this long after it began purges the worker's stale view (once
    # per resync; the resync goes on). Long enough for a snapshot to be retried a few
    # times (snapshot_timeout_s, snapshot_retry_s), short against how fast a busy
    # worker's cache turns over.
    resync_view_trust_s: float = 30.0
    # A LIVE stream's view is exact while the worker was heard within this many of its
    # heartbeat intervals (one heartbeat late is jitter; more, the stream may be lagging
    # or the plugin gone; heartbeat_misses later it is declared dead and purged).
    exact_heartbeat_misses: float = 1.5
    # How long the feed's replay of the events stream's history (at a router's start, or
    # its NATS link set up again) is waited for: meanwhile a worker heard but none of its
    # batches applied waits for them instead of resyncing (AWAITING_REPLAY), and tail gaps
    # are not judged. Past it the replay is taken as over: the workers still waiting
    # resync, as all did before. A fixed time, not heartbeat intervals: it bounds the
    # replay, whose length is set by the stream's size, not by the workers' intervals. A
    # full default stream (1 GiB of ~700-byte batches) replayed in ~30 s on a 2-core host
    # (~54k batches/s); 60 s leaves room for a slower one, and a replay that stalls for
    # good leaves a worker without a view for a minute, not for ever.
    replay_wait_s: float = 60.0
    # How long a conflict over a worker's id (two engines heartbeating under it,
    # :mod:`.stream_sources`) is held after the other engine was last heard: longer than
    # a vLLM server's restart, so the other server restarting does not end it and make
    # its new engine take the id (a purge and a snapshot at each such swap). The
    # router's setting of the same name.
    conflict_hold_s: float = 600.0
    # How long two engines must be heard side by side under one id before the conflict
    # is reported (warned of, shown, held conflict_hold_s); until then it ends once the
    # other is silent for its liveness window. Longer than a surge rollout's overlap
    # (the new pod heartbeats from its start, the old one until it has drained: its
    # terminationGracePeriodSeconds, 30 s by default). The router's setting of the name.
    conflict_confirm_s: float = 300.0


@dataclass(frozen=True, slots=True)
class Decision:
    """What the owner must do besides applying/buffering the batch."""

    verdict: BatchVerdict | None = None
    purge_reason: str | None = None   # purge the worker from the index first
    resync_reason: str | None = None  # then start a snapshot resync
    # A conflict over the worker's id was found (once per conflict): the owner warns.
    id_conflict: bool = False


@dataclass(slots=True)
class StreamCounters:
    batches_applied: int = 0
    duplicates: int = 0
    stale_epoch: int = 0
    buffered: int = 0
    overflow_dropped: int = 0
    covered_by_snapshot: int = 0
    gaps: int = 0
    missing_batches: int = 0
    epoch_changes: int = 0
    resyncs_started: int = 0
    resyncs_completed: int = 0
    snapshot_pages: int = 0
    snapshot_pages_ignored: int = 0
    # Pages refused for a next cursor not past their own (the snapshot is retried).
    snapshot_pages_invalid: int = 0
    snapshot_failures: int = 0
    deaths: int = 0
    stale_status: int = 0
    # Heartbeats whose interval_s was out of the plugin's bounds, taken at the nearest
    # bound (stream._interval): a plugin sending one is misconfigured or not ours.
    status_interval_bounded: int = 0
    implausible_seq: int = 0
    # Resyncs that outlasted resync_view_trust_s: the worker's stale view was purged.
    stalled_resync_purges: int = 0
    # Batches dropped because their worker is gone: buffered ones of a worker declared
    # dead or removed from the configuration, and replayed (aged) ones that arrive once it
    # is dead. Not stale_epoch: their epoch may well be the worker's current one.
    dead_worker_dropped: int = 0
    # Bookkeeping of the replay waits (AWAITING_REPLAY): heartbeats during a replay that
    # waited for the worker's replayed batches instead of starting a resync; waits that
    # the replay ended from the epoch's seq 1 (no snapshot needed); waits ended by
    # replay_wait_s (a resync then, as before). A wait the replay ends with none of the
    # worker's batches, or from mid-epoch, resyncs (resyncs_started, "mid-stream").
    resyncs_deferred: int = 0
    resyncs_avoided: int = 0
    replay_waits_expired: int = 0
    # Conflicts reported over the worker's id (two engines heartbeating under it), and the
    # heartbeats and batches of a newer epoch refused as the other engine's while one is
    # held (of a retired or older epoch: stale_status and stale_epoch, as before; its
    # snapshot replies: snapshot_pages_ignored).
    id_conflicts: int = 0
    other_source_dropped: int = 0
    # Conflicts found that ended unreported (the other engine silent for its window
    # before conflict_confirm_s): a rollout's old engine draining beside the new one.
    id_conflicts_unconfirmed: int = 0


def heartbeat_interval(interval_s: float, default_s: float) -> float:
    """A heartbeat's ``interval_s`` as a liveness window uses it: within the bounds a
    plugin may be configured with (schemas.status), ``default_s`` for 0 or less. Before,
    any positive value was taken: 1e-9 purged a live worker between two beats, 1e9
    trusted a dead one's view for good (the stream counts one out of bounds)."""
    if interval_s <= 0:
        return default_s
    return min(max(interval_s, MIN_HEARTBEAT_INTERVAL_S), MAX_HEARTBEAT_INTERVAL_S)
