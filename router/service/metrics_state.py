"""Scrape-time gauges: what mirrors the router's in-memory state (index size, sessions,
workers, pending hints, the ingestor's counters), read from a :class:`StateSample` the
runtime builds on demand, so the request path never updates them (metrics.py binds it)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector


@dataclass(frozen=True, slots=True)
class StateSample:
    """What the scrape-time collector reports; built by the runtime on demand."""

    index_blocks_by_worker_tier: dict[tuple[str, str], int] = field(default_factory=dict)
    index_distinct_blocks: int = 0
    sessions_by_state: dict[str, int] = field(default_factory=dict)
    workers_up: dict[str, tuple[bool, bool]] = field(default_factory=dict)  # http, plugin
    worker_inflight: dict[str, int] = field(default_factory=dict)
    pending_hints: int = 0
    store_queue: int = 0
    # The index ingestor's counters (batches applied, gaps, duplicates, drops...).
    ingest: dict[str, int] = field(default_factory=dict)
    # The planner's learnt share of next turns that read the previous response's KV
    # (below one half, protections cover prompts only; policy.coverage.protected_tokens),
    # per tenant: each tenant learns its own (policy.tenant_stats). The router's tenants
    # are configured, so the label's values are bounded.
    completion_read_probability: dict[str, float] = field(default_factory=dict)
    # Workers over whose id the index holds a conflict (two engines heartbeat under it).
    worker_id_conflicts: tuple[str, ...] = ()


class StateCollector(Collector):
    """Reads a :class:`StateSample` at each scrape (no update on the request path)."""

    def __init__(self, sample: Callable[[], StateSample]) -> None:
        self._sample = sample

    def collect(self) -> Iterable[Metric]:
        s = self._sample()
        blocks = GaugeMetricFamily("kvhint_router_index_blocks",
                                   "Blocks the cluster index holds per worker and tier",
                                   labels=["worker", "tier"])
        for (worker, tier), count in sorted(s.index_blocks_by_worker_tier.items()):
            blocks.add_metric([worker, tier], count)
        yield blocks
        yield GaugeMetricFamily("kvhint_router_index_distinct_blocks",
                                "Distinct block hashes in the cluster index",
                                value=s.index_distinct_blocks)
        sessions = GaugeMetricFamily("kvhint_router_sessions", "Sessions in memory by state",
                                     labels=["state"])
        for state, count in sorted(s.sessions_by_state.items()):
            sessions.add_metric([state], count)
        yield sessions
        up = GaugeMetricFamily("kvhint_router_worker_up", "1 when the worker is usable",
                               labels=["worker", "kind"])
        inflight = GaugeMetricFamily("kvhint_router_worker_inflight",
                                     "Requests in flight per worker", labels=["worker"])
        for worker, (http_up, plugin_up) in sorted(s.workers_up.items()):
            up.add_metric([worker, "http"], int(http_up))
            up.add_metric([worker, "plugin"], int(plugin_up))
            inflight.add_metric([worker], s.worker_inflight.get(worker, 0))
        yield up
        yield inflight
        conflicts = GaugeMetricFamily(
            "kvhint_router_worker_id_conflict",
            "1 while two engines heartbeat under this worker id (once heard side by "
            "side conflict_confirm_s, 5 min by default: a rollout's overlap is not; "
            "then until the other was silent conflict_hold_s, 10 min by default): "
            "the index follows one and refuses the other's messages", labels=["worker"])
        for worker in s.worker_id_conflicts:
            conflicts.add_metric([worker], 1)
        yield conflicts
        yield GaugeMetricFamily("kvhint_router_hints_pending",
                                "Hint actions sent and awaiting a terminal outcome",
                                value=s.pending_hints)
        reads = GaugeMetricFamily("kvhint_router_completion_read_probability",
                                  "Learnt share of next turns that read the previous "
                                  "response's KV, per tenant (below 0.5 the planner "
                                  "protects that tenant's prompts only)", labels=["tenant"])
        for tenant, probability in sorted(s.completion_read_probability.items()):
            reads.add_metric([tenant], probability)
        yield reads
        yield GaugeMetricFamily("kvhint_router_store_queue",
                                "Store writes waiting for the next batch", value=s.store_queue)
        ingest = CounterMetricFamily("kvhint_router_index_ingest",
                                     "Event-stream ingestion counters (applied, gaps, "
                                     "duplicates, stale epochs, overflow and decode drops...)",
                                     labels=["what"])
        for what, value in sorted(s.ingest.items()):
            ingest.add_metric([what], value)
        yield ingest
