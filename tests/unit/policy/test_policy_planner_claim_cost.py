"""Pins planned in pool blocks on a hybrid model: a worker's pin budget (its heartbeat's
``max_pinned_blocks``) counts pool blocks, and a claim of n target positions takes
``n * per_position + sum(min(n, tail))`` of them there (status 1.3 ``claim_cost``).
Before, the planner checked positions against it, overcommitted, and the worker clipped
the pins it was sent. The tenant's budget stays in positions; a worker without a cost (a
one-group model) is planned as before."""

from __future__ import annotations

from dataclasses import replace

from planner_fixtures import BS, BUDGETS, NO_HOST, fast_search, finish, make_ctx, \
    session_after_turn, typed

from kvhint.router.policy import FinishReason, Holdings, HoldingsLedger, PlannerConfig, \
    WorkerPlanView
from kvhint.router.policy.claim_cost import added_pool_blocks, claim_cost, held_pool_blocks
from kvhint.schemas import Amount, ClaimCost, HintOutcome, OutcomeStatus

# Gemma 3's layout: one full-attention group beside five windows of 2 blocks.
GEMMA = ClaimCost(per_position=1, tails=[2] * 5)
TWO_FULL = ClaimCost(per_position=2, tails=[2])


def test_claim_cost_is_positions_times_per_position_plus_each_tail_up_to_it() -> None:
    assert [claim_cost(n, GEMMA) for n in (0, 1, 2, 8)] == [0, 6, 12, 18]
    assert [claim_cost(n, TWO_FULL) for n in (0, 1, 2, 8)] == [0, 3, 6, 18]
    assert claim_cost(8, None) == 8 and held_pool_blocks(80, 3, None) == 80
    # Held: each position per_position blocks, each live claim its whole tails.
    assert held_pool_blocks(80, 3, GEMMA) == 80 + 3 * 10
    assert held_pool_blocks(80, 3, TWO_FULL) == 160 + 3 * 2
    assert added_pool_blocks(5, [8, 1], GEMMA) == 5 + 10 + 5
    assert added_pool_blocks(5, [8, 1], None) == 5


def _planned(view: WorkerPlanView, config: PlannerConfig = PlannerConfig()):
    ctx = make_ctx(stats=fast_search(), config=config, w0=view)
    (action,) = finish(ctx, session_after_turn(ctx), FinishReason.TOOL_CALLS,
                       ("search",)).actions
    return typed(action)


def test_a_pin_is_planned_against_the_workers_pool_block_budget() -> None:
    """8 positions on a Gemma-like worker take 18 pool blocks. With 80 positions pinned
    by one other Pin (90 pool blocks of the 100), 10 are left: the session is retained at
    top priority (before: 8 positions <= 20 left, pinned, and the worker clipped it)."""
    hybrid = WorkerPlanView("w0", BS, BUDGETS, NO_HOST, held=Holdings(pinned_blocks=80),
                            claim_cost=GEMMA, pinned_claims=1)
    tight = _planned(hybrid)
    assert (tight.action_type.value, tight.payload.priority) == ("kv.retain", 100)
    # 70 pool blocks held, 30 left: the 18 fit.
    roomy = _planned(replace(hybrid, held=Holdings(pinned_blocks=60)))
    assert roomy.action_type.value == "kv.pin" and roomy.payload.target.prefix_tokens == 8 * BS
    # Two full-attention groups: 8 positions take 18 pool blocks too; a position held
    # takes 2.
    two = replace(hybrid, claim_cost=TWO_FULL, held=Holdings(pinned_blocks=40))
    assert _planned(two).action_type.value == "kv.pin"  # 82 held, 18 fit
    assert _planned(replace(two, held=Holdings(pinned_blocks=42))).action_type.value == (
        "kv.retain")  # 86 held, 14 left
    # The same worker without a cost (a one-group model, a 1.2 plugin): positions.
    assert _planned(replace(hybrid, claim_cost=None)).action_type.value == "kv.pin"


def test_the_tenants_pin_budget_stays_in_positions() -> None:
    """A tenant's budget is the operator's, in positions: 8 positions fit 8 on a hybrid
    worker with room, though they take 18 pool blocks there."""
    hybrid = WorkerPlanView("w0", BS, BUDGETS, NO_HOST, claim_cost=GEMMA)
    config = PlannerConfig(tenant_max_pinned_blocks=8)
    assert _planned(hybrid, config).action_type.value == "kv.pin"
    assert _planned(hybrid, replace(config, tenant_max_pinned_blocks=7)).action_type.value == (
        "kv.retain")


def test_the_ledger_counts_live_claims_per_worker_and_per_tenants_api() -> None:
    """What ``held_pool_blocks`` multiplies the tails by: Pins and Retains (Prefetches
    among them) holding some blocks, per worker and per tenant's API holdings there."""
    ledger = HoldingsLedger()
    ledger.record(action_id="p1", worker_id="w0", tenant="t", scope="t/a",
                  action_type="kv.pin", blocks=8, expires_at=10.0)
    ledger.record(action_id="p2", worker_id="w0", tenant="t", scope="agent:t/b",
                  action_type="kv.pin", blocks=4, expires_at=20.0, api=True)
    ledger.record(action_id="r1", worker_id="w0", tenant="t", scope="t/c",
                  action_type="kv.retain", blocks=4, expires_at=20.0)
    ledger.record(action_id="f1", worker_id="w0", tenant="t", scope="t/d",
                  action_type="kv.prefetch", blocks=2, expires_at=20.0)
    assert ledger.claims("w0") == (2, 2) and ledger.claims("w0", "t") == (1, 0)
    # A new Pin of the same session supersedes the old: still one claim.
    ledger.record(action_id="p3", worker_id="w0", tenant="t", scope="t/a",
                  action_type="kv.pin", blocks=9, expires_at=10.0)
    assert ledger.claims("w0") == (2, 2)
    # Answered holding nothing: no claim; past its TTL: none either.
    ledger.settle(HintOutcome(message_id="m", action_id="r1", action_type="kv.retain",
                              worker_id="w0", status=OutcomeStatus.REJECTED, at=1.0,
                              requested=Amount(blocks=4)))
    assert ledger.claims("w0") == (2, 1)
    ledger.expire(15.0)
    assert ledger.claims("w0") == (1, 1) and ledger.claims("w1") == (0, 0)
    ledger.expire(30.0)
    assert ledger.claims("w0") == (0, 0) and ledger.claims("w0", "t") == (0, 0)
