"""The simulator's planner context counts no holding past its TTL, as the live router's
(test_service_context_expiry.py): the planner subtracts a session's own protection only
until its TTL (planner._own_held), and the ledger the simulator ticks every ``tick_s``
must agree at the moment it plans."""

from __future__ import annotations

import json
from pathlib import Path

from kvhint.router.sim.engine import SimConfig, Simulation
from kvhint.router.sim.trace import load_trace

BS = 32


def test_planner_context_lets_holdings_past_their_ttl_go(tmp_path: Path) -> None:
    path = tmp_path / "one.jsonl"
    path.write_text(json.dumps({"timestamp": 0, "input_length": 64, "output_length": 0,
                                "hash_ids": [1, 2]}) + "\n")
    sim = Simulation(load_trace(path, block_size=BS),
                     SimConfig(workers=1, gpu_blocks=64, block_size=BS), "kvhint")
    (worker_id,) = sim.workers
    sim.ledger.record(action_id="p1", worker_id=worker_id, tenant=None, scope="s",
                      action_type="kv.pin", blocks=3, expires_at=10.0)
    sim.now = 9.0
    assert sim._planner_ctx(None).workers[worker_id].held.pinned_blocks == 3
    sim.now = 10.0
    assert sim._planner_ctx(None).workers[worker_id].held.pinned_blocks == 0
