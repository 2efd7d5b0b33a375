"""The retain priority scale: a hit density (expected next-turn hits per cache-second,
:meth:`~kvhint.router.policy.stats.LearnedStats.hit_density`) on a log scale of 0..100,
and back. Workers only compare priorities; the planner reads a priority it sent back as
the density it stood for (shared-prefix values sum them)."""

from __future__ import annotations

import math


def retain_priority(density: float) -> int:
    """Retain priority from a hit density on a log scale: 1 hit/s -> 100, 1/min -> 59,
    1/5 min -> 36, 1/hour -> 1, none -> 0. Only the order matters to the worker."""
    if density <= 0:
        return 0
    return max(0, min(100, round(10.0 * math.log2(density * 3600.0))))


def priority_density(priority: int) -> float:
    """The hit density a retain priority stands for: :func:`retain_priority`'s inverse
    (to its rounding); 0 for priority 0."""
    if priority <= 0:
        return 0.0
    return 2.0 ** (priority / 10.0) / 3600.0
