"""The router's load bookkeeping (policy.routed_load), one class for the live router and
the simulator: what route() sees of a worker as requests are dispatched, start and end."""

from __future__ import annotations

import pytest

from kvhint.router.policy.routed_load import RoutedLoads
from kvhint.router.policy.routing import WorkerLoad


def test_a_requests_figures_come_and_go_with_it() -> None:
    loads = RoutedLoads(half_life_s=100.0)
    assert loads.worker_load("w0", 0.0, healthy=True, active_requests=0) == WorkerLoad("w0")
    loads.session_placed("w0", 0.0)
    loads.dispatched("w0", 0.0, uncached_tokens=300, prompt_tokens=1000, block_size=16)
    loads.dispatched("w0", 0.0, uncached_tokens=50, prompt_tokens=64, block_size=16)
    seen = loads.worker_load("w0", 100.0, healthy=False, active_requests=2)
    assert (seen.healthy, seen.active_requests, seen.pending_prefill_tokens,
            seen.active_blocks) == (False, 2, 350, 63 + 4)
    assert (seen.recent_prefill_tokens, seen.recent_sessions) == pytest.approx((175.0, 0.5))
    loads.first_token("w0", 300)
    loads.finished("w0", 1000, 16, prefill_pending=0)  # answered
    loads.finished("w0", 64, 16, prefill_pending=50)  # failed before its first token
    figures = loads.get("w0")
    assert figures is not None and (figures.pending_prefill, figures.active_blocks) == (0, 0)
    loads.finished("w0", 64, 16, prefill_pending=50)  # settled twice: never below zero
    assert (figures.pending_prefill, figures.active_blocks) == (0, 0)
    loads.forget("w0")
    assert loads.get("w0") is None

