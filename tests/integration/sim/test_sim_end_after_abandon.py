"""An end line for a session the simulator's planner had already abandoned (the router's
recorder writes one for a client's DELETE after the live planner abandoned the session):
the replay ends it as the live router does, sending nothing of the planner's again."""

from __future__ import annotations

import json
from pathlib import Path

from kvhint.router.sim.engine import SimConfig, Simulation
from kvhint.router.sim.trace import load_trace


def _run(tmp_path: Path, end: bool) -> Simulation:
    rows = [{"timestamp": 0, "session_id": "s", "input_length": 320, "output_length": 8,
             "hash_ids": list(range(1, 11)), "finish_reason": "stop"}]
    if end:  # an hour and a half later: the planner abandoned s after an hour
        rows.append({"timestamp": 5_400_000, "session_id": "s", "end": True})
    rows.append({"timestamp": 6_000_000, "session_id": "u", "input_length": 320,
                 "output_length": 8, "hash_ids": list(range(101, 111)),
                 "finish_reason": "stop"})
    path = tmp_path / f"end-{end}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    sim = Simulation(load_trace(path, block_size=32),
                     SimConfig(workers=1, gpu_blocks=256, block_size=32), "kvhint")
    sim.run()
    return sim


def test_an_end_after_an_abandonment_sends_nothing_and_is_the_clients(tmp_path: Path) -> None:
    """Before, the end line ran the planner's end again on the abandoned session: one
    more Retain went out (11 actions against 10) that the live router never sends."""
    abandoned = _run(tmp_path, end=False)
    ended = _run(tmp_path, end=True)
    s = ended.sessions["default/s"]
    assert s.ended and s.ended_explicitly and s.last_activity == 5_400.0
    before = abandoned.sessions["default/s"]
    assert before.ended and not before.ended_explicitly
    assert ended.result.hints == abandoned.result.hints
