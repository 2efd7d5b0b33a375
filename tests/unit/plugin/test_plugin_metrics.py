"""Connector stats deltas: what vLLM ships from EngineCore to the API server's /metrics."""

from __future__ import annotations

import dataclasses
import importlib
import logging
import pkgutil
from types import SimpleNamespace
from typing import Any

import pytest

from kvhint.engine_plugin.metrics import HINTS_KEY, KvHintConnectorStats, StatsTracker


def test_deltas_are_sent_once_per_interval_and_held_back_changes_ask_for_a_flush() -> None:
    counters = {"events_published": 0, HINTS_KEY: {}}
    tracker = StatsTracker(lambda: {k: (dict(v) if isinstance(v, dict) else v)
                                    for k, v in counters.items()}, interval_s=1.0)
    counters["events_published"] = 3
    first = tracker.take(now=10.0)
    assert first is not None and first.data == {"events_published": 3}
    assert tracker.flush_at is None and not tracker.flush_due(now=10.5)

    # A hint is answered 0.2 s later: inside the interval, so it is held back...
    counters[HINTS_KEY] = {"kv.pin|accepted": 1}
    assert tracker.take(now=10.2) is None
    # ...and the tracker says when a step would ship it, so an engine that has gone idle
    # since can be woken for that one step instead of keeping /metrics stale.
    assert tracker.flush_at == pytest.approx(11.0)
    assert not tracker.flush_due(now=10.9)
    assert tracker.flush_due(now=11.0)
    shipped = tracker.take(now=11.0)
    assert shipped is not None and shipped.data == {HINTS_KEY: {"kv.pin|accepted": 1}}
    assert tracker.flush_at is None

    # Nothing changed: nothing sent, nothing asked for.
    assert tracker.take(now=12.5) is None
    assert tracker.flush_at is None


def test_the_action_label_of_hints_total_is_bounded() -> None:
    """An action's type comes from the wire: kvhint:hints_total labels only the types the
    contract defines ("unknown": not identified, "other": the rest). Before, every
    distinct string a sender wrote became a new series on vLLM's /metrics."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

    from kvhint.engine_plugin.connector import _hint_counts
    from kvhint.engine_plugin.metrics import KvHintPromMetrics

    counts = _hint_counts({("kv.pin", "accepted"): 2, ("kv.donor", "missing"): 1,
                           ("", "rejected"): 1, ("kv.teleport", "rejected"): 3,
                           ("x" * 200, "rejected"): 4}, None, None)
    assert counts == {"kv.pin|accepted": 2, "kv.donor|missing": 1, "unknown|rejected": 1,
                      "other|rejected": 7}

    registry = CollectorRegistry()

    def bind(cls: type) -> type:
        return type(cls.__name__, (cls,), {"__init__": lambda self, *a, **k:
                                           cls.__init__(self, *a, registry=registry, **k)})

    config = SimpleNamespace(kv_transfer_config=None)
    prom = KvHintPromMetrics(config, {Counter: bind(Counter), Gauge: bind(Gauge),
                                    Histogram: bind(Histogram)}, ["engine"], {0: ["0"]})
    # Whatever reaches the front end (another plugin build's stats too) is bounded there.
    prom.observe({HINTS_KEY: {"kv.retain|accepted": 1, "kv.warp-1|rejected": 1,
                              "kv.warp-2|rejected": 1, "|rejected": 1}}, 0)
    series = {(s.labels["action"], s.labels["status"], s.value)
              for family in registry.collect() if family.name == "kvhint:hints"
              for s in family.samples if s.name == "kvhint:hints_total"}
    assert {s for s in series if s[2]} == {("kv.retain", "accepted", 1.0),
                                           ("other", "rejected", 2.0),
                                           ("unknown", "rejected", 1.0)}
    assert len(series) == 8 * 5  # 6 known types, other and unknown; by 5 statuses, at 0 or more
    assert "kv.warp" not in generate_latest(registry).decode()


# --- every counter the plugin keeps reaches /metrics ------------------------------------------

def _registry_metrics() -> tuple[Any, Any]:
    """A KvHintPromMetrics recording into its own registry, and that registry."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    from kvhint.engine_plugin.metrics import KvHintPromMetrics

    registry = CollectorRegistry()

    def bind(cls: type) -> type:
        return type(cls.__name__, (cls,), {"__init__": lambda self, *a, **k:
                                           cls.__init__(self, *a, registry=registry, **k)})

    prom = KvHintPromMetrics(SimpleNamespace(kv_transfer_config=None),
                             {Counter: bind(Counter), Gauge: bind(Gauge),
                              Histogram: bind(Histogram)}, ["engine"], {0: ["0"]})
    return prom, registry


def _plugin_counters_classes() -> set[type]:
    """Every ``*Counters`` dataclass in the plugin's modules."""
    import kvhint.engine_plugin as package

    found: set[type] = set()
    for info in pkgutil.walk_packages(package.__path__, f"{package.__name__}."):
        module = importlib.import_module(info.name)
        found.update(obj for obj in vars(module).values()
                     if isinstance(obj, type) and dataclasses.is_dataclass(obj)
                     and obj.__name__.endswith("Counters") and obj.__module__ == info.name)
    return found


def test_every_counter_the_plugin_keeps_is_exported_or_says_why_not() -> None:
    """Before, the session index's evictions, failed heartbeat and snapshot-reply
    publishes, holds given back on a reset and duplicate hints were counted in memory and
    never exported (``_read_stats`` listed its keys by hand). Now each field of each
    counters dataclass is exported or listed, with the reason, as not exported."""
    from kvhint.engine_plugin.counter_exports import EXPORTS, NOT_EXPORTED, SHARED_SERIES
    from kvhint.engine_plugin.metrics import COUNTERS, LABELLED_COUNTERS

    classes = _plugin_counters_classes()
    assert len(classes) >= 6
    assert set(EXPORTS) | set(NOT_EXPORTED) == classes
    for cls in classes:
        exported, skipped = set(EXPORTS.get(cls, {})), set(NOT_EXPORTED.get(cls, {}))
        fields = {f.name for f in dataclasses.fields(cls)}
        assert not exported & skipped, cls
        assert exported | skipped == fields, (cls, sorted(fields - exported - skipped))
    targets = [export for fields in EXPORTS.values() for export in fields.values()]
    for export in targets:
        if export.label is None:
            assert export.key in COUNTERS, export
        else:
            assert export.label in LABELLED_COUNTERS[export.key][1], export
    # Every metric is counted somewhere, and one field feeds one series (but the few
    # declared shared: the hooks' and the transport's internal errors).
    assert {e.key for e in targets} == set(COUNTERS) | set(LABELLED_COUNTERS)
    shared = {e for e in targets if targets.count(e) > 1}
    assert shared == SHARED_SERIES


def test_each_exported_counter_arrives_on_metrics_with_its_value() -> None:
    """From the counters objects through the stats deltas to the Prometheus series."""
    from kvhint.engine_plugin.counter_exports import EXPORTS, read_counters
    from kvhint.engine_plugin.metrics import COUNTERS, LABELLED_COUNTERS

    sources: dict[type, Any] = {}
    expected: dict[tuple[str, str | None], float] = {}
    value = 0
    for cls, fields in EXPORTS.items():
        counters = sources[cls] = cls()
        for name, export in fields.items():
            value += 1
            setattr(counters, name, value)
            key = (f"kvhint:{export.key}_total", export.label)
            expected[key] = expected.get(key, 0) + value
    stats = StatsTracker(lambda: read_counters(sources)).take(now=100.0)
    assert stats is not None
    prom, registry = _registry_metrics()
    prom.observe(stats.data, 0)
    seen = {}
    for family in registry.collect():
        for sample in family.samples:
            if sample.name.endswith("_total") and sample.value:  # not the unused labels
                label = next((sample.labels[name] for name in sample.labels
                              if name != "engine"), None)
                seen[(sample.name, label)] = sample.value
    assert {k: v for k, v in seen.items() if k[0] != "kvhint:hints_total"} == expected
    assert {name for name, _ in expected} == {
        f"kvhint:{key}_total" for key in (*COUNTERS, *LABELLED_COUNTERS)}
    with pytest.raises(KeyError):  # a counters object left out is an error, not zeros
        read_counters({cls: obj for cls, obj in sources.items() if cls.__name__ != "IndexCounters"})


def test_every_series_is_on_metrics_at_zero_before_anything_happens() -> None:
    """A labelled series appeared on /metrics only at its first increment: a counter
    first seen at N hides those N from rate() and increase() (the KvhintPluginDrops
    alert, ``rate(kvhint:events_dropped_total[10m])``, missed a first burst of drops),
    and a dashboard said "no data" for 0. Now each engine's series exist at 0 from the
    start, as vLLM's own metrics do."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    from kvhint.engine_plugin.metrics import KvHintPromMetrics, exposed_names

    registry = CollectorRegistry()

    def bind(cls: type) -> type:
        return type(cls.__name__, (cls,), {"__init__": lambda self, *a, **k:
                                           cls.__init__(self, *a, registry=registry, **k)})

    KvHintPromMetrics(SimpleNamespace(kv_transfer_config=None),
                      {Counter: bind(Counter), Gauge: bind(Gauge), Histogram: bind(Histogram)},
                      ["model_name", "engine"], {0: ["m", "0"], 1: ["m", "1"]})
    samples = [s for family in registry.collect() for s in family.samples]
    for engine in ("0", "1"):
        names = {s.name for s in samples if s.labels.get("engine") == engine}
        assert exposed_names() <= names, sorted(exposed_names() - names)
    assert all(s.value == 0 for s in samples if not s.name.endswith("_created"))
    dropped = {s.labels["what"] for s in samples if s.name == "kvhint:publish_errors_total"
               and s.labels["engine"] == "0"}
    assert dropped == {"queued", "heartbeat", "snapshot_reply", "oversize", "other"}


def test_labelled_counters_take_deltas_and_stay_bounded() -> None:
    readings = {"publish_errors": {"queued": 2, "heartbeat": 0, "snapshot_reply": 0}}
    tracker = StatsTracker(lambda: {k: dict(v) for k, v in readings.items()})
    first = tracker.take(now=10.0)
    assert first is not None and first.data == {"publish_errors": {"queued": 2}}
    readings["publish_errors"]["heartbeat"] = 1
    second = tracker.take(now=11.0)
    assert second is not None and second.data == {"publish_errors": {"heartbeat": 1}}
    assert second.aggregate(first).reduce() == {"publish_errors": 3}

    prom, registry = _registry_metrics()
    prom.observe({"nats_errors": {"slow_consumer": 2, "from-a-newer-build": 1},
                  "publish_errors": {"heartbeat": 1}}, 0)
    series = {(s.name, s.labels.get("kind", s.labels.get("what")), s.value)
              for family in registry.collect() for s in family.samples
              if s.name in ("kvhint:nats_errors_total", "kvhint:publish_errors_total")
              and s.value}
    assert series == {("kvhint:nats_errors_total", "slow_consumer", 2.0),
                      ("kvhint:nats_errors_total", "other", 1.0),
                      ("kvhint:publish_errors_total", "heartbeat", 1.0)}


def test_observe_says_once_per_key_what_it_cannot_export() -> None:
    """Before, keys it did not know (another plugin build's counters) vanished silently."""
    from kvhint.engine_plugin.config import LOGGER_NAME

    prom, registry = _registry_metrics()
    lines: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    log = logging.getLogger(LOGGER_NAME)
    log.addHandler(handler)
    try:
        prom.observe({"gizmos_dropped": 3, "events_dropped": 1}, 0)
        prom.observe({"gizmos_dropped": 2, "widgets_lost": 1}, 0)
    finally:
        log.removeHandler(handler)
    assert len(lines) == 2
    assert "'gizmos_dropped'" in lines[0] and "'widgets_lost'" in lines[1]
    assert registry.get_sample_value("kvhint:events_dropped_total", {"engine": "0"}) == 1.0
    # Merged per interval in the front end without failing on them either.
    merged = KvHintConnectorStats(data={"gizmos_dropped": {"a": 1}, "widgets_lost": [0.1]})
    merged.aggregate(KvHintConnectorStats(data={"gizmos_dropped": {"a": 2, "b": 1},
                                                "widgets_lost": [0.2]}))
    assert merged.data == {"gizmos_dropped": {"a": 3, "b": 1}, "widgets_lost": [0.1, 0.2]}
