"""Rolling upgrades: a router and plugins of different versions, and a store written by
a newer router. What one side does not know must cost only that much, never the rest
of the message or of the plan.

The wire halves are driven the way the cluster feed drives them (decode, then each
release to ``on_release`` / the outcome to ``on_outcome``)."""

from __future__ import annotations

import asyncio
import json
import time

from kvhint.router.policy import PlannedAction, PlannerConfig
from kvhint.router.policy.session import SessionPlanState
from kvhint.router.service.hint_dispatch import HintDispatcher
from kvhint.router.service.metrics import RouterMetrics
from kvhint.router.service.sessions import SessionRecord
from kvhint.router.service.workers import HeartbeatVerdict, WorkerRegistry
from kvhint.schemas import (
    Amount,
    Budgets,
    HintOutcome,
    OutcomeStatus,
    PinPayload,
    Subjects,
    Target,
    Usage,
    WorkerStatus,
    decode_outcome,
    decode_releases,
    make_action,
)


class _Link:
    async def publish(self, subject: str, payload: bytes) -> bool:
        return True


def _dispatcher() -> tuple[HintDispatcher, RouterMetrics]:
    registry = WorkerRegistry([("w0", "http://w0")])
    assert registry.on_heartbeat(WorkerStatus(
        worker_id="w0", epoch="e1", model="tiny", cache_namespace="ns", block_size=4,
        hash_algo="sha256", none_hash_seed="vllm-none-hash",
        supported_actions={"kv.pin": ["1.0"], "kv.retain": ["1.0"]},
        budgets=Budgets(max_pinned_blocks=50, max_pin_ttl_s=600, max_retained_blocks=200,
                        max_retain_ttl_s=3600),
        usage=Usage(gpu_blocks_total=100, gpu_blocks_free=100, kv_usage=0.0),
        interval_s=1.0, at=time.time())) is HeartbeatVerdict.FIRST
    metrics = RouterMetrics()
    return HintDispatcher(_Link(), Subjects("t"), registry, None, metrics, PlannerConfig(),
                          seed=1), metrics


async def _pin(hints: HintDispatcher, session: str, blocks: int, *, accept: bool) -> str:
    """Send the planner's Pin of ``session``; the worker accepts it whole if ``accept``."""
    action = make_action(f"kvh-{session}-{time.monotonic_ns()}",
                         PinPayload(target=Target(session_id=f"default/{session}"), ttl_s=60))
    [sent] = await hints.send([PlannedAction("w0", action, f"default/{session}", "default",
                                             blocks, time.time() + 60, "planner")],
                              {f"default/{session}": session}, source="planner")
    if accept:
        hints.on_outcome(HintOutcome(
            message_id="m", action_id=sent.action_id, action_type="kv.pin", worker_id="w0",
            status=OutcomeStatus.ACCEPTED, requested=Amount(blocks, 4 * blocks),
            applied=Amount(blocks, 4 * blocks), at=time.time()))
    return sent.action_id


def _release(action_id: str, reason: str, released: int, held: int) -> dict:
    return {"action_id": action_id, "action_type": "kv.pin", "session_id": "default/s",
            "reason": reason, "released": {"blocks": released, "tokens": 4 * released},
            "held": {"blocks": held, "tokens": 4 * held}}


def test_a_newer_plugins_release_reason_does_not_cost_the_router_its_budgets() -> None:
    """[a "pressure" release of p1, a "tier_moved" one of p2]: both free what they
    released. Before, the whole message was "malformed hold releases ... Invalid enum
    value 'tier_moved'", both were lost, and the budgets stayed overcounted until the
    TTLs ended (the stream cursor had moved: no replay)."""
    hints, metrics = _dispatcher()

    async def scenario() -> None:
        p1 = await _pin(hints, "s1", 4, accept=True)
        p2 = await _pin(hints, "s2", 6, accept=True)
        assert hints.holdings.worker("w0").pinned_blocks == 10
        message = decode_releases(json.dumps({"worker_id": "w0", "at": time.time(),
                                              "releases": [_release(p1, "pressure", 4, 0),
                                                           _release(p2, "tier_moved", 4, 2)]}))
        assert message.unreadable == ()
        for release in message.releases:  # as the cluster feed does
            hints.on_release(release)
        assert hints.holdings.worker("w0").pinned_blocks == 2
        assert hints.holdings.tenant("default").pinned_blocks == 2
        # The dashboard's recent actions say why as far as this router knows.
        (record,) = [r for r in hints.recent if r.action_id == p2]
        assert (record.release_reason, record.held_after_release_blocks) == ("other", 2)

    asyncio.run(scenario())
    text = metrics.render().decode()
    assert 'kvhint_router_hold_released_blocks_total{action="kv.pin",reason="pressure"} 4.0' \
        in text
    assert 'kvhint_router_hold_released_blocks_total{action="kv.pin",reason="other"} 4.0' \
        in text


def test_a_newer_plugins_terminal_status_settles_the_action_at_once() -> None:
    """An outcome with a status this router does not know ends its action now, as a
    rejection that teaches the planner nothing. Before, it was malformed: the action
    waited 120 s and was marked expired."""
    hints, metrics = _dispatcher()

    async def scenario() -> None:
        for n in range(3):  # more than reject_disable_after: still no capability learned
            action_id = await _pin(hints, f"s{n}", 4, accept=False)
            assert action_id in hints.pending
            outcome = decode_outcome(json.dumps({
                "message_id": "m", "action_id": action_id, "action_type": "kv.pin",
                "worker_id": "w0", "status": "superseded", "requested": {"blocks": 4},
                "applied": {"blocks": 4}, "at": time.time()}))
            record = hints.on_outcome(hints.effective(outcome))
            assert record is not None and record.status == "rejected"
            assert record.reason == "unknown status 'superseded'"
            assert action_id not in hints.pending
        assert "w0" not in hints.feedback or hints.feedback["w0"].view("default").allows("kv.pin")
        assert hints.holdings.worker("w0").pinned_blocks == 0

    asyncio.run(scenario())
    assert ('kvhint_router_hints_total{action="kv.pin",outcome="rejected",'
            'source="planner"} 3.0') in metrics.render().decode()


def _row(plan: dict) -> dict:
    return {"tenant": "default", "session_id": "s1", "created_at": 1.0, "last_activity": 2.0,
            "plan": plan}


def test_a_plan_stored_by_a_newer_router_keeps_its_protection() -> None:
    """A newer router added a key inside ``protection``: this one keeps the plan and the
    protection. Before, ``Protection(**protection)`` raised TypeError and the session's
    whole plan was reset (from_dict promised to keep the rest)."""
    state = SessionPlanState.from_dict({
        "session_id": "default/s1", "tenant": "default", "worker_id": "w0", "turns": 7,
        "protection": {"action_id": "a1", "action_type": "kv.pin", "worker_id": "w0",
                       "priority": 80, "blocks": 12, "expires_at": 99.0}})
    newer = {**state.to_dict(), "added_later": True}
    newer["protection"] = {**newer["protection"], "owner": "agent"}
    assert SessionPlanState.from_dict(newer) == state
    record = SessionRecord.from_row(_row(newer))
    assert record.plan == state


def test_an_unreadable_stored_protection_costs_only_the_protection() -> None:
    data = {"session_id": "default/s1", "tenant": "default", "worker_id": "w0", "turns": 7,
            "protection": {"action_id": "a1", "blocks": 12}}  # needed fields missing
    state = SessionPlanState.from_dict(data)
    assert (state.turns, state.worker_id, state.protection) == (7, "w0", None)
    assert SessionRecord.from_row(_row(data)).plan.turns == 7
