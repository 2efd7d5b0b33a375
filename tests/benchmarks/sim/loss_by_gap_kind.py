"""Where each policy loses prompt tokens to its cache's size, by the gap before the turn.

A request's *capacity loss* is what it recomputes beyond what an unbounded cache would
(the tokens no cache could serve: new messages, first turns, partial blocks). Summed per
kind of the gap that preceded it (the session's first turn; a tool call, by tool name; a
user turn) and per length of that gap, for each simulated policy and for the reference
oracle (Belady over one pool of all the fleet's blocks). The simulator and the oracle run
the same trace; the simulator's totals are its ``recomputed_tokens``.

    .venv/bin/python tests/benchmarks/sim/loss_by_gap_kind.py TRACE --workers 2 \\
        --gpu-blocks 400 --policies kv_aware,kvhint
"""

from __future__ import annotations

import argparse
import collections
from collections.abc import Sequence

from kvhint.router.sim.engine import SimConfig, Simulation
from kvhint.router.sim.reference import oracle_hit_tokens, unbounded_hit_tokens
from kvhint.router.sim.trace import Trace, TraceRequest, load_trace

GAP_LIMITS_S = (10.0, 30.0, 100.0, 300.0)
FIRST = "first turn"


def gap_kinds(trace: Trace) -> list[tuple[str, float | None]]:
    """Per request (trace order): the kind of the gap before it and its length (None for
    a session's first turn)."""
    previous: dict[tuple[str, str], TraceRequest] = {}
    kinds: list[tuple[str, float | None]] = []
    for request in trace.requests:
        key = (request.tenant, request.session_id)
        last = previous.get(key)
        if last is None:
            kinds.append((FIRST, None))
        elif last.finish_reason == "tool_calls":
            name = sorted(last.tool_names)[-1] if last.tool_names else "unnamed"
            kinds.append((f"tool {name}", request.arrival_s - last.arrival_s))
        else:
            kinds.append(("user", request.arrival_s - last.arrival_s))
        previous[key] = request
    return kinds


def gap_bucket(kind: str, gap_s: float | None) -> str:
    if gap_s is None:
        return FIRST
    family = "tool" if kind.startswith("tool") else kind
    limit = next((f"< {limit:.0f} s" for limit in GAP_LIMITS_S if gap_s < limit),
                 f">= {GAP_LIMITS_S[-1]:.0f} s")
    return f"{family} {limit}"


def sorted_keys(keys: Sequence[str]) -> list[str]:
    """First turns, then by name; gap buckets by family, then length."""
    def rank(key: str) -> tuple[int, str, int]:
        if key == FIRST:
            return (0, "", 0)
        family, _, length = key.rpartition(" ")[0].partition(" ") if " s" in key[-2:] \
            else (key, "", "")
        limits = [f"< {limit:.0f}" for limit in GAP_LIMITS_S]
        position = limits.index(length) if length in limits else len(limits)
        return (1, family if length else key, position)
    return sorted(set(keys), key=rank)


def losses(trace: Trace, hit_tokens: Sequence[int], unbounded: Sequence[int],
           keys: Sequence[str]) -> dict[str, int]:
    """Capacity loss summed per key (``hit_tokens``: per request, trace order)."""
    total: dict[str, int] = collections.defaultdict(int)
    for key, hit, best in zip(keys, hit_tokens, unbounded, strict=True):
        total[key] += best - hit
    return dict(total)


def simulated_hits(trace: Trace, config: SimConfig, policy: str) -> list[int]:
    """Per request (trace order), the tokens the simulated policy served from cache."""
    result = Simulation(trace, config, policy).run(lambda done, total: None)
    assert result.records is not None
    by_line = {r.line: r.g1_hit_tokens + r.g2_hit_tokens for r in result.records}
    return [by_line[request.line] for request in trace.requests]


def table(trace: Trace, columns: dict[str, Sequence[int]], unbounded: Sequence[int],
          keys: Sequence[str]) -> str:
    counts = collections.Counter(keys)
    order = {key: i for i, key in enumerate(dict.fromkeys(sorted_keys(keys)))}
    per_column = {name: losses(trace, hits, unbounded, keys) for name, hits in columns.items()}
    names = list(columns)
    lines = ["| gap | requests | " + " | ".join(names) + " |",
             "|---|---:|" + "---:|" * len(names)]
    for key in sorted(counts, key=order.__getitem__):
        lines.append(f"| {key} | {counts[key]:,} | "
                     + " | ".join(f"{per_column[n].get(key, 0):,}" for n in names) + " |")
    lines.append("| **all** | " + f"{len(keys):,} | "
                 + " | ".join(f"{sum(per_column[n].values()):,}" for n in names) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--gpu-blocks", type=int, required=True)
    parser.add_argument("--policies", default="kv_aware,kvhint",
                        help="comma-separated; kvhint@F: kvhint at retain budget F")
    args = parser.parse_args()
    trace = load_trace(args.trace)
    columns = {}
    for column in args.policies.split(","):
        policy, _, budget = column.partition("@")
        plugin = {"retain_budget_fraction": float(budget)} if budget else {}
        config = SimConfig(workers=args.workers, gpu_blocks=args.gpu_blocks,
                           keep_records=True, plugin=plugin)
        columns[column] = simulated_hits(trace, config, policy)
    columns["oracle"] = oracle_hit_tokens(trace, args.workers * args.gpu_blocks)
    unbounded = unbounded_hit_tokens(trace)
    kinds = gap_kinds(trace)
    print(f"Capacity loss (tokens recomputed beyond an unbounded cache), {args.trace}, "
          f"{args.workers} x {args.gpu_blocks} blocks; unbounded recomputes "
          f"{sum(r.input_length for r in trace.requests) - sum(unbounded):,}\n")
    print(table(trace, columns, unbounded, [kind for kind, _ in kinds]))
    print()
    print(table(trace, columns, unbounded, [gap_bucket(kind, gap) for kind, gap in kinds]))


if __name__ == "__main__":
    main()
