"""The router's metric families with their label names, from a real RouterMetrics: what
the deploy-queries test checks the dashboard and alerts against, and what the reference
test checks REFERENCE.md against."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.metrics_core import Metric

from kvhint.router.service.metrics import RouterMetrics
from kvhint.router.service.metrics_state import StateSample


def router_families() -> tuple[RouterMetrics, list[tuple[Metric, frozenset[str]]]]:
    """A RouterMetrics whose scrape-time gauges each show one series (so their labels
    show), and each family it collects with its label names ("le" left out)."""
    metrics = RouterMetrics()
    metrics.bind_state(lambda: StateSample(
        index_blocks_by_worker_tier={("w", "gpu"): 1}, sessions_by_state={"s": 1},
        workers_up={"w": (True, False)}, worker_inflight={"w": 1},
        completion_read_probability={"t": 0.5}, ingest={"x": 1}, worker_id_conflicts=("w",)))
    # A labelled family shows no sample until used, so collect() cannot say its labels:
    # prometheus_client keeps the declared names in _labelnames.
    declared = {family.name: frozenset(wrapper._labelnames)
                for wrapper in vars(metrics).values()
                if isinstance(wrapper, (Counter, Gauge, Histogram))
                for family in wrapper.describe()}
    return metrics, [
        (family, declared.get(family.name) or frozenset(
            label for sample in family.samples for label in sample.labels) - {"le"})
        for family in metrics.registry.collect()]
