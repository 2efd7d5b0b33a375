"""The live router plans a session's protection with its chain (the record's
``last_block_hashes``, what the sent Pin/Retain is recorded by) and the holdings ledger's
count of what it adds (``HintDispatcher.context``): a tenant near its retain cap, its
system prompt held by a shared prefix's Retain, gets its new session's Retain, costed at
the blocks the session adds. Before, the session was charged its whole chain and refused.
The real lifecycle, dispatcher, ledger and planner; NATS is a recording link, as in
test_service_planning.py (the publish is not what this checks)."""

from __future__ import annotations

import asyncio
import time

from kvhint.router.policy import PlannerConfig
from kvhint.router.service.hint_dispatch import HintDispatcher
from kvhint.router.service.lifecycle import SessionLifecycle
from kvhint.router.service.metrics import RouterMetrics
from kvhint.router.service.response_scan import ResponseObservation
from kvhint.router.service.sessions import SessionRegistry
from kvhint.router.service.settings_tenants import TenantBudget
from kvhint.router.service.workers import HeartbeatVerdict, WorkerRegistry
from kvhint.schemas import Budgets, Subjects, Usage, WorkerStatus, decode_hints

BS = 4
SYSTEM = tuple(range(1, 61))  # a 60-block system prompt
OWN = tuple(range(1001, 1041))  # the new session's own 40 blocks


class RecordingLink:
    """Stands in for NatsLink.publish (the one call the dispatcher makes)."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, bytes]] = []

    async def publish(self, subject: str, payload: bytes) -> bool:
        self.sent.append((subject, payload))
        return True


def _status() -> WorkerStatus:
    return WorkerStatus(
        worker_id="w0", epoch="e1", model="tiny", cache_namespace="ns", block_size=BS,
        hash_algo="sha256", none_hash_seed="vllm-none-hash",
        supported_actions={"kv.pin": ["1.0"], "kv.retain": ["1.0"]},
        budgets=Budgets(max_pinned_blocks=500, max_pin_ttl_s=600, max_retained_blocks=2000,
                        max_retain_ttl_s=3600),
        usage=Usage(gpu_blocks_total=4000, gpu_blocks_free=4000, kv_usage=0.0),
        interval_s=1.0, at=time.time())


def _retains_sent(cap: int) -> tuple[list, HintDispatcher]:
    registry = WorkerRegistry([("w0", "http://w0")])
    assert registry.on_heartbeat(_status()) is HeartbeatVerdict.FIRST
    link = RecordingLink()
    budget = TenantBudget(max_retained_blocks=cap)
    hints = HintDispatcher(link, Subjects("t"), registry, None, RouterMetrics(),
                           PlannerConfig(), seed=1, budget_of=lambda _tenant: budget)
    lifecycle = SessionLifecycle(SessionRegistry(None, max_sessions=100), hints,
                                 RouterMetrics(), hints_enabled=True, forget_after_s=3600)
    # The tenant's shared prefix's Retain holds the system prompt (as the lifecycle's
    # scan sends it: block-hash target).
    hints.holdings.record(action_id="prefix", worker_id="w0", tenant="default",
                          scope="prefix:default:sys", action_type="kv.retain",
                          blocks=len(SYSTEM), expires_at=time.time() + 600, keys=SYSTEM)

    async def scenario() -> None:
        record = lifecycle.begin_turn("default", "new")
        await lifecycle.routed(record, "w0", prompt_tokens=400, predicted_cached=0,
                               block_hashes=(*SYSTEM, *OWN))
        await lifecycle.finished(record, "w0", ResponseObservation(
            finish_reason="stop", tool_names=[], prompt_tokens=400, completion_tokens=2,
            cached_tokens=0), session_end=False)

    asyncio.run(scenario())
    actions = [a for _subject, payload in link.sent for a in decode_hints(payload).actions]
    return [a for a in actions if a.action_type.value == "kv.retain"
            and a.payload.target.session_id == "default/new" and a.payload.priority], hints


def test_a_new_session_over_a_retained_system_prompt_is_retained_near_the_tenant_cap() -> None:
    # 60 held; the session's 100 blocks add 40: a cap of 100 has room for them.
    (retain,), hints = _retains_sent(cap=100)
    assert retain.payload.target.prefix_tokens == 100 * BS
    assert hints.holdings.tenant("default").retained_blocks == 100  # the ledger agrees
    # One block less: refused (the ledger would count 101).
    assert _retains_sent(cap=99)[0] == []
