"""What one simulated policy run measured, and its JSON form (issue 4's keys)."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of unsorted values: the smallest value with
    at least q% of the values at or below it (rank ceil(q/100 * n), at least 1); 0.0 when
    empty. ``q * n / 100``, not ``q / 100 * n``: 7 / 100 * 100 is 7.000000000000001."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(1, min(len(ordered), math.ceil(q * len(ordered) / 100.0)))
    return ordered[rank - 1]


@dataclass(slots=True)
class TimelinePoint:
    """Prompt and cached tokens of requests admitted in ``[start_s, start_s + width)``."""

    start_s: float
    prompt_tokens: int = 0
    hit_tokens: int = 0


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """One admitted request: where it ran and what its prompt found cached."""

    line: int
    session_id: str
    worker_id: str
    arrival_s: float
    start_s: float
    g1_hit_tokens: int
    g2_hit_tokens: int
    computed_tokens: int


@dataclass(slots=True)
class PolicyResult:
    policy: str
    requests: int = 0
    prompt_tokens: int = 0
    g1_hit_tokens: int = 0
    g2_hit_tokens: int = 0
    computed_by_worker: dict[str, int] = field(default_factory=dict)
    ttfts_s: list[float] = field(default_factory=list)
    # Per response of 2+ output tokens: its time from first to last token / (tokens - 1),
    # as the router's recordings time streamed answers (itl_ms).
    itls_s: list[float] = field(default_factory=list)
    # (action type, status) -> count; "sent" counts actions the planner sent.
    hints: Counter = field(default_factory=Counter)
    # (action type, reason) -> blocks workers let go of accepted Pins/Retains unasked.
    released_blocks: Counter = field(default_factory=Counter)
    # Buckets of ``timeline_width_s`` in time order; only those with admissions.
    timeline: list[TimelinePoint] = field(default_factory=list)
    timeline_width_s: float = 60.0
    # Per admitted request, in admission order (kept only when asked for: tests, debugging).
    records: list[RequestRecord] | None = None
    dropped_requests: int = 0
    # Turns routed to another worker than their session's previous turn (the live agent
    # bench reports the same count, "moved_turns").
    moved_turns: int = 0
    admission_waits: int = 0
    decode_alloc_failures: int = 0
    # The scheduler engine: running requests vLLM preempted to make room.
    preemptions: int = 0
    wall_s: float = 0.0

    @property
    def recomputed_tokens(self) -> int:
        return self.prompt_tokens - self.g1_hit_tokens - self.g2_hit_tokens

    def rate(self, tokens: int) -> float:
        return tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def load_balance(self) -> float:
        """max / mean computed (recomputed) prompt tokens per worker; 1.0 = even."""
        values = list(self.computed_by_worker.values())
        mean = sum(values) / len(values) if values else 0.0
        return max(values) / mean if mean > 0 else 1.0

    def hints_by_action(self) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = {}
        for (action, status), count in sorted(self.hints.items()):
            out.setdefault(action, {})[status] = count
        return out

    def to_json(self) -> dict[str, object]:
        return {
            "policy": self.policy,
            "requests": self.requests,
            "prompt_tokens": self.prompt_tokens,
            "token_hit_rate": round(self.rate(self.g1_hit_tokens + self.g2_hit_tokens), 6),
            "g1_token_hit_rate": round(self.rate(self.g1_hit_tokens), 6),
            "g2_token_hit_rate": round(self.rate(self.g2_hit_tokens), 6),
            "recomputed_tokens": self.recomputed_tokens,
            "load_balance": round(self.load_balance, 4),
            "computed_tokens_by_worker": dict(sorted(self.computed_by_worker.items())),
            "ttft_p50_s": round(percentile(self.ttfts_s, 50), 6),
            "ttft_p99_s": round(percentile(self.ttfts_s, 99), 6),
            "itl_p50_s": round(percentile(self.itls_s, 50), 6),
            "hints": self.hints_by_action(),
            "released_blocks": {f"{action}|{reason}": n for (action, reason), n
                                in sorted(self.released_blocks.items())},
            "dropped_requests": self.dropped_requests,
            "moved_turns": self.moved_turns,
            "admission_waits": self.admission_waits,
            "decode_alloc_failures": self.decode_alloc_failures,
            "preemptions": self.preemptions,
            "wall_s": round(self.wall_s, 3),
        }


@dataclass(frozen=True, slots=True)
class ReferenceResult:
    """A reference line (no routing, no vLLM): ``name`` is ``oracle`` or ``unbounded``."""

    name: str
    capacity_blocks: int | None
    prompt_tokens: int
    hit_tokens: int

    @property
    def recomputed_tokens(self) -> int:
        return self.prompt_tokens - self.hit_tokens

    def to_json(self) -> dict[str, object]:
        rate = self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0
        return {
            "policy": self.name,
            "reference": True,
            "capacity_blocks": self.capacity_blocks,
            "prompt_tokens": self.prompt_tokens,
            "token_hit_rate": round(rate, 6),
            "recomputed_tokens": self.recomputed_tokens,
        }
