"""Why the prompt size's better return AUC buys no hits: AUC per turn against per block.

``return_features.py`` scores each *turn* once; a pool's hit rate counts *blocks*. This
prints, with ``return_features``' out-of-sample method (per-bucket rates learnt on one
half of the trace, scored on the other, both ways), the AUC per turn and with each turn
weighted by its full prompt blocks, over every turn and over turns with at least two full
blocks (a one-block turn holds only block 0, which every Mooncake session shares, so it
takes no room and its session is never seen to continue); then the return rate and the
share of all prompt blocks per (depth 1 or deeper, log2 prompt tokens).

    .venv/bin/python tests/benchmarks/sim/return_auc_weighting.py \\
        ../shared/traces/mooncake_conversation_trace.jsonl
"""

from __future__ import annotations

import argparse
import collections
import math
from collections.abc import Callable, Hashable

from kvhint.router.policy.plan_types import PlannerConfig
from kvhint.router.sim.trace import load_trace

try:
    from return_features import out_of_sample_scores
    from return_predictor_bound import weighted_auc
    from value_order_bound import Turn, turns_of
except ImportError:  # imported as tests.benchmarks.sim.return_auc_weighting
    from tests.benchmarks.sim.return_features import out_of_sample_scores
    from tests.benchmarks.sim.return_predictor_bound import weighted_auc
    from tests.benchmarks.sim.value_order_bound import Turn, turns_of


def _size(t: Turn) -> int:
    return int(math.log2(max(t.prompt_tokens, 1)))


KEYS: dict[str, Callable[[Turn], Hashable]] = {
    "kind, depth (the planner's)": lambda t: (t.kind, min(t.depth, 8)),
    "kind, depth, log2 prompt tokens": lambda t: (t.kind, min(t.depth, 8), _size(t)),
    "log2 prompt tokens alone": _size,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace")
    args = parser.parse_args()
    config = PlannerConfig()
    turns = turns_of(load_trace(args.trace), config.return_window_s,
                     config.long_message_tokens)
    one_block = [t for t in turns if len(t.blocks) < 2]
    print(f"{len(turns)} turns; {len(one_block)} with under two full blocks, "
          f"{sum(t.returns for t in one_block)} of them followed within "
          f"{config.return_window_s:g} s")
    for label, subset in (("every turn", turns),
                          ("turns with >= 2 full blocks",
                           [t for t in turns if len(t.blocks) >= 2])):
        labels = [t.returns for t in subset]
        blocks = [float(max(len(t.blocks), 1)) for t in subset]
        for name, key in KEYS.items():
            scores = out_of_sample_scores(subset, key)
            print(f"{label:28s} {name:32s} AUC per turn "
                  f"{weighted_auc(scores, labels, [1.0] * len(subset)):.3f}  per block "
                  f"{weighted_auc(scores, labels, blocks):.3f}")
    cells: dict[tuple[str, int], list[int]] = collections.defaultdict(lambda: [0, 0, 0])
    for t in turns:
        cell = cells[("1" if t.depth == 1 else "2+", _size(t))]
        cell[0] += 1
        cell[1] += t.returns
        cell[2] += len(t.blocks)
    total = sum(len(t.blocks) for t in turns)
    print("depth  prompt tokens   turns  returns  share of blocks")
    for (depth, size), (n, returned, held) in sorted(cells.items()):
        print(f"{depth:5s}  {2**size:>6d}-{2**(size + 1) - 1:<7d} {n:6d}  {returned / n:7.2f}"
              f"  {held / total:15.3f}")


if __name__ == "__main__":
    main()
