"""The sessions API's budget gate: what an agent runtime's hints may hold, per tenant and
per worker, with the real dispatcher and holdings ledger."""

from __future__ import annotations

import time

import pytest

from kvhint.router.policy import HoldingsLedger, PlannedAction
from kvhint.router.policy.holdings import Holdings
from kvhint.router.service.hint_api_actions import target_blocks
from kvhint.router.service.settings import RouterSettings, TenantBudget
from kvhint.router.service.tenancy import TenantDirectory
from kvhint.schemas import (
    KvHintAction,
    PinPayload,
    PrefetchPayload,
    RetainPayload,
    Target,
    make_action,
)

from test_service_planning import build


def test_api_hints_are_held_to_the_tenants_budgets_and_the_workers_pin_budget() -> None:
    """A worker's retain budget is soft (it displaces or clips): an API Retain is not
    refused by the worker's retained count, as the planner's are not. Pins are: their
    budget is hard."""
    _registry, _m, _l, hints, _s, _lc, _i, _r = build(["w0"])
    for n in range(30):  # 30 retains of 8 blocks: 240 held, the worker's budget 200
        hints.holdings.record(action_id=f"r{n}", worker_id="w0", tenant="t", scope=f"t/s{n}",
                              action_type="kv.retain", blocks=8, expires_at=1e12)
    hints.holdings.record(action_id="p", worker_id="w0", tenant="t", scope="t/p",
                          action_type="kv.pin", blocks=48, expires_at=1e12)

    def planned(payload: object, blocks: int) -> PlannedAction:
        return PlannedAction("w0", make_action(f"kva-{blocks}", payload), "t/x", "t", blocks,
                             1e12, "api")

    budget = TenantBudget(max_pinned_blocks=1000, max_retained_blocks=1000)
    target = Target(session_id="t/x")
    assert hints.api_budget_problem("t", budget, "w0", [planned(
        RetainPayload(target=target, priority=50), 8)], time.time()) is None
    assert hints.api_budget_problem("t", budget, "w0", [planned(
        PinPayload(target=target, ttl_s=30), 8)], time.time()) == (
        "worker w0 has no room for these pinned blocks (its limit 50 is shared by every "
        "tenant)")
    assert "tenant 't' would hold 248 retained blocks" in hints.api_budget_problem(
        "t", TenantBudget(max_retained_blocks=240), "w0",
        [planned(RetainPayload(target=target, priority=50), 8)], time.time())
    # A Prefetch counts as retained (the worker retains what it brings in until its
    # deadline): before, a tenant at its retained cap could prefetch without limit.
    assert "tenant 't' would hold 248 retained blocks" in hints.api_budget_problem(
        "t", TenantBudget(max_retained_blocks=240), "w0",
        [planned(PrefetchPayload(target=target, deadline_s=600), 8)], time.time())


def test_api_budgets_count_blocks_already_held_the_same_way_once() -> None:
    """Two agents pin their sessions, which share a 30-block system prompt: the second
    pin adds its own 5 blocks to what the tenant and the worker hold pinned, not 35 (it
    was refused with a 429 under a cap the worker's real count fits). A Retain over
    pinned blocks adds nothing to the retained count either."""
    _registry, _m, _l, hints, _s, _lc, _i, _r = build(["w0"])  # worker: 50 pinnable
    system = list(range(1000, 1030))
    first, second = [*system, *range(1, 6)], [*system, *range(11, 16)]
    hints.holdings.record(action_id="p1", worker_id="w0", tenant="t", scope="agent:t/a",
                          action_type="kv.pin", blocks=35, expires_at=1e12, keys=first)
    assert hints.holdings.tenant("t").pinned_blocks == 35

    def planned(payload: object, blocks: int) -> PlannedAction:
        return PlannedAction("w0", make_action("kva-b", payload), "agent:t/b", "t", blocks,
                             1e12, "api")

    budget = TenantBudget(max_pinned_blocks=40, max_retained_blocks=5)
    pin = planned(PinPayload(target=Target(session_id="t/b"), ttl_s=30), 35)
    assert hints.api_budget_problem("t", budget, "w0", [pin], time.time(), second) is None
    # Without the chain the router cannot name the blocks: all 35 count.
    assert hints.api_budget_problem("t", budget, "w0", [pin], time.time()) == (
        "tenant 't' would hold 70 pinned blocks (limit 40)")
    assert hints.api_budget_problem("t", budget, "w0", [pin], time.time(), [
        *system[:25], *range(100, 110)]) == (  # shares 25 of the 30: 10 more
        "tenant 't' would hold 45 pinned blocks (limit 40)")
    retain = planned(RetainPayload(target=Target(session_id="t/b", prefix_tokens=30 * 4),
                                   priority=50), 30)
    assert hints.api_budget_problem("t", budget, "w0", [retain], time.time(), second) is None


def test_a_tenant_without_a_budget_of_its_own_is_bounded_by_the_workers_only() -> None:
    """The default tenant budget caps no holds: with a fixed cap (it was 16,384 retained
    blocks) the planner stopped retaining for a tenant long before a GPU fleet's retain
    budgets filled, and the simulator, which has no tenant caps, planned another fleet."""
    budget = TenantBudget()
    _registry, _m, _l, hints, _s, _lc, _i, _r = build(["w0"], budget)
    hints.holdings.record(action_id="r", worker_id="w0", tenant="t", scope="t/s",
                          action_type="kv.retain", blocks=100_000, expires_at=1e12)
    assert (budget.max_pinned_blocks, budget.max_retained_blocks) == (None, None)
    action = PlannedAction("w0", make_action("kva-r", RetainPayload(
        target=Target(session_id="t/x"), priority=50)), "t/x", "t", 8, 1e12, "api")
    assert hints.api_budget_problem("t", budget, "w0", [action], time.time()) is None
    config = hints.context(tenant="t").config
    assert (config.tenant_max_pinned_blocks, config.tenant_max_retained_blocks) == (None, None)


def test_an_api_actions_blocks_are_what_its_target_can_cover() -> None:
    """Counted against budgets until the worker answers: a prefix of the session's chain,
    or the named blocks, not the session's whole chain (10 blocks here)."""
    def action(target: dict) -> KvHintAction:
        return KvHintAction("kva-x", "kv.retain", "1.0", {"target": target, "priority": 50})

    assert target_blocks(action({"session_id": "t/s"}), 10, 16) == 10
    assert target_blocks(action({"session_id": "t/s", "prefix_tokens": 40}), 10, 16) == 2
    assert target_blocks(action({"session_id": "t/s", "prefix_tokens": 4000}), 10, 16) == 10
    assert target_blocks(action({"block_hashes": [1, 2, 3]}), 10, 16) == 3


def test_one_tenants_agents_hold_at_most_their_share_of_a_workers_budgets() -> None:
    """A worker's pin and retain budgets are every tenant's, and an agent's Retain at
    priority 100 displaces any lower claim, another tenant's included. Tenant a's agents
    hold 100 retained and 25 pinned blocks on w0 (budgets 200 and 50): at a share of 0.5
    a's next claims are refused there, b's are not, and the planner's holdings for a's
    sessions do not count against a's agents. Before, a's agents could take the whole
    pin budget, and displace every other tenant's retains, up to a's own caps only."""
    _registry, _m, _l, hints, _s, _lc, _i, _r = build(["w0"])
    ledger = hints.holdings
    for n in range(10):
        ledger.record(action_id=f"r{n}", worker_id="w0", tenant="a", scope=f"agent:a/s{n}",
                      action_type="kv.retain", blocks=10, expires_at=1e12, api=True)
    ledger.record(action_id="p", worker_id="w0", tenant="a", scope="agent:a/p",
                  action_type="kv.pin", blocks=25, expires_at=1e12, api=True)
    ledger.record(action_id="planned", worker_id="w0", tenant="a", scope="a/q",
                  action_type="kv.retain", blocks=60, expires_at=1e12)
    assert ledger.api_on_worker("a", "w0") == Holdings(pinned_blocks=25, retained_blocks=100)
    assert ledger.tenant("a") == Holdings(pinned_blocks=25, retained_blocks=160)

    def problem(tenant: str, payload: object, share: float) -> str | None:
        action = PlannedAction("w0", make_action("kva-x", payload), f"agent:{tenant}/x",
                               tenant, 8, 1e12, "api")
        return hints.api_budget_problem(tenant, TenantBudget(), "w0", [action], time.time(),
                                        worker_share=share)

    retain = RetainPayload(target=Target(session_id="a/x"), priority=100)
    pin = PinPayload(target=Target(session_id="a/x"), ttl_s=30)
    assert problem("a", retain, 0.5) == (
        "tenant 'a' on worker w0 (share 0.5) would hold 108 retained blocks (limit 100)")
    assert problem("a", pin, 0.5) == (
        "tenant 'a' on worker w0 (share 0.5) would hold 33 pinned blocks (limit 25)")
    assert problem("b", retain, 0.5) is None
    assert problem("b", pin, 0.5) is None
    assert problem("a", retain, 1.0) is None  # one tenant: the worker's budgets only
    assert problem("a", retain, 0.6) is None  # 108 of 120


def test_an_agents_holding_the_planner_replaces_stops_counting_as_the_agents() -> None:
    """On a worker that does not keep owners apart, an API claim and the planner's share
    the session's scope: the planner's next protection replaces the agent's, whose blocks
    then no longer count against the tenant's agent share (the blocks both name are
    not carried over from one count to the other)."""
    ledger = HoldingsLedger()
    chain = list(range(20))
    ledger.record(action_id="api", worker_id="w0", tenant="a", scope="a/s",
                  action_type="kv.retain", blocks=20, expires_at=1e12, keys=chain, api=True)
    assert ledger.api_on_worker("a", "w0").retained_blocks == 20
    ledger.record(action_id="planner", worker_id="w0", tenant="a", scope="a/s",
                  action_type="kv.retain", blocks=20, expires_at=1e12, keys=chain)
    assert ledger.api_on_worker("a", "w0") == Holdings()
    assert ledger.tenant("a").retained_blocks == ledger.worker("w0").retained_blocks == 20


def test_each_configured_tenant_gets_an_equal_share_of_a_worker_unless_it_names_one() -> None:
    one = TenantDirectory(RouterSettings(tenants=[{"name": "a", "api_keys": ["ka"]}]))
    assert one.get("a").worker_share == one.get("default").worker_share == 1.0
    three = TenantDirectory(RouterSettings(tenants=[
        {"name": "a", "api_keys": ["ka"]}, {"name": "b", "api_keys": ["kb"]},
        {"name": "c", "api_keys": ["kc"], "budget": {"max_worker_share": 0.8}}]))
    assert [three.get(n).worker_share for n in ("a", "b", "c", "default")] == [
        pytest.approx(1 / 3), pytest.approx(1 / 3), 0.8, pytest.approx(1 / 3)]
    assert TenantDirectory(RouterSettings()).get("default").worker_share == 1.0
    with pytest.raises(ValueError, match="max_worker_share"):
        TenantBudget(max_worker_share=1.5)


def test_a_refusal_for_the_workers_pin_budget_says_nothing_of_what_others_hold() -> None:
    """w0 may pin 50 blocks, tenant b's sessions hold 43 or 48 of them; a's 8-block Pin
    is refused either way, and a reads the same answer: that the worker's shared budget
    has no room, not how much the others hold. Before, "worker w0 would hold 51 (or 56)
    pinned blocks" told a what every other tenant pinned there."""
    answers = set()
    for held in (43, 48):
        _registry, _m, _l, hints, _s, _lc, _i, _r = build(["w0"])
        hints.holdings.record(action_id="b", worker_id="w0", tenant="b", scope="b/s",
                              action_type="kv.pin", blocks=held, expires_at=1e12)
        pin = PlannedAction("w0", make_action("kva-a", PinPayload(
            target=Target(session_id="a/x"), ttl_s=30)), "a/x", "a", 8, 1e12, "api")
        answers.add(hints.api_budget_problem("a", TenantBudget(), "w0", [pin], time.time()))
    assert answers == {"worker w0 has no room for these pinned blocks (its limit 50 is "
                       "shared by every tenant)"}
