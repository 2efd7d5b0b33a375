"""The simulator runs the live router's shared-prefix scan: a system prompt that several
live sessions share is retained by block hash, so it survives a flood that plain LRU
(and the sessions' own retains, each worth less than the prefix) would evict.

Block size 32, a pool of 12 blocks, prompts of 3 full blocks + 1 token, no decode tokens.
s1..s3 share blocks [1, 2]; the first tick (5 s) finds that prefix and retains it. Six
one-shot sessions then cycle the rest of the pool. s9 starts with the same two blocks at
60 s.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from kvhint.router.policy import Holdings, PlannerConfig
from kvhint.router.sim.engine import SimConfig, Simulation
from kvhint.router.sim.trace import load_trace

SHARED = [{"timestamp": 1000 * n, "session_id": f"s{n}", "input_length": 97,
           "output_length": 0, "hash_ids": [1, 2, 10 * n, 10 * n + 1]} for n in (1, 2, 3)]
FLOOD = [{"timestamp": 10_000 + 5000 * n, "session_id": f"f{n}", "input_length": 97,
          "output_length": 0, "hash_ids": [100 + 4 * n + k for k in range(4)]}
         for n in range(6)]
LATE = [{"timestamp": 60_000, "session_id": "s9", "input_length": 97, "output_length": 0,
         "hash_ids": [1, 2, 90, 91]}]


def _late_hit(tmp_path: Path, planner: PlannerConfig) -> int:
    path = tmp_path / "shared.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in SHARED + FLOOD + LATE))
    trace = load_trace(path, block_size=32)
    sim = Simulation(trace, SimConfig(workers=1, gpu_blocks=12, block_size=32,
                                      keep_records=True, planner=planner), "kvhint")
    result = sim.run()
    (late,) = [r for r in result.records if r.session_id == "s9"]
    return late.g1_hit_tokens


def test_a_system_prompt_live_sessions_share_is_retained_through_a_flood(
        tmp_path: Path) -> None:
    # Each session is retained at priority 30 (a first user turn on fresh statistics),
    # decaying while it waits; the flood's fresher retains displace those. The prefix is
    # worth the three sessions' summed hit density (priority 45), so its retain keeps
    # blocks 1 and 2.
    assert _late_hit(tmp_path, PlannerConfig()) == 64
    # Controls: with four sessions required the prefix is not retained and LRU evicts
    # it; sessions the planner leaves to LRU (below the retain threshold) do not count.
    assert _late_hit(tmp_path, replace(PlannerConfig(), shared_prefix_min_sessions=4)) == 0
    assert _late_hit(tmp_path, replace(PlannerConfig(), min_retain_priority=40)) == 0


def test_the_planners_ledger_counts_a_shared_prefix_once_as_the_worker_does(
        tmp_path: Path) -> None:
    """s1..s3's retains all cover the shared blocks [1, 2]: the plugin holds them once,
    and the planner's ledger (its pin room, the tenant's budgets) must say the same, not
    one count per retain (before: 3 x 3 = 9 blocks for the 2 + 3 x 1 = 5 held)."""
    path = tmp_path / "shared.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in SHARED))
    sim = Simulation(load_trace(path, block_size=32),
                     SimConfig(workers=1, gpu_blocks=400, block_size=32), "kvhint")
    sim.run()
    holds = sim.workers["w0"].core.executor.holds
    assert (holds.pinned, holds.retained) == (0, 5)
    assert sim.ledger.worker("w0") == Holdings(0, 5) == sim.ledger.tenant("default")
