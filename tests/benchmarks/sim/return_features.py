"""How well features a live router has predict whether a turn's session returns.

For every turn of a trace: does the session's next turn come within the planner's return
window (600 s)? Each feature set is scored by the ROC AUC of a per-bucket return rate
learnt on one half of the trace (by time) and scored on the other, both ways (smoothed
toward the half's overall rate with 5 pseudo-turns). Out of sample, so a finer feature
set cannot win by memorising.

    .venv/bin/python tests/benchmarks/sim/return_features.py \\
        ../shared/traces/mooncake_conversation_trace.jsonl

The gap kinds are the planner's (``value_order_bound.turns_of``: tool name, or the user's
tempo and long-message flag).
"""

from __future__ import annotations

import argparse
import collections
import math
from collections.abc import Callable, Hashable, Sequence

from kvhint.router.policy.plan_types import PlannerConfig
from kvhint.router.sim.trace import load_trace

try:
    from value_order_bound import Turn, turns_of
except ImportError:  # imported as tests.benchmarks.sim.return_features
    from tests.benchmarks.sim.value_order_bound import Turn, turns_of

FEATURES: dict[str, Callable[[Turn], Hashable]] = {
    "none": lambda t: 0,
    "kind, depth (the planner's)": lambda t: (t.kind, min(t.depth, 8)),
    "kind, depth, log2 prompt tokens": lambda t: (t.kind, min(t.depth, 8),
                                                  int(math.log2(max(t.prompt_tokens, 1)))),
    "log2 prompt tokens alone": lambda t: int(math.log2(max(t.prompt_tokens, 1))),
}


def auc(scores: Sequence[float], labels: Sequence[bool]) -> float:
    """ROC AUC, ties counted half."""
    pairs = sorted(zip(scores, labels))
    positives = sum(labels)
    negatives = len(labels) - positives
    rank_sum, rank, i = 0.0, 1, 0
    while i < len(pairs):
        j = i
        while j < len(pairs) and pairs[j][0] == pairs[i][0]:
            j += 1
        mean_rank = rank + (j - i - 1) / 2
        rank_sum += mean_rank * sum(label for _, label in pairs[i:j])
        rank += j - i
        i = j
    return (rank_sum - positives * (positives + 1) / 2) / (positives * negatives)


def out_of_sample_scores(turns: Sequence[Turn], key: Callable[[Turn], Hashable]
                         ) -> list[float]:
    half = len(turns) // 2
    scores = [0.0] * len(turns)
    for train, test in ((range(half), range(half, len(turns))),
                        (range(half, len(turns)), range(half))):
        counts: dict[Hashable, list[int]] = collections.defaultdict(lambda: [0, 0])
        for i in train:
            counts[key(turns[i])][0] += turns[i].returns
            counts[key(turns[i])][1] += 1
        overall = sum(turns[i].returns for i in train) / len(train)
        for i in test:
            returned, seen = counts.get(key(turns[i]), (0, 0))
            scores[i] = (returned + 5 * overall) / (seen + 5)
    return scores


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace")
    args = parser.parse_args()
    config = PlannerConfig()
    turns = turns_of(load_trace(args.trace), config.return_window_s,
                     config.long_message_tokens)
    labels = [t.returns for t in turns]
    print(f"{len(turns)} turns, {sum(labels) / len(turns):.1%} return within "
          f"{config.return_window_s:g} s")
    for name, key in FEATURES.items():
        print(f"{name:34s} AUC {auc(out_of_sample_scores(turns, key), labels):.3f}")


if __name__ == "__main__":
    main()
