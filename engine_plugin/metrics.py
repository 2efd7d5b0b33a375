"""Plugin metrics, exposed on vLLM's own ``/metrics`` through the connector-stats path.

The plugin runs inside EngineCore, while vLLM's API server (another process) serves
``/metrics``. vLLM already carries connector telemetry across that boundary: each step
the scheduler calls ``connector.get_kv_connector_stats()``, ships the stats' ``to_dict()``
to the front end in ``SchedulerStats``, and the front end feeds it to the
``KVConnectorPromMetrics`` that the connector class built (``build_prom_metrics``). So an
operator scrapes the same vLLM endpoint as always and finds ``kvhint:*`` series there,
labelled like vLLM's own (``model_name``, ``engine``).

:class:`StatsTracker` turns the plugin's cumulative counters into the per-interval
deltas that path expects (sent at most every ``interval_s``, and only when something
changed).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from kvhint.engine_plugin.config import LOGGER_NAME
from kvhint.engine_plugin.outcome_counts import (
    KNOWN_ACTION_TYPES,
    OTHER_ACTION_TYPE,
    counted_action_type,
)
from kvhint.schemas import OutcomeStatus

logger = logging.getLogger(LOGGER_NAME)

# Cumulative counters -> Prometheus counter (name without _total; the client adds it).
COUNTERS = {
    "events_published": "Events published to NATS.",
    "events_dropped": "Events dropped (buffer full or oversized batch); the router resyncs.",
    "outcomes_published": "Hint outcomes published to NATS.",
    "outcomes_dropped": ("Final hint outcomes dropped because the outbound buffer was full "
                         "(the router never learns them; deferred ones: deferred_dropped)."),
    "inbound_dropped": ("Inbound messages (hints, donor advice, snapshot requests) rejected "
                        "because the engine inbox was full."),
    "releases_published": ("Hold-release reports published to NATS (accepted Pins/Retains "
                           "that later lost blocks unasked)."),
    "releases_dropped": "Hold-release reports dropped because the outbound buffer was full.",
    "retained_released_under_pressure": "Retained blocks released so vLLM could allocate.",
    "retained_kept_in_use_under_pressure": ("Retained blocks kept while vLLM needed memory "
                                            "(a running request, or the one allocating, "
                                            "also used them), per "
                                            "relief call."),
    "retained_displaced": ("Retained blocks given back as displaced: by a higher-priority retain "
                           "or the retain budget, or a Demote or block-hash release naming "
                           "them (what releases report as displaced; pool blocks)."),
    "claims_expired": "Pin/retain claims that reached their TTL.",
    "held_blocks_gone": ("Held blocks vLLM dropped from its prefix cache by another path "
                         "(evict_blocks after a failed KV load), and on a hybrid model the "
                         "claims' blocks whose hit needed one; their holds were given "
                         "back and reported."),
    "prefetch_clipped_blocks": ("Prefetch target blocks not waited for because the "
                                "prefetch budget was full (the Prefetch was clipped)."),
    "prefetches_replaced": ("Prefetches still waiting that a newer action under their "
                            "action id replaced (the worker had forgotten them): waited "
                            "for no more; the newer action's outcome answers the id."),
    "deferred_dropped": ("'deferred' outcomes dropped because the outbound buffer was "
                         "full (not in outcomes_dropped: the final outcome follows)."),
    "in_flight_ids_forgotten": ("Queued action ids forgotten to bound that memory (a "
                                "repeat of one that finds the inbox full is rejected)."),
    "snapshots_dropped": ("Kept snapshots dropped to stay within snapshot_keep_blocks (a "
                          "router paging one starts over)."),
    "stream_create_failures": ("The events stream was missing and could not be created: "
                               "batches went out as plain messages, not kept for replay."),
    "snapshots_evicted": ("Kept snapshots let go by their count (3) or age (120 s) bound (a "
                          "router still paging one starts over)."),
    "snapshot_requests_unanswered": ("Snapshot requests dropped unanswered: no reply "
                                     "subject, or no NATS connection."),
    "jetstream_unavailable": ("JetStream did not answer for the events stream (not enabled, "
                              "or timed out): batches went out as plain messages, not kept "
                              "for replay."),
    "index_events": "KV events applied to the session index.",
    "events_other_group": ("KV block events of a KV-cache group other than the one the "
                           "router follows (a hybrid model's, one per other group): "
                           "neither indexed nor published, by design."),
    "index_sessions_evicted": ("Sessions the session index forgot to stay within its "
                               "session bound (least recently used first): a hint naming "
                               "one finds no blocks."),
    "index_frontiers_dropped": ("Session branch tips the session index forgot to stay "
                                "within its per-session bound (oldest first): hints for the "
                                "session no longer cover that branch."),
    "index_unknown_removed": ("Block-removed events for blocks the session index did not "
                              "hold resident (ignored)."),
    "index_unknown_hits": ("Prefix hits on chains the session index did not hold resident "
                           "(ignored: the session gains no frontier)."),
    "held_released_on_reset": ("Held blocks given back for a prefix-cache reset (reported "
                               "on releases as reset)."),
    "hint_duplicates": ("Hints and donor advice repeating an answered action id: answered "
                        "the remembered outcome, not applied again."),
    "applied_ids_forgotten": ("Answered action ids the executor forgot to stay within "
                              "max_remembered_actions (a later repeat of one is applied "
                              "again)."),
    "answered_ids_forgotten": ("Answered action ids the transport forgot to stay within "
                               "max_remembered_actions (a repeat of one that finds the "
                               "inbox full is rejected, not answered its outcome again)."),
    "hint_apply_samples_dropped": ("Apply-latency samples not recorded (past 10,000 in one "
                                   "stats interval): hint_apply_seconds counts fewer "
                                   "outcomes by this many."),
    "internal_errors": ("Exceptions caught in plugin hooks (the engine kept running) or "
                        "in the NATS transport's publisher (it went on) or its loop (started "
                        "again)."),
}
# Cumulative counters with one bounded label: key -> (label, its values, documentation).
# The plugin reads them as {"<value>": n}; a value outside the list (another plugin
# build's) is shown as OTHER_LABEL, so /metrics stays bounded.
OTHER_LABEL = OTHER_ACTION_TYPE
LABELLED_COUNTERS: dict[str, tuple[str, tuple[str, ...], str]] = {
    "publish_errors": ("what", ("queued", "heartbeat", "snapshot_reply", "oversize",
                                OTHER_LABEL),
                       "Publishes NATS refused, by what: a queued outcome, release report "
                       "or event batch is put back and retried; a heartbeat or a snapshot "
                       "page is lost; oversize: an outcome or release report past NATS "
                       "max_payload even made smaller is lost."),
    "nats_errors": ("kind", ("slow_consumer", OTHER_LABEL),
                    "NATS client errors by kind; slow_consumer: the client discarded an "
                    "inbound hint, advice or snapshot request."),
}
GAUGES = {
    "pinned_blocks": ("Pool blocks pinned by hints (a hybrid model's other KV-cache groups' "
                      "included)."),
    "retained_blocks": ("Pool blocks retained (soft) by hints (a hybrid model's other KV-cache "
                        "groups' included)."),
    "index_blocks": "Blocks in the session index (resident or connecting).",
    "index_sessions": "Sessions in the session index.",
    "nats_connected": "1 when the plugin is connected to NATS.",
    "events_kept": ("1 when the plugin's latest look (at set-up, then every 60 s) found the "
                    "JetStream events stream, or created it: its KV event batches are kept "
                    "for replay."),
}
HINTS_KEY = "hints"  # {"<action_type>|<status>": n}
# The ``action`` label of kvhint:hints_total. An action's type comes from the wire (any
# string a sender wrote), so the label takes only the types this contract defines,
# "unknown" for an action that could not be identified at all, and "other" for the rest
# (outcome_counts.counted_action_type, which keys the counts as they are made): one bad
# or newer sender must not grow /metrics without bound. The outcome itself still carries
# the real type.
UNIDENTIFIED_ACTION_LABEL = "unknown"
LATENCY_KEY = "apply_latency_s"  # [seconds, ...]
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                   2.5, 5.0)
PREFIX = "kvhint:"
HINTS_METRIC = f"{PREFIX}hints"
LATENCY_METRIC = f"{PREFIX}hint_apply_seconds"


def hint_action_label(action_type: str) -> str:
    """The bounded ``action`` label for an outcome of ``action_type`` (see above)."""
    return counted_action_type(action_type) if action_type else UNIDENTIFIED_ACTION_LABEL


def hint_counts_by_label(counts: Mapping[tuple[str, str], int]) -> dict[str, int]:
    """``{(action_type, status): n}`` -> the HINTS_KEY form ``{"<label>|<status>": n}``,
    with unknown action types folded together (:func:`hint_action_label`)."""
    out: dict[str, int] = {}
    for (action_type, status), n in counts.items():
        key = f"{hint_action_label(action_type)}|{status}"
        out[key] = out.get(key, 0) + n
    return out


def exposed_names() -> set[str]:
    """Every series name the plugin's metrics show on vLLM's ``/metrics`` (what a
    dashboard or alert may query)."""
    names = {f"{PREFIX}{key}_total" for key in (*COUNTERS, *LABELLED_COUNTERS)}
    names |= {f"{PREFIX}{key}" for key in GAUGES}
    names.add(f"{HINTS_METRIC}_total")
    names.update(f"{LATENCY_METRIC}{suffix}" for suffix in ("_bucket", "_sum", "_count"))
    return names


class KvHintConnectorStats(KVConnectorStats):
    """Per-interval deltas (counters, hints by action/status, latencies) plus the
    latest gauges."""

    def reset(self) -> None:
        self.data = {}

    def is_empty(self) -> bool:
        return not self.data

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        mine, theirs = self.data, other.data
        for key, value in theirs.items():
            if key in GAUGES:
                mine[key] = value
            elif isinstance(value, dict):  # hints, labelled counters (another build's too)
                counts = mine.setdefault(key, {})
                for label, n in value.items():
                    counts[label] = counts.get(label, 0) + n
            elif isinstance(value, list):  # latencies
                mine.setdefault(key, []).extend(value)
            else:
                mine[key] = mine.get(key, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {}
        for key, value in self.data.items():
            if isinstance(value, dict):  # hints, labelled counters
                out[key] = sum(value.values())
            elif key == LATENCY_KEY:
                if value:
                    ordered = sorted(value)
                    out["apply_p50_ms"] = round(1000 * ordered[len(ordered) // 2], 3)
            else:
                out[key] = value
        return out


class KvHintPromMetrics(KVConnectorPromMetrics):
    def __init__(self, vllm_config: Any, metric_types: Mapping[type, type],
                 labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._labels = per_engine_labelvalues
        self._counters = {
            key: self._counter_cls(name=f"{PREFIX}{key}", documentation=doc,
                                   labelnames=labelnames)
            for key, doc in COUNTERS.items()}
        self._gauges = {
            key: self._gauge_cls(name=f"{PREFIX}{key}", documentation=doc,
                                 labelnames=labelnames, multiprocess_mode="mostrecent")
            for key, doc in GAUGES.items()}
        self._labelled = {
            key: (self._counter_cls(name=f"{PREFIX}{key}", documentation=doc,
                                    labelnames=[*labelnames, label]), frozenset(values))
            for key, (label, values, doc) in LABELLED_COUNTERS.items()}
        self._unknown_keys: set[str] = set()
        self._hints = self._counter_cls(
            name=HINTS_METRIC, documentation="Hint outcomes by action type and status.",
            labelnames=[*labelnames, "action", "status"])
        self._latency = self._histogram_cls(
            name=LATENCY_METRIC,
            documentation="From a hint's arrival at the plugin to its outcome.",
            labelnames=labelnames, buckets=list(LATENCY_BUCKETS))
        for labels in per_engine_labelvalues.values():
            self._create_series(labels)

    def _create_series(self, labels: list[object]) -> None:
        """Every series of one engine, at 0 from the start, as vLLM's own: a counter that
        first appears at N hides those N from ``rate()`` and ``increase()`` (the
        KvhintPluginDrops alert missed a first burst of drops), and a dashboard shows "no
        data" where it means 0. The label values are bounded (that is their design)."""
        for counter in self._counters.values():
            counter.labels(*labels)
        for gauge in self._gauges.values():
            gauge.labels(*labels)
        for counter, values in self._labelled.values():
            for value in sorted(values):
                counter.labels(*labels, value)
        for action in (*sorted(KNOWN_ACTION_TYPES), OTHER_LABEL, UNIDENTIFIED_ACTION_LABEL):
            for status in OutcomeStatus:
                self._hints.labels(*labels, action, status.value)
        self._latency.labels(*labels)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = self._labels.get(engine_idx, self._labels.get(0, []))
        for key, value in transfer_stats_data.items():
            if key in self._counters:
                if value:
                    self._counters[key].labels(*labels).inc(value)
            elif key in self._gauges:
                self._gauges[key].labels(*labels).set(value)
            elif key == HINTS_KEY:
                for label, n in value.items():
                    action, _, status = label.partition("|")
                    self._hints.labels(*labels, hint_action_label(action), status).inc(n)
            elif key in self._labelled:
                counter, values = self._labelled[key]
                for label, n in value.items():
                    if n:
                        counter.labels(*labels, label if label in values else OTHER_LABEL).inc(n)
            elif key == LATENCY_KEY:
                histogram = self._latency.labels(*labels)
                for seconds in value:
                    histogram.observe(seconds)
            elif key not in self._unknown_keys:
                # Another plugin build's stats (newer, in the engine): said once, never
                # silently ignored.
                self._unknown_keys.add(key)
                logger.warning("kvhint: connector stats carry %r, which this build does not "
                               "export on /metrics (the engine runs another kvhint version?)",
                               key)


@dataclass
class StatsTracker:
    """Builds :class:`KvHintConnectorStats` deltas from cumulative readings.

    vLLM asks for connector stats once per scheduler step; a delta is built at most once
    per ``interval_s``. A call inside the interval may leave changes unsent: ``flush_at``
    then says when the next call would send them, so an engine that went idle in between
    can be woken for one step instead of holding the figures back until its next request
    (``None``: nothing is held back)."""

    read: Callable[[], dict[str, Any]]  # cumulative counters + gauges + hints + latencies
    interval_s: float = 1.0
    flush_at: float | None = None  # monotonic seconds
    _sent: dict[str, Any] | None = None
    _at: float = 0.0

    def flush_due(self, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        return self.flush_at is not None and now >= self.flush_at

    def take(self, now: float | None = None, force: bool = False
             ) -> KvHintConnectorStats | None:
        """The delta since the last one sent, or None (nothing changed, or held back by
        the interval). ``force``: read now whatever the interval (an idle engine's extra
        step, where a reading costs nothing a request waits for)."""
        now = time.monotonic() if now is None else now
        if not force and now - self._at < self.interval_s:
            self.flush_at = self._at + self.interval_s
            return None
        self._at = now
        self.flush_at = None
        current = self.read()
        sent = self._sent or {}
        delta: dict[str, Any] = {}
        for key in COUNTERS:
            diff = current.get(key, 0) - sent.get(key, 0)
            if diff:
                delta[key] = diff
        for key in GAUGES:
            if key in current and current[key] != sent.get(key):
                delta[key] = current[key]
        for key in (HINTS_KEY, *LABELLED_COUNTERS):
            now_counts, sent_counts = current.get(key, {}), sent.get(key, {})
            counts = {k: v - sent_counts.get(k, 0) for k, v in now_counts.items()
                      if v != sent_counts.get(k, 0)}
            if counts:
                delta[key] = counts
        latencies = current.pop(LATENCY_KEY, [])
        if latencies:
            delta[LATENCY_KEY] = latencies
        self._sent = current
        return KvHintConnectorStats(data=delta) if delta else None
