"""Which of the plugin's in-memory counters become which ``kvhint:*`` metric.

Every field of every ``*Counters`` dataclass of the plugin is either in :data:`EXPORTS`
(read by :func:`read_counters` into the connector stats, see :mod:`.metrics`) or in
:data:`NOT_EXPORTED` with the reason; a test holds the two to the dataclasses, so a
counter added later cannot be left out of /metrics unnoticed ("no silent drops: all
that is dropped is counted and visible"). One field feeds one series, but those in
:data:`SHARED_SERIES`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

from kvhint.engine_plugin.core import CoreCounters
from kvhint.engine_plugin.executor import ExecutorCounters
from kvhint.engine_plugin.hold_records import HoldCounters
from kvhint.engine_plugin.mailbox import MailboxCounters
from kvhint.engine_plugin.session_index import IndexCounters
from kvhint.engine_plugin.transport_counters import TransportCounters


class Export(NamedTuple):
    key: str  # a key of metrics.COUNTERS, or of metrics.LABELLED_COUNTERS with ``label``
    label: str | None = None


EXPORTS: dict[type, dict[str, Export]] = {
    CoreCounters: {
        "internal_errors": Export("internal_errors"),
        "latency_samples_dropped": Export("hint_apply_samples_dropped"),
        "events_other_group": Export("events_other_group"),
    },
    ExecutorCounters: {
        "duplicates": Export("hint_duplicates"),
        "remembered_forgotten": Export("applied_ids_forgotten"),
        "prefetch_clipped_blocks": Export("prefetch_clipped_blocks"),
        "prefetches_replaced": Export("prefetches_replaced"),
    },
    HoldCounters: {
        "released_under_pressure": Export("retained_released_under_pressure"),
        "kept_in_use_under_pressure": Export("retained_kept_in_use_under_pressure"),
        "displaced": Export("retained_displaced"),
        "released_on_reset": Export("held_released_on_reset"),
        "expired_claims": Export("claims_expired"),
        "released_gone": Export("held_blocks_gone"),
    },
    IndexCounters: {
        "events": Export("index_events"),
        "unknown_removed": Export("index_unknown_removed"),
        "unknown_hits": Export("index_unknown_hits"),
        "sessions_evicted": Export("index_sessions_evicted"),
        "frontiers_dropped": Export("index_frontiers_dropped"),
    },
    MailboxCounters: {
        "inbound_dropped": Export("inbound_dropped"),
        "outcomes_dropped": Export("outcomes_dropped"),
        "deferred_dropped": Export("deferred_dropped"),
        "in_flight_forgotten": Export("in_flight_ids_forgotten"),
        "answered_forgotten": Export("answered_ids_forgotten"),
        "releases_dropped": Export("releases_dropped"),
        "events_dropped": Export("events_dropped"),
    },
    TransportCounters: {
        "events_published": Export("events_published"),
        "outcomes_published": Export("outcomes_published"),
        "releases_published": Export("releases_published"),
        "queued_publish_errors": Export("publish_errors", "queued"),
        "heartbeat_publish_errors": Export("publish_errors", "heartbeat"),
        "snapshot_reply_errors": Export("publish_errors", "snapshot_reply"),
        "oversize_dropped": Export("publish_errors", "oversize"),
        "nats_slow_consumer_errors": Export("nats_errors", "slow_consumer"),
        "nats_other_errors": Export("nats_errors", "other"),
        "snapshots_dropped": Export("snapshots_dropped"),
        "snapshots_evicted": Export("snapshots_evicted"),
        "snapshot_requests_unanswered": Export("snapshot_requests_unanswered"),
        "stream_create_failures": Export("stream_create_failures"),
        "jetstream_unavailable": Export("jetstream_unavailable"),
        "internal_errors": Export("internal_errors"),
    },
}
# Series fed by more than one field (summed): exceptions caught in the plugin's hooks
# and in the NATS transport's publisher are one alert and one panel line.
SHARED_SERIES: frozenset[Export] = frozenset({Export("internal_errors")})

# Counted, not exported on their own: field -> why. None of these is a drop.
NOT_EXPORTED: dict[type, dict[str, str]] = {
    CoreCounters: {
        "event_batches": "KV event batches taken from vLLM: throughput, not a loss",
        "events": "KV events taken from vLLM: index_events counts them applied",
        "hits_observed": "prefix hits seen at admission: vLLM's own prefix-cache metrics",
        "hint_messages": "hints messages handled: hints_total counts their actions",
        "advice_messages": "donor advice handled: hints_total{action=kv.donor}",
        "snapshot_requests": "snapshot requests handled: throughput, not a loss",
        "apply_latencies_s": "the hint_apply_seconds histogram",
    },
    ExecutorCounters: {"outcomes": "hints_total{action,status}"},
    HoldCounters: {
        "superseded_claims": "claims replaced by the same sender's newer claim: asked for",
    },
    MailboxCounters: {
        "event_batches_dropped": "the same drops as events_dropped, by batch",
    },
    TransportCounters: {
        "connects": "nats_connected shows the connection",
        "disconnects": "nats_connected shows the connection",
        "event_batches_published": "events_published counts their events",
        "heartbeats_published": "throughput; a failed one is publish_errors{what=heartbeat}",
        "snapshot_pages": "throughput; a failed one is publish_errors{what=snapshot_reply}",
        "inbound_rejected": "the same refusals as inbound_dropped (counted by the mailbox)",
        "deferred_at_once": "hints_total{status=deferred}",
        "repeats_answered_again": "answered (their first outcome again): not a loss",
        "repeats_in_flight": "their own outcome follows: not a loss",
        "outcomes": "hints_total{action,status}",
    },
}


def read_counters(sources: Mapping[type, Any]) -> dict[str, Any]:
    """The cumulative readings of every exported counter: ``{key: n}``, and
    ``{key: {label: n}}`` for a labelled one. ``sources`` maps each class of
    :data:`EXPORTS` to its live counters object, or None (not running: zeros); a class
    missing from it is an error, not a silent gap."""
    out: dict[str, Any] = {}
    for cls, fields in EXPORTS.items():
        counters = sources[cls]
        for name, export in fields.items():
            value = getattr(counters, name) if counters is not None else 0
            if export.label is None:
                out[export.key] = out.get(export.key, 0) + value
            else:
                counts = out.setdefault(export.key, {})
                counts[export.label] = counts.get(export.label, 0) + value
    return out
