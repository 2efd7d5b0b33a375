"""The simulator learns, as the live router does, whether a session's next turn reads the
KV of its previous response, and protects only what the next turn reads.

A Mooncake-format trace never reuses output blocks: a turn's ``hash_ids`` extend the
previous *prompt's* full blocks with new ids. Here 16 sessions of two turns each, block
size 32, a pool large enough that nothing is evicted: turn 1 has a 4-block prompt and a
40-token response (one full block of response tokens), turn 2 a 198-token prompt (6 full
blocks, the first 4 shared with turn 1).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvhint.router.sim.engine import SimConfig, Simulation
from kvhint.router.sim.trace import load_trace


def _rows() -> list[dict]:
    rows = []
    for n in range(16):
        first = [1000 * n + k for k in range(4)]
        rows.append({"timestamp": 10_000 * n, "session_id": f"s{n}", "input_length": 128,
                     "output_length": 40, "hash_ids": first})
        rows.append({"timestamp": 10_000 * n + 5000, "session_id": f"s{n}",
                     "input_length": 198, "output_length": 40,
                     "hash_ids": first + [1000 * n + 10 + k for k in range(3)]})
    return rows


def _run(path: Path, limit: int | None) -> Simulation:
    sim = Simulation(load_trace(path, block_size=32, limit=limit),
                     SimConfig(workers=1, gpu_blocks=400, block_size=32), "kvhint")
    sim.run()
    return sim


def test_next_turns_that_skip_the_response_make_protections_cover_prompts_only(
        tmp_path: Path) -> None:
    path = tmp_path / "turns.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in _rows()))
    sim = _run(path, None)
    # 16 next turns found their previous prompt cached and nothing of the response
    # (counts decay by 0.999 per observation).
    assert sim.learned.of("default").completion_reads.finished == pytest.approx(16, abs=0.2)
    assert sim.learned.of("default").completion_reads.returned == 0
    assert sim.learned.of("default").completion_read_probability() < 0.5
    # After turn 2 a session's chain is 198 + 40 = 238 tokens, 7 full blocks: the last
    # session's retain covers the 6 prompt blocks only.
    last = sim.sessions["default/s15"].protection
    assert last is not None and last.blocks == 6
    # Control: after the first two sessions (two observations against the prior's ten)
    # the retain still covers the response's block too.
    early = _run(path, 4)
    assert early.learned.of("default").completion_read_probability() > 0.5
    second = early.sessions["default/s1"].protection
    assert second is not None and second.blocks == 7


def test_the_planner_remembers_the_blocks_the_worker_retained(tmp_path: Path) -> None:
    """A retain budget of 4 blocks (1% of 400): the 7-block retain after a session's turn
    is clipped to 4 by the plugin, and the simulator's session state says 4, as the live
    router's does (SessionPlanState.settled)."""
    path = tmp_path / "one.jsonl"
    path.write_text(json.dumps({"timestamp": 0, "session_id": "s0", "input_length": 198,
                                "output_length": 40,
                                "hash_ids": [1, 2, 3, 4, 5, 6, 7]}) + "\n")
    sim = Simulation(load_trace(path, block_size=32),
                     SimConfig(workers=1, gpu_blocks=400, block_size=32,
                               plugin={"retain_budget_fraction": 0.01}), "kvhint")
    result = sim.run()
    assert result.hints_by_action()["kv.retain"]["clipped"] >= 1
    protection = sim.sessions["default/s0"].protection
    assert protection is not None and protection.blocks == 4


def test_blocks_relieved_under_pressure_leave_the_planners_view(tmp_path: Path) -> None:
    """A 20-block pool with the retain budget at 0.9: s0's 7-block retain, then s1's
    16-block prompt, which vLLM can allocate only after the plugin relieves 3 of s0's
    retained blocks. The worker reports it, and the simulator's planner state follows as
    the live router's does: s0 is protected by 4 blocks, and the planner's ledger counts
    what the plugin holds."""
    path = tmp_path / "pressure.jsonl"
    rows = [{"timestamp": 0, "session_id": "s0", "input_length": 198, "output_length": 40,
             "hash_ids": [1, 2, 3, 4, 5, 6, 7]},
            {"timestamp": 5000, "session_id": "s1", "input_length": 32 * 15 + 5,
             "output_length": 2, "hash_ids": list(range(100, 116))}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    sim = Simulation(load_trace(path, block_size=32),
                     SimConfig(workers=1, gpu_blocks=20, block_size=32,
                               plugin={"retain_budget_fraction": 0.9}), "kvhint")
    result = sim.run()
    assert result.to_json()["released_blocks"] == {"kv.retain|pressure": 3}
    protection = sim.sessions["default/s0"].protection
    assert protection is not None and protection.blocks == 4
    plugin = sim.workers["w0"].core.executor
    assert sim.ledger.worker("w0").retained_blocks == plugin.retained_blocks == 18
