"""Shared helpers of the planner's unit tests (test_policy_*.py): one worker ``w0``
without a host tier, a session ``t/s`` of 8 blocks of 512 tokens."""

from __future__ import annotations

import random

from kvhint.router.policy import (
    FinishReason,
    GapObserved,
    LearnedStats,
    PlannerConfig,
    PlannerContext,
    PlannedAction,
    PlanResult,
    ResponseFinished,
    SessionPlanState,
    TurnRouted,
    WorkerPlanView,
    plan_response_finished,
    plan_turn_routed,
)
from kvhint.schemas import Budgets, parse_action
from kvhint.schemas.hints import ParsedAction

BS = 512
BUDGETS = Budgets(max_pinned_blocks=100, max_pin_ttl_s=300.0, max_retained_blocks=1000,
                  max_retain_ttl_s=3600.0)
NO_HOST = frozenset({"kv.retain", "kv.pin", "kv.prefetch"})


def make_ctx(now: float = 0.0, stats: LearnedStats | None = None, seed: int = 1,
             config: PlannerConfig = PlannerConfig(), **workers: WorkerPlanView
             ) -> PlannerContext:
    """The planner's context; ``workers`` by id (default: ``w0``, no host tier)."""
    views = workers or {"w0": WorkerPlanView("w0", BS, BUDGETS, NO_HOST)}
    return PlannerContext(now=now, stats=stats or LearnedStats(), workers=views,
                          rng=random.Random(seed), config=config)


def typed(planned: PlannedAction) -> ParsedAction:
    parsed = parse_action(planned.action)
    assert isinstance(parsed, ParsedAction), parsed
    return parsed


def session_after_turn(ctx: PlannerContext, prompt: int = 8 * BS, worker: str = "w0",
                       at: float = 0.0) -> SessionPlanState:
    result = plan_turn_routed(ctx, None, TurnRouted("t/s", "t", worker, prompt, at))
    assert result.actions == () and result.observations == ()
    return result.session


def finish(ctx: PlannerContext, session: SessionPlanState, reason: FinishReason,
           tools: tuple[str, ...] = (), at: float = 1.0, prompt: int = 8 * BS,
           completion: int = 100) -> PlanResult:
    return plan_response_finished(
        ctx, session, ResponseFinished("t/s", reason, prompt, completion, at, tools))


def fast_search() -> LearnedStats:
    """Statistics that have seen ``search`` come back in 4 s twenty times."""
    stats = LearnedStats()
    for _ in range(20):
        stats.apply(GapObserved("search", 1, 4.0))
    return stats
