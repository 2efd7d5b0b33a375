from __future__ import annotations

from kvhint.router.service.metrics import RouterMetrics
from kvhint.router.service.timeline import Timeline


def test_timeline_differences_totals_per_interval() -> None:
    metrics = RouterMetrics()
    timeline = Timeline(max_points=3)
    metrics.record_request("chat", "w0", 200)
    metrics.record_usage("w0", prompt=100, cached=60, predicted=64)
    first = timeline.sample(1.0, metrics.totals, {"accepted": 2})
    assert (first.prompt_tokens, first.cached_tokens, first.predicted_cached_tokens) == (100, 60, 64)
    metrics.record_request("chat", "w1", 503)
    metrics.record_usage("w1", prompt=50, cached=0, predicted=None)
    second = timeline.sample(2.0, metrics.totals, {"accepted": 2, "rejected": 1})
    assert (second.requests, second.errors, second.prompt_tokens) == (1, 1, 50)
    assert second.by_worker == {"w0": (0, 0), "w1": (50, 0)}
    assert second.hints == {"rejected": 1}
    assert second.as_dict()["cached_share"] == 0.0
    for at in (3.0, 4.0):
        timeline.sample(at, metrics.totals, {})
    assert [p["at"] for p in timeline.as_list()] == [2.0, 3.0, 4.0]
    text = metrics.render().decode()
    assert 'kvhint_router_cached_tokens_actual_total{predicted="false",worker="w1"} 0.0' in text
    assert 'kvhint_router_cached_tokens_predicted_total{worker="w0"} 64.0' in text
