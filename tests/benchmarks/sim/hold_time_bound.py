"""What a depth-aware retention could reach on a trace, with hindsight on the hold times.

Every response opens a gap; a policy that knows only the session's depth holds the
session's prompt blocks for ``T[depth]`` seconds after it (then drops them). Its next turn
hits the whole previous prompt when it comes within ``T[depth]``. Grid search over
``T`` (depth 1, 2, 3, 4+) for the most hit tokens whose average occupancy fits a block
budget. Own-session continuations only (shared prefixes such as a common system prompt are
extra). An upper bound for depth + idle-time policies with a perfect mechanism, used to
judge the simulator targets (BENCHMARKS.md, "## simulator").

    .venv/bin/python tests/benchmarks/sim/hold_time_bound.py [TRACE] [--budgets 2500,4000]
"""

from __future__ import annotations

import argparse
import collections
import itertools

from kvhint.router.sim.trace import load_trace

GRID = (0, 15, 30, 60, 90, 120, 180, 240, 300, 450, 600, 900)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("trace", nargs="?",
                        default="../shared/traces/mooncake_conversation_trace.jsonl")
    parser.add_argument("--budgets", default="2500,4000")
    args = parser.parse_args()
    trace = load_trace(args.trace)
    sessions = collections.defaultdict(list)
    for request in trace.requests:
        sessions[request.session_id].append(request)
    prompt = sum(r.input_length for r in trace.requests)
    duration = trace.requests[-1].arrival_s - trace.requests[0].arrival_s
    gaps = []  # (depth bucket 1..4, full blocks, gap or inf)
    for turns in sessions.values():
        for i, request in enumerate(turns):
            gap = turns[i + 1].arrival_s - request.arrival_s if i + 1 < len(turns) else float("inf")
            gaps.append((min(i + 1, 4), request.input_length // trace.block_size, gap))
    # Occupancy and hits add up over depths: tabulate each depth's for every hold time.
    table = {}
    for depth in range(1, 5):
        for t in GRID:
            occupancy = hits = 0.0
            for d, blocks, gap in gaps:
                if d == depth:
                    occupancy += blocks * min(gap, t)
                    hits += blocks * trace.block_size if gap <= t else 0
            table[depth, t] = (occupancy / duration, hits / prompt)
    for budget in (int(b) for b in args.budgets.split(",")):
        best = (0.0, (), 0.0)
        for hold in itertools.product(GRID, repeat=4):
            occupancy = sum(table[d + 1, t][0] for d, t in enumerate(hold))
            rate = sum(table[d + 1, t][1] for d, t in enumerate(hold))
            if occupancy <= budget and rate > best[0]:
                best = (rate, hold, occupancy)
        print(f"budget {budget} blocks: {best[0]:.2%} of prompt tokens from own-session "
              f"continuations, hold times (depth 1, 2, 3, 4+) = {best[1]} s, "
              f"average occupancy {best[2]:.0f} blocks")

if __name__ == "__main__":
    main()
