"""The simulator plans a hybrid model's Pins as the live router does: in the worker's
budget unit, pool blocks (status 1.3 ``claim_cost``, ``router.policy.claim_cost``).

The scheduler engine with a sliding window beside full attention (``SimConfig.sliding_window``:
vLLM's real Scheduler and KVCacheManager over two KV cache groups): each worker's planner
view carries the claim cost its status heartbeat advertises and its live Pins, as the live
router's context does (``router/service/hint_dispatch.py``). Before, the simulator's views
had neither: it planned Pins in target positions against a pool-block budget, and the
plugin clipped some for their other group's blocks ("pin budget"), where the live router
would have retained the session at top priority instead.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from kvhint.router.sim.agents import AgentWorkloadSpec, generate
from kvhint.router.sim.engine import SimConfig, Simulation
from kvhint.router.sim.trace import load_trace
from kvhint.schemas import decode_status, encode_status


def test_hybrid_workers_pins_are_planned_in_pool_blocks(tmp_path: Path) -> None:
    rows = generate(AgentWorkloadSpec(seed=1))[:150]  # 2 "pin budget" clips before
    path = tmp_path / "agents.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    sim = Simulation(load_trace(path, block_size=512),
                     SimConfig(workers=2, gpu_blocks=400, engine="scheduler",
                               sliding_window=1024), "kvhint")
    advertised = {w: decode_status(encode_status(worker.core.worker_status())).claim_cost
                  for w, worker in sim.workers.items()}
    assert all(cost and cost.tails == [2] for cost in advertised.values())  # 1024 / 512
    views: Counter[str] = Counter()
    plan, settle = sim._planner_ctx, sim._on_outcomes  # observed, not replaced

    def observed_plan(tenant, session_key=None):
        ctx = plan(tenant, session_key)
        for worker_id, view in ctx.workers.items():
            assert view.claim_cost == advertised[worker_id]
            assert view.pinned_claims == sim.ledger.claims(worker_id)[0]
            views["with pins"] += view.pinned_claims > 0
        return ctx

    clipped: Counter[str] = Counter()

    def observed_settle(outcomes):
        for outcome in outcomes:
            if outcome.action_type == "kv.pin" and outcome.status.value == "clipped":
                clipped["pin budget" if "pin budget" in outcome.reason else "other"] += 1
        return settle(outcomes)

    sim._planner_ctx, sim._on_outcomes = observed_plan, observed_settle
    result = sim.run()
    assert result.hints[("kv.pin", "sent")] > 0 and views["with pins"] > 0
    assert clipped["pin budget"] == 0, clipped


def test_sliding_window_needs_the_scheduler_engine() -> None:
    with pytest.raises(ValueError, match="sliding_window"):
        SimConfig(sliding_window=1024)
    with pytest.raises(ValueError, match="sliding_window"):
        SimConfig(engine="scheduler", sliding_window=-1)
