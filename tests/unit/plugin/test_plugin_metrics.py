"""Connector stats deltas: what vLLM ships from EngineCore to the API server's /metrics."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvhint.engine_plugin.metrics import HINTS_KEY, StatsTracker


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
    assert series == {("kv.retain", "accepted", 1.0), ("other", "rejected", 2.0),
                      ("unknown", "rejected", 1.0)}
    assert "kv.warp" not in generate_latest(registry).decode()
