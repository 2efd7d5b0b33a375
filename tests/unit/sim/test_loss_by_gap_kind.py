"""The capacity-loss breakdown (tests/benchmarks/sim/loss_by_gap_kind.py): gap kinds and
lengths read off the trace, and per-kind losses that add up to the simulator's and the
oracle's own totals."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from kvhint.router.sim.engine import SimConfig, Simulation
from kvhint.router.sim.reference import oracle, oracle_hit_tokens, unbounded, unbounded_hit_tokens
from kvhint.router.sim.trace import load_trace

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "sim" / "loss_by_gap_kind.py"


@pytest.fixture(scope="module")
def breakdown():
    spec = importlib.util.spec_from_file_location("loss_by_gap_kind", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def test_gap_kinds_and_buckets(breakdown, tmp_path: Path) -> None:
    rows = [
        {"timestamp": 0, "session_id": "a", "turn": 1, "input_length": 64, "output_length": 1,
         "hash_ids": [1, 2], "finish_reason": "tool_calls", "tool_names": ["search"]},
        {"timestamp": 5000, "session_id": "a", "turn": 2, "input_length": 96,
         "output_length": 1, "hash_ids": [1, 2, 3], "finish_reason": "stop"},
        {"timestamp": 405000, "session_id": "a", "turn": 3, "input_length": 128,
         "output_length": 1, "hash_ids": [1, 2, 3, 4], "finish_reason": "stop"},
    ]
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    trace = load_trace(path, block_size=32)
    kinds = breakdown.gap_kinds(trace)
    assert kinds == [("first turn", None), ("tool search", 5.0), ("user", 400.0)]
    assert [breakdown.gap_bucket(k, g) for k, g in kinds] == [
        "first turn", "tool < 10 s", "user >= 300 s"]
    assert breakdown.sorted_keys(["user >= 300 s", "tool < 100 s", "first turn",
                                  "tool < 10 s", "tool < 30 s"]) == [
        "first turn", "tool < 10 s", "tool < 30 s", "tool < 100 s", "user >= 300 s"]


def test_losses_add_up_to_each_runs_totals(breakdown, tmp_path: Path) -> None:
    from kvhint.router.sim.agents import AgentWorkloadSpec, write_agent_trace

    path = tmp_path / "agents.jsonl"
    write_agent_trace(path, AgentWorkloadSpec(sessions=20, duration_s=90.0, seed=5,
                                              block_size=32, system_prompt_tokens=96,
                                              tool_schema_tokens=64, first_user_tokens=64,
                                              turn_tokens=48, output_tokens=16, max_turns=5))
    trace = load_trace(path, block_size=32)
    config = SimConfig(workers=2, gpu_blocks=30, block_size=32, keep_records=True)
    best = unbounded_hit_tokens(trace)
    assert sum(best) == unbounded(trace).hit_tokens
    keys = [kind for kind, _ in breakdown.gap_kinds(trace)]
    floor = sum(r.input_length for r in trace.requests) - sum(best)
    for policy in ("kv_aware", "kvhint"):
        hits = breakdown.simulated_hits(trace, config, policy)
        total = Simulation(trace, config, policy).run(lambda done, total: None)
        assert sum(breakdown.losses(trace, hits, best, keys).values()) == \
            total.recomputed_tokens - floor
    hits = oracle_hit_tokens(trace, 60)
    assert sum(hits) == oracle(trace, 60).hit_tokens
    assert sum(breakdown.losses(trace, hits, best, keys).values()) >= 0
