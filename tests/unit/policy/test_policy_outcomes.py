"""What the workers' answers do to the planner: feedback per worker (rejected types
stop, clipped pins shrink the room) and the protection a session remembers."""

from __future__ import annotations

from dataclasses import replace

from planner_fixtures import (
    BS,
    BUDGETS,
    NO_HOST,
    fast_search,
    finish,
    make_ctx,
    session_after_turn,
    typed,
)

from kvhint.router.policy import (
    FinishReason,
    Holdings,
    PlannerConfig,
    SessionEnded,
    SessionPlanState,
    WorkerFeedback,
    WorkerPlanView,
    next_idle_review,
    plan_idle,
    plan_session_end,
)
from kvhint.router.policy.feedback import apply_outcome
from kvhint.schemas import Amount, HintOutcome, OutcomeStatus


def test_a_rejected_action_type_stops_being_sent_to_that_worker() -> None:
    rejected = HintOutcome(message_id="m", action_id="a", action_type="kv.demote",
                           worker_id="w0", status=OutcomeStatus.REJECTED,
                           reason="no host tier", at=0.0)
    feedback = apply_outcome(apply_outcome(WorkerFeedback("w0"), rejected), rejected)
    assert not feedback.allows("kv.demote")
    host = WorkerPlanView("w0", BS, BUDGETS, frozenset({"kv.retain", "kv.demote"}),
                          host_tier=True, feedback=feedback)
    ctx = make_ctx(w0=host)
    session = finish(ctx, session_after_turn(ctx), FinishReason.STOP).session
    result = plan_session_end(ctx, session, SessionEnded("t/s", 5.0))
    assert [typed(a).action_type.value for a in result.actions] == ["kv.retain"]


def test_pin_clipped_to_no_room_falls_back_to_a_top_priority_retain() -> None:
    view = WorkerPlanView("w0", BS, BUDGETS, NO_HOST, held=Holdings(pinned_blocks=100))
    ctx = make_ctx(stats=fast_search(), w0=view)
    result = finish(ctx, session_after_turn(ctx), FinishReason.TOOL_CALLS, ("search",))
    action = typed(result.actions[0])
    assert (action.action_type.value, action.payload.priority) == ("kv.retain", 100)
    assert action.payload.target.prefix_tokens == 8 * BS


def _answer(session: SessionPlanState, status: OutcomeStatus, applied: int,
            action_id: str | None = None) -> HintOutcome:
    assert session.protection is not None
    requested = session.protection.blocks
    return HintOutcome(message_id="m", action_id=action_id or session.protection.action_id,
                       action_type=session.protection.action_type, worker_id="w0",
                       status=status, reason="", requested=Amount(requested, requested * BS),
                       applied=Amount(applied, applied * BS), at=1.0)


def test_the_protection_remembered_is_what_the_worker_applied() -> None:
    ctx = make_ctx()
    session = finish(ctx, session_after_turn(ctx), FinishReason.STOP).session
    assert session.protection is not None and session.protection.blocks == 8
    part = session.settled(_answer(session, OutcomeStatus.CLIPPED, 3))
    assert part.protection == replace(session.protection, blocks=3)
    assert session.settled(_answer(session, OutcomeStatus.ACCEPTED, 8)) is session
    for nothing in (_answer(session, OutcomeStatus.CLIPPED, 0),
                    _answer(session, OutcomeStatus.MISSING, 0),
                    _answer(session, OutcomeStatus.REJECTED, 0)):
        assert session.settled(nothing).protection is None
    # Not this protection's answer (an older action), or not a final one: unchanged.
    assert session.settled(_answer(session, OutcomeStatus.CLIPPED, 0, "older")) is session
    assert session.settled(_answer(session, OutcomeStatus.DEFERRED, 0)) is session


def test_a_retain_the_worker_clipped_to_nothing_is_asked_for_again_at_the_next_review() -> None:
    # A coarse refresh step: the priority's own drift never re-sends here, so only the
    # worker's answer can.
    config = PlannerConfig(refresh_priority_step=1000)
    ctx = make_ctx(config=config)
    session = finish(ctx, session_after_turn(ctx), FinishReason.STOP, at=0.0).session
    review = next_idle_review(config, session, 0.0)
    assert review is not None
    later = make_ctx(now=review, config=config)
    assert plan_idle(later, session).actions == ()  # believed held: nothing to send
    clipped = session.settled(_answer(session, OutcomeStatus.CLIPPED, 0))
    (again,) = [typed(p) for p in plan_idle(later, clipped).actions]
    assert again.action_type.value == "kv.retain" and again.payload.priority > 0
    assert again.payload.target.prefix_tokens == 8 * BS
