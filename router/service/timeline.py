"""A short in-memory history for the dashboard: every ``interval_s`` the traffic totals
are sampled and differenced, so the page can plot cached-token share, prediction
accuracy, request rate and hint outcomes over time without a Prometheus server.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

from kvhint.router.service.metrics import TrafficTotals


@dataclass(frozen=True, slots=True)
class TimelinePoint:
    at: float
    requests: int
    errors: int
    prompt_tokens: int
    cached_tokens: int
    predicted_cached_tokens: int
    by_worker: dict[str, tuple[int, int]]  # worker -> (prompt tokens, cached tokens)
    hints: dict[str, int]  # outcome status -> actions that reached it in the interval

    def as_dict(self) -> dict[str, Any]:
        share = self.cached_tokens / self.prompt_tokens if self.prompt_tokens else None
        return {
            "at": self.at, "requests": self.requests, "errors": self.errors,
            "prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens,
            "predicted_cached_tokens": self.predicted_cached_tokens,
            "cached_share": share,
            "by_worker": {w: {"prompt_tokens": p, "cached_tokens": c,
                              "cached_share": (c / p if p else None)}
                          for w, (p, c) in self.by_worker.items()},
            "hints": self.hints,
        }


class Timeline:
    def __init__(self, max_points: int = 720) -> None:
        self.points: deque[TimelinePoint] = deque(maxlen=max_points)
        self._last: dict[str, TrafficTotals] = {}
        self._last_hints: dict[str, int] = {}

    def sample(self, now: float, totals: dict[str, TrafficTotals],
               hint_counts: dict[str, int]) -> TimelinePoint:
        by_worker: dict[str, tuple[int, int]] = {}
        sums = TrafficTotals()
        # A worker forgotten (RouterMetrics.forget_worker) is forgotten here too: one of
        # that id heard again starts from nothing, not from below its old totals.
        self._last = {worker: last for worker, last in self._last.items() if worker in totals}
        for worker, current in totals.items():
            last = self._last.get(worker, TrafficTotals())
            delta = TrafficTotals(
                current.requests - last.requests, current.errors - last.errors,
                current.prompt_tokens - last.prompt_tokens,
                current.cached_tokens - last.cached_tokens,
                current.predicted_cached_tokens - last.predicted_cached_tokens)
            self._last[worker] = TrafficTotals(current.requests, current.errors,
                                               current.prompt_tokens, current.cached_tokens,
                                               current.predicted_cached_tokens)
            sums.requests += delta.requests
            sums.errors += delta.errors
            sums.prompt_tokens += delta.prompt_tokens
            sums.cached_tokens += delta.cached_tokens
            sums.predicted_cached_tokens += delta.predicted_cached_tokens
            if worker != "none":
                by_worker[worker] = (delta.prompt_tokens, delta.cached_tokens)
        hints = {status: count - self._last_hints.get(status, 0)
                 for status, count in hint_counts.items()}
        self._last_hints = dict(hint_counts)
        point = TimelinePoint(now, sums.requests, sums.errors, sums.prompt_tokens,
                              sums.cached_tokens, sums.predicted_cached_tokens, by_worker,
                              {k: v for k, v in hints.items() if v})
        self.points.append(point)
        return point

    def as_list(self) -> list[dict[str, Any]]:
        return [p.as_dict() for p in self.points]
