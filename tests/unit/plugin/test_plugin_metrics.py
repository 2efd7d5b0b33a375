"""Connector stats deltas: what vLLM ships from EngineCore to the API server's /metrics."""

from __future__ import annotations

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
