"""The simulator plans a session with the same inputs as the live router
(HintDispatcher.context, test_service_session_first_retain_budget.py): the session's
chain (the hashes its Pin/Retain is recorded by, ``HintLoop._send``) and the ledger's
count of what a protection adds, so both run the same budget checks
(test_policy_session_shared_budget.py)."""

from __future__ import annotations

import json
from pathlib import Path

from kvhint.router.policy import Holdings
from kvhint.router.sim.engine import SimConfig, Simulation
from kvhint.router.sim.trace import load_trace

BS = 32


def test_the_planner_context_carries_the_sessions_chain_and_the_ledgers_count(
        tmp_path: Path) -> None:
    path = tmp_path / "one.jsonl"
    path.write_text(json.dumps({"timestamp": 0, "input_length": 64, "output_length": 0,
                                "hash_ids": [1, 2]}) + "\n")
    sim = Simulation(load_trace(path, block_size=BS),
                     SimConfig(workers=1, gpu_blocks=64, block_size=BS), "kvhint")
    (worker_id,) = sim.workers
    sim._last_hashes["s"] = (11, 12, 13)
    # Another session's Pin holds the first two blocks.
    sim.ledger.record(action_id="p1", worker_id=worker_id, tenant=None, scope="o",
                      action_type="kv.pin", blocks=2, expires_at=10.0, keys=(11, 12))
    ctx = sim._planner_ctx(None, "s")
    assert tuple(ctx.chain) == (11, 12, 13)
    assert ctx.holding_change is not None
    on_worker, _ = ctx.holding_change(worker_id, None, "s", "kv.pin", 3, ctx.chain)
    assert on_worker.added == Holdings(1, 0)  # what the ledger would count: one more
    assert tuple(sim._planner_ctx(None).chain) == ()  # no session: none
