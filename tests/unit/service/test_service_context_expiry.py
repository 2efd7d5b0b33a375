"""The planner's context counts no holding past its TTL: the planner subtracts a
session's own protection from what its worker and tenant hold only until that
protection's TTL (planner._own_held), so the ledger behind the context must have let
expired holdings go by then, or the room it shows is short by their blocks."""

from __future__ import annotations

import time

from kvhint.router.policy import PlannerConfig
from kvhint.router.service.hint_dispatch import HintDispatcher
from kvhint.router.service.metrics import RouterMetrics
from kvhint.router.service.workers import HeartbeatVerdict, WorkerRegistry
from kvhint.schemas import Budgets, Subjects, Usage, WorkerStatus


def _status(worker: str) -> WorkerStatus:
    return WorkerStatus(
        worker_id=worker, epoch="e1", model="tiny", cache_namespace="ns", block_size=4,
        hash_algo="sha256", none_hash_seed="vllm-none-hash",
        supported_actions={"kv.pin": ["1.0"], "kv.retain": ["1.0"]},
        budgets=Budgets(max_pinned_blocks=50, max_pin_ttl_s=600, max_retained_blocks=200,
                        max_retain_ttl_s=3600),
        usage=Usage(gpu_blocks_total=100, gpu_blocks_free=100, kv_usage=0.0),
        interval_s=1.0, at=time.time())


def test_context_lets_holdings_past_their_ttl_go_before_the_planner_reads_them() -> None:
    registry = WorkerRegistry([("w0", "http://w0")])
    assert registry.on_heartbeat(_status("w0")) is HeartbeatVerdict.FIRST
    hints = HintDispatcher(None, Subjects("t"), registry, None, RouterMetrics(),
                           PlannerConfig(), seed=1)
    hints.holdings.record(action_id="p1", worker_id="w0", tenant="t", scope="t/s",
                          action_type="kv.pin", blocks=30, expires_at=10.0)
    live = hints.context(now=9.0, tenant="t")
    assert live.workers["w0"].held.pinned_blocks == 30
    assert live.tenant_held["t"].pinned_blocks == 30
    over = hints.context(now=10.0, tenant="t")
    assert over.workers["w0"].held.pinned_blocks == 0
    assert over.tenant_held["t"].pinned_blocks == 0
