"""What a Responses follow-up's plan books beyond its body (routing_service.py
``HeldConversation``): the conversation its worker prepends, less what that worker
likely holds, and on that worker only; never a prediction."""

from __future__ import annotations

import json
from typing import Any

from kvhint.router.policy import RoutingConfig, SessionPlanState
from kvhint.router.service.inbound import Endpoint, parse_inbound
from kvhint.router.service.metrics import RouterMetrics
from kvhint.router.service.routing_service import (
    HeldConversation,
    RoutingService,
    conversation_of_session,
)
from kvhint.router.service.tenancy import Tenant, TenantBudget
from kvhint.router.service.workers import WorkerRegistry

TENANT = Tenant("acme", None, TenantBudget())


def _routing(*workers: str) -> RoutingService:
    registry = WorkerRegistry([(w, f"http://127.0.0.1:{9000 + i}")
                               for i, w in enumerate(workers)])
    return RoutingService(registry, RouterMetrics(), RoutingConfig(), hasher=None,
                          default_block_size=16)


def _follow_up(**extra: Any):  # noqa: ANN202
    body = {"model": "m", "input": "x" * 40, "previous_response_id": "resp_1"} | extra
    return parse_inbound(Endpoint.RESPONSES, json.dumps(body).encode(), TENANT, None, None)


async def test_the_conversation_is_booked_less_its_held_blocks_on_its_worker_only() -> None:
    routing = _routing("w0", "w1")
    conversation = HeldConversation("w0", tokens=1000, held=900)
    plan = await routing.plan(_follow_up(), None, 0, exclude=frozenset({"w1"}),
                              conversation=conversation)
    assert plan.prompt_tokens == 1000 + 10  # the new input: 40 characters
    assert plan.held_tokens == 896  # whole blocks of 16
    assert plan.uncached_on("w0") == 1010 - 896
    assert plan.uncached_on("w1") == 1010  # held where the conversation is, not here
    # Not a prediction: nothing predicted cached, nothing in the decision's scores.
    assert plan.predicted_for("w0") == 0 and not plan.exact
    assert plan.decision.predicted_cached_tokens == 0


async def test_a_follow_up_never_books_less_than_its_body_alone() -> None:
    """New tools in the follow-up's body, more than the conversation: the body's
    estimate stands (the held part is then the conversation's only)."""
    routing = _routing("w0")
    tools = [{"type": "function", "name": "t", "description": "d" * 8000}]
    plain = await routing.plan(_follow_up(tools=tools), None, 0)
    plan = await routing.plan(_follow_up(tools=tools), None, 0,
                              conversation=HeldConversation("w0", tokens=100, held=64))
    assert plan.prompt_tokens == plain.prompt_tokens > 2000
    assert plan.uncached_on("w0") == plain.prompt_tokens - 64


async def test_without_a_conversation_the_body_alone_is_booked() -> None:
    routing = _routing("w0")
    plan = await routing.plan(_follow_up(), None, 0)
    assert (plan.prompt_tokens, plan.held_tokens, plan.held_by) == (10, 0, None)
    assert plan.uncached_on("w0") == 10


def test_a_session_answered_on_the_worker_gives_its_last_prompt_for_both_parts() -> None:
    """The session's last turn answered with usage on the follow-up's worker (a gap
    open): its prompt, as the worker counted it, is the conversation and its held part
    (never its context_tokens: those count the reasoning too). Another worker's session,
    a turn routed since (no gap: in flight, failed, or answered without usage, when
    prompt_tokens is the router's estimate) or a fresh record: nothing."""
    answered = SessionPlanState("acme/s", "acme", worker_id="w0", turns=1,
                                context_tokens=3300, prompt_tokens=3000,
                                gap_opened_at=5.0)
    assert conversation_of_session(answered, "w0") == HeldConversation("w0", 3000, 3000)
    assert conversation_of_session(answered, "w1") is None
    routed = SessionPlanState("acme/s", "acme", worker_id="w0", turns=2,
                              context_tokens=3300, prompt_tokens=12)
    assert conversation_of_session(routed, "w0") is None
    assert conversation_of_session(SessionPlanState("acme/s", "acme"), "w0") is None
