"""The router's checks against a hybrid worker's pool-block budgets (status 1.3
``claim_cost``), with the real dispatcher, registry and holdings ledger: the planner's
context carries the worker's cost and live Pins, and the sessions API's worker checks
count what is held and asked in pool blocks (before: positions, under the budgets the
worker counts in pool blocks, so an agent's Pin the gate let through was clipped)."""

from __future__ import annotations

import time

from kvhint.router.policy import PlannedAction, PlannerConfig
from kvhint.router.service.hint_dispatch import HintDispatcher
from kvhint.router.service.metrics import RouterMetrics
from kvhint.router.service.settings import TenantBudget
from kvhint.router.service.workers import HeartbeatVerdict, WorkerRegistry
from kvhint.schemas import (
    Budgets,
    ClaimCost,
    PinPayload,
    RetainPayload,
    Subjects,
    Target,
    Usage,
    WorkerStatus,
    make_action,
)

GEMMA = ClaimCost(per_position=1, tails=[2] * 5)  # a claim of n: n + 5 x min(n, 2)


def _hints(cost: ClaimCost | None = GEMMA) -> HintDispatcher:
    status = WorkerStatus(
        worker_id="w0", epoch="e1", model="tiny", cache_namespace="ns", block_size=4,
        hash_algo="sha256", none_hash_seed="vllm-none-hash",
        supported_actions={"kv.pin": ["1.0"], "kv.retain": ["1.0"]},
        budgets=Budgets(max_pinned_blocks=50, max_pin_ttl_s=600, max_retained_blocks=200,
                        max_retain_ttl_s=3600),
        usage=Usage(gpu_blocks_total=400, gpu_blocks_free=400, kv_usage=0.0),
        interval_s=1.0, at=time.time(), **({} if cost is None else {"claim_cost": cost}))
    registry = WorkerRegistry([("w0", "http://w0")])
    assert registry.on_heartbeat(status) is HeartbeatVerdict.FIRST
    return HintDispatcher(None, Subjects("t"), registry, None, RouterMetrics(),
                          PlannerConfig(), seed=1)


def _planned(payload: object, blocks: int) -> PlannedAction:
    return PlannedAction("w0", make_action(f"kva-{blocks}", payload), "agent:t/x", "t", blocks,
                         1e12, "api")


def test_the_planners_view_carries_the_workers_claim_cost_and_live_pins() -> None:
    hints = _hints()
    hints.holdings.record(action_id="p1", worker_id="w0", tenant="t", scope="t/s",
                          action_type="kv.pin", blocks=30, expires_at=1e12)
    view = hints.context(tenant="t").workers["w0"]
    assert view.claim_cost == GEMMA and view.pinned_claims == 1
    assert view.held.pinned_blocks == 30  # positions, as before
    assert _hints(None).context().workers["w0"].claim_cost is None


def test_an_api_pin_is_checked_against_the_workers_pin_budget_in_pool_blocks() -> None:
    """30 positions under one Pin hold at most 40 pool blocks; a Pin of 4 positions
    takes 14: 54 > 50 (in positions 34, which let it through)."""
    hints = _hints()
    hints.holdings.record(action_id="p1", worker_id="w0", tenant="u", scope="u/s",
                          action_type="kv.pin", blocks=30, expires_at=1e12)
    budget = TenantBudget(max_pinned_blocks=1000, max_retained_blocks=1000)
    pin = _planned(PinPayload(target=Target(session_id="t/x"), ttl_s=30), 4)
    assert hints.api_budget_problem("t", budget, "w0", [pin], time.time()) == (
        "worker w0 has no room for these pinned blocks (its limit 50 is shared by every "
        "tenant)")
    hints.holdings.record(action_id="p1", worker_id="w0", tenant="u", scope="u/s",
                          action_type="kv.pin", blocks=20, expires_at=1e12)
    assert hints.api_budget_problem("t", budget, "w0", [pin], time.time()) is None  # 44
    # A one-group worker: positions, as before (34 <= 50).
    plain = _hints(None)
    plain.holdings.record(action_id="p1", worker_id="w0", tenant="u", scope="u/s",
                          action_type="kv.pin", blocks=30, expires_at=1e12)
    assert plain.api_budget_problem("t", budget, "w0", [pin], time.time()) is None


def test_a_tenants_share_of_a_hybrid_worker_is_counted_in_pool_blocks() -> None:
    """Half of the worker's 200 retained pool blocks: the tenant's agents hold 80
    positions under one Retain (90 pool blocks); a Retain of 4 more takes 14: 104 > 100
    (in positions 84, which let it through)."""
    hints = _hints()
    hints.holdings.record(action_id="r1", worker_id="w0", tenant="t", scope="agent:t/a",
                          action_type="kv.retain", blocks=80, expires_at=1e12, api=True)
    budget = TenantBudget(max_pinned_blocks=1000, max_retained_blocks=1000)
    retain = _planned(RetainPayload(target=Target(session_id="t/x"), priority=50), 4)
    assert hints.api_budget_problem("t", budget, "w0", [retain], time.time(),
                                    worker_share=0.5) == (
        "tenant 't' on worker w0 (share 0.5) would hold 104 retained blocks (limit 100)")
    assert hints.api_budget_problem("t", budget, "w0", [retain], time.time(),
                                    worker_share=0.6) is None
