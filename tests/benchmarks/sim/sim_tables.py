"""Render the simulator benchmark's JSON lines (run_sim_bench.sh) as markdown tables.

    .venv/bin/python tests/benchmarks/sim/sim_tables.py tests/benchmarks/sim/results/*.jsonl
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _hints(hints: dict[str, dict[str, int]]) -> str:
    parts = []
    for action, counts in sorted(hints.items()):
        outcomes = " ".join(f"{k[0]}{v}" for k, v in sorted(counts.items()) if k != "sent")
        parts.append(f"{action.removeprefix('kv.')} {counts.get('sent', 0)} ({outcomes})")
    return "; ".join(parts) or "-"


def render(path: Path) -> str:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    wall = path.with_suffix(".time")
    out = [f"`{path.stem}`" + (f" (whole command {float(wall.read_text()):.0f} s wall)"
                               if wall.exists() else ""), "",
           "| policy | token hit | G1 | G2 | recomputed tokens | max/mean computed | "
           "TTFT p50 | TTFT p99 | hints sent (a=accepted c=clipped m=missing r=rejected) |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        if r.get("reference"):
            cap = f" @ {r['capacity_blocks']:,} blocks" if r.get("capacity_blocks") else ""
            out.append(f"| ({r['policy']}{cap}) | {r['token_hit_rate']:.2%} | | | "
                       f"{r['recomputed_tokens']:,} | | | | reference |")
            continue
        out.append(
            f"| {r['policy']} | {r['token_hit_rate']:.2%} | {r['g1_token_hit_rate']:.2%} | "
            f"{r['g2_token_hit_rate']:.2%} | {r['recomputed_tokens']:,} | "
            f"{r['load_balance']:.3f} | {r['ttft_p50_s']:.3f} s | {r['ttft_p99_s']:.3f} s | "
            f"{_hints(r['hints'])} |")
    return "\n".join(out)


if __name__ == "__main__":
    print("\n\n".join(render(Path(p)) for p in sys.argv[1:]))
