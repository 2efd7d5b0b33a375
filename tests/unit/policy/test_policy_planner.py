"""The hint planner: lifecycle events -> bounded hints, observations, new session state.
(Shared prefixes: test_policy_shared_prefixes.py; outcomes: test_policy_outcomes.py.)"""

from __future__ import annotations

import dataclasses
from dataclasses import replace

import pytest
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
    USER_GAP,
    CompletionReadObserved,
    FinishReason,
    GapObserved,
    Holdings,
    LearnedStats,
    PlannerConfig,
    ReturnObserved,
    SessionEnded,
    SessionPlanState,
    TurnRouted,
    WorkerFeedback,
    WorkerPlanView,
    next_idle_review,
    plan_idle,
    plan_session_end,
    plan_turn_routed,
    user_gap_kind,
)
from kvhint.router.policy.feedback import apply_outcome
from kvhint.schemas import Amount, HintOutcome, OutcomeStatus


def test_short_tool_gap_is_pinned_for_its_predicted_length_within_budget() -> None:
    ctx = make_ctx(stats=fast_search())
    result = finish(ctx, session_after_turn(ctx), FinishReason.TOOL_CALLS, ("search",))
    (planned,) = result.actions
    action = typed(planned)
    assert action.action_type.value == "kv.pin"
    assert action.payload.target.session_id == "t/s"
    # p90 of gaps all ~4 s is the 4-5.7 s bucket edge, x1.5 margin.
    assert 4.0 <= action.payload.ttl_s <= 9.0
    assert planned.blocks == (8 * BS + 100) // BS
    assert result.session.gap_kind == "search" and result.session.awaiting_return
    assert result.session.protection.action_type == "kv.pin"


def test_a_pin_covers_the_whole_chain_or_the_session_is_retained_at_top_priority() -> None:
    """A chain that does not fit the pin room left is not pinned in part (the rest would
    be left to LRU): it is retained whole at top priority. A clipped pin's feedback
    scales the room the planner counts."""
    def planned(view: WorkerPlanView):
        ctx = make_ctx(stats=fast_search(), w0=view)
        (action,) = finish(ctx, session_after_turn(ctx), FinishReason.TOOL_CALLS,
                            ("search",)).actions
        return typed(action)

    roomy = WorkerPlanView("w0", BS, BUDGETS, NO_HOST, held=Holdings(pinned_blocks=92))
    pin = planned(roomy)  # 8 blocks, 8 left
    assert pin.action_type.value == "kv.pin" and pin.payload.target.prefix_tokens == 8 * BS
    tight = planned(replace(roomy, held=Holdings(pinned_blocks=97)))  # 3 of 8 fit
    assert (tight.action_type.value, tight.payload.priority) == ("kv.retain", 100)
    assert tight.payload.target.prefix_tokens == 8 * BS
    # A clipped pin halves the room the planner counts on that worker: 8 of 10 left no
    # longer fit, 8 of 16 do.
    outcome = HintOutcome(message_id="m", action_id="a", action_type="kv.pin", worker_id="w0",
                          status=OutcomeStatus.CLIPPED, at=0.0,
                          requested=Amount(blocks=8), applied=Amount(blocks=4))
    feedback = apply_outcome(WorkerFeedback("w0"), outcome)
    assert feedback.pin_ask_scale == 0.5
    halved = replace(roomy, held=Holdings(pinned_blocks=90), feedback=feedback)
    assert planned(halved).action_type.value == "kv.retain"
    pin = planned(replace(halved, held=Holdings(pinned_blocks=84)))
    assert pin.action_type.value == "kv.pin" and pin.payload.target.prefix_tokens == 8 * BS


def test_a_tool_gap_twice_overdue_is_no_longer_pinned() -> None:
    """A tool that never answers: up to twice its predicted gap the session is still
    pinned for a late return; after that it is valued like any idle session (before, it
    was re-pinned at every review until abandoned an hour later, using the pin budget
    live sessions need)."""
    stats = fast_search()
    ctx = make_ctx(stats=stats)
    session = finish(ctx, session_after_turn(ctx), FinishReason.TOOL_CALLS, ("search",),
                     at=0.0).session
    predicted = session.gap_predicted_s
    assert 0.0 < predicted < 10.0

    def idle_at(now: float) -> list:
        return [typed(p) for p in plan_idle(make_ctx(now=now, stats=stats),
                                            replace(session, protection=None)).actions]

    (late,) = idle_at(1.5 * predicted)
    assert late.action_type.value == "kv.pin"
    for now in (2.5 * predicted, 600.0, 3000.0):
        assert all(a.action_type.value != "kv.pin" for a in idle_at(now)), now


def test_stop_is_retained_with_priority_rising_with_depth() -> None:
    ctx = make_ctx()
    shallow = finish(ctx, session_after_turn(ctx), FinishReason.STOP)
    deep_state = replace(session_after_turn(ctx), turns=6)
    deep = finish(ctx, deep_state, FinishReason.STOP)
    p_shallow = typed(shallow.actions[0]).payload.priority
    p_deep = typed(deep.actions[0]).payload.priority
    assert typed(shallow.actions[0]).action_type.value == "kv.retain"
    assert 0 < p_shallow < p_deep <= 100


def test_next_turn_closes_the_gap_and_observes_it() -> None:
    ctx = make_ctx()
    session = finish(ctx, session_after_turn(ctx), FinishReason.TOOL_CALLS, ("build",)).session
    later = make_ctx(now=31.0)
    result = plan_turn_routed(later, session, TurnRouted("t/s", "t", "w0", 9 * BS, 31.0))
    assert result.observations == (GapObserved("build", 1, 30.0),
                                   ReturnObserved(1, True, "build"))
    assert result.session.turns == 2 and not result.session.awaiting_return
    # Folding the observations in is the caller's job; the planner never mutates stats.
    assert ctx.stats.gaps == {}


def test_idle_session_decays_is_counted_as_gone_once_and_is_released() -> None:
    config = PlannerConfig(return_window_s=600.0, abandon_after_s=900.0)
    ctx = make_ctx(config=config)
    session = finish(ctx, session_after_turn(ctx), FinishReason.STOP, at=0.0).session
    first = _typed_priority(session)
    # Walk the review schedule; priorities never rise while the session stays away.
    observations = []
    priorities = [first]
    now = next_idle_review(config, session, 0.0)
    while session.awaiting_return:
        result = plan_idle(make_ctx(now=now, config=config), session)
        observations += result.observations
        for planned in result.actions:
            priorities.append(typed(planned).payload.priority)
        session = result.session
        now = next_idle_review(config, session, now) or now
    assert priorities == sorted(priorities, reverse=True) and priorities[-1] == 0
    assert observations == [ReturnObserved(1, False, "@user")]
    assert session.ended and session.protection is None


def test_a_planner_config_without_a_first_idle_review_is_refused() -> None:
    """next_idle_review grows the first review's idle time until it passes now: from 0 or
    less it never did (the caller hung for good). Such a config is refused."""
    for first in (0.0, -15.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="idle_review_first_s"):
            PlannerConfig(idle_review_first_s=first)
    config = PlannerConfig(idle_review_first_s=0.5)
    ctx = make_ctx(config=config)
    session = finish(ctx, session_after_turn(ctx), FinishReason.STOP, at=0.0).session
    assert next_idle_review(config, session, 100.0) > 100.0


def test_a_session_an_agent_demoted_is_left_demoted_until_its_next_turn() -> None:
    """An agent runtime demoted the session through the API: the planner's idle reviews
    would re-protect it (its retains are re-sent as their priority moves); they send
    nothing, still count the session gone once, and still end it when abandoned. Its
    next turn and response plan as usual."""
    config = PlannerConfig(return_window_s=600.0, abandon_after_s=900.0)
    ctx = make_ctx(config=config)
    session = finish(ctx, session_after_turn(ctx), FinishReason.STOP, at=0.0).session
    session = dataclasses.replace(session, protection=None, demoted=True, agent_demoted=True)
    observations, actions = [], []
    now = next_idle_review(config, session, 0.0)
    while session.awaiting_return:
        result = plan_idle(make_ctx(now=now, config=config), session)
        observations += result.observations
        actions += [(now, typed(p)) for p in result.actions]
        session = result.session
        now = next_idle_review(config, session, now) or now
    assert observations == [ReturnObserved(1, False, "@user")]
    # Only the abandonment at 900 s sends anything: the release of an ended session.
    assert [(at, type(a.payload).__name__, a.payload.priority) for at, a in actions] == [
        (900.0, "RetainPayload", 0)]
    assert session.ended
    # A new turn clears it: its response is protected again.
    again = dataclasses.replace(session_after_turn(ctx), agent_demoted=True)
    routed = plan_turn_routed(ctx, again, TurnRouted("t/s", "t", "w0", 9 * BS, 10.0))
    assert not routed.session.agent_demoted


def _sent_priorities(config: PlannerConfig) -> list[int]:
    """The retain priorities sent for a session that never comes back: at its response,
    then at each idle review, down to the release (0)."""
    ctx = make_ctx(config=config)
    session = finish(ctx, session_after_turn(ctx), FinishReason.STOP, at=0.0).session
    sent = [_typed_priority(session)]
    now = next_idle_review(config, session, 0.0)
    while session.awaiting_return:
        result = plan_idle(make_ctx(now=now, config=config), session)
        sent += [typed(p).payload.priority for p in result.actions]
        session = result.session
        now = next_idle_review(config, session, now) or now
    return sent


def test_an_idle_retain_is_re_sent_whenever_its_priority_moves() -> None:
    # The worker orders retained blocks by priority: a stale priority keeps an idle
    # session above fresher ones, so by default every move is re-sent (step 1).
    config = PlannerConfig(return_window_s=600.0, abandon_after_s=900.0)
    fine = _sent_priorities(config)  # e.g. 19, 16, 15, 13, 10, 6, then releases (0)
    assert fine[-1] == 0
    retains = [p for p in fine if p > 0]
    assert all(0 < a - b < 10 for a, b in zip(retains, retains[1:])) and len(retains) > 2
    coarse = _sent_priorities(replace(config, refresh_priority_step=10))  # 19, 6, 0, 0
    retains = [p for p in coarse if p > 0]
    assert all(a - b >= 10 for a, b in zip(retains, retains[1:]))
    assert len(coarse) < len(fine)


def test_only_the_first_retain_of_a_gap_sends_the_rest_first() -> None:
    """The rest of the session is sent to the head of the eviction order once per gap:
    a retain re-sent at an idle review (its priority moved) leaves it out, so the worker
    does not walk the session's blocks again; one that follows a pin carries it."""
    config = PlannerConfig(return_window_s=600.0, abandon_after_s=900.0)
    view = WorkerPlanView("w0", BS, BUDGETS, NO_HOST, evict_rest_first=True)
    ctx = make_ctx(config=config, w0=view)
    session = finish(ctx, session_after_turn(ctx), FinishReason.STOP, at=0.0).session
    first = session.protection
    assert first is not None and first.action_type == "kv.retain"
    flags = []
    now = next_idle_review(config, session, 0.0)
    while session.awaiting_return and now is not None:
        result = plan_idle(make_ctx(now=now, config=config, w0=view), session)
        flags += [typed(p).payload.evict_rest_first for p in result.actions
                  if typed(p).action_type.value == "kv.retain" and typed(p).payload.priority]
        session = result.session
        now = next_idle_review(config, session, now)
    assert len(flags) > 2 and not any(flags)
    # After a pin (a fast tool gap), a review that finds no pin room left retains: the
    # first retain of the gap.
    stats = fast_search()
    pinned = finish(make_ctx(stats=stats, w0=view), session_after_turn(ctx), FinishReason.TOOL_CALLS,
                     ("search",), at=0.0).session
    assert pinned.protection is not None and pinned.protection.action_type == "kv.pin"
    full = replace(view, held=Holdings(pinned_blocks=100 + pinned.protection.blocks))
    later = plan_idle(make_ctx(now=20.0, stats=stats, w0=full), pinned)
    (retain,) = [typed(p) for p in later.actions]
    assert retain.action_type.value == "kv.retain" and retain.payload.evict_rest_first


def _typed_priority(session: SessionPlanState) -> int:
    assert session.protection is not None
    return session.protection.priority


def test_end_demotes_with_a_host_tier_and_releases_without() -> None:
    host = WorkerPlanView("w0", BS, BUDGETS, frozenset({"kv.retain", "kv.pin", "kv.demote"}),
                          host_tier=True)
    ctx = make_ctx(w0=host)
    session = finish(ctx, replace(session_after_turn(ctx), turns=6), FinishReason.STOP).session
    result = plan_session_end(ctx, session, SessionEnded("t/s", 5.0))
    assert [typed(a).action_type.value for a in result.actions] == ["kv.demote"]
    assert result.observations == (ReturnObserved(6, False, "@user"),)
    assert result.session.ended
    plain = make_ctx()
    session = finish(plain, session_after_turn(plain), FinishReason.STOP).session
    result = plan_session_end(plain, session, SessionEnded("t/s", 5.0))
    (release,) = [typed(a) for a in result.actions]
    assert (release.action_type.value, release.payload.priority) == ("kv.retain", 0)


def test_moved_session_gets_prefetch_on_a_host_tier_worker_and_old_protection_released() -> None:
    views = {"w0": WorkerPlanView("w0", BS, BUDGETS, NO_HOST),
             "w1": WorkerPlanView("w1", BS, BUDGETS, NO_HOST | {"kv.demote"}, host_tier=True)}
    ctx = make_ctx(**views)
    session = finish(ctx, session_after_turn(ctx), FinishReason.STOP).session
    result = plan_turn_routed(ctx, session, TurnRouted("t/s", "t", "w1", 9 * BS, 10.0))
    kinds = [(a.worker_id, typed(a).action_type.value) for a in result.actions]
    assert kinds == [("w1", "kv.prefetch"), ("w0", "kv.retain")]
    assert typed(result.actions[1]).payload.priority == 0
    assert result.session.worker_id == "w1" and result.session.protection is None


def test_same_seed_same_plan_and_inputs_untouched() -> None:
    def plan(seed: int):
        ctx = make_ctx(seed=seed)
        session = session_after_turn(ctx)
        return session, finish(ctx, session, FinishReason.STOP)

    session_a, a = plan(3)
    session_b, b = plan(3)
    assert a == b and session_a == session_b
    assert session_a.gap_opened_at is None  # the input state was not mutated
    assert plan(4)[1].actions[0].action.action_id != a.actions[0].action.action_id


def test_session_state_round_trips_through_plain_data() -> None:
    ctx = make_ctx()
    state = finish(ctx, session_after_turn(ctx), FinishReason.TOOL_CALLS, ("x",)).session
    assert SessionPlanState.from_dict(state.to_dict()) == state
    # A field a newer router stored is left out (a rollback keeps the rest of the plan).
    assert SessionPlanState.from_dict({**state.to_dict(), "added_later": 1}) == state


def test_a_gap_past_ten_minutes_counts_as_not_returning_by_default() -> None:
    """The default return window is 600 s: a later turn is observed as a non-return (the
    next turn still closes the gap), one within it as a return with its gap."""
    ctx = make_ctx()
    session = finish(ctx, session_after_turn(ctx), FinishReason.STOP, at=0.0).session
    late = plan_turn_routed(make_ctx(now=700.0), session, TurnRouted("t/s", "t", "w0", 9 * BS, 700.0))
    assert late.observations == (ReturnObserved(1, False, "@user"),)
    soon = plan_turn_routed(make_ctx(now=500.0), session, TurnRouted("t/s", "t", "w0", 9 * BS, 500.0))
    assert soon.observations == (GapObserved("@user", 1, 500.0), ReturnObserved(1, True, "@user"))


def test_only_fast_tool_gaps_are_pinned_by_default() -> None:
    """Pins are hard, so by default only gaps predicted within 15 s get one; a tool that
    takes ~30 s is retained (soft, relieved under pressure) at a high priority."""
    stats = fast_search()
    for _ in range(20):
        stats.apply(GapObserved("build", 1, 30.0))
    ctx = make_ctx(stats=stats)
    fast = finish(ctx, session_after_turn(ctx), FinishReason.TOOL_CALLS, ("search",))
    slow = finish(ctx, session_after_turn(ctx), FinishReason.TOOL_CALLS, ("build",))
    assert typed(fast.actions[0]).action_type.value == "kv.pin"
    (retain,) = [typed(a) for a in slow.actions]
    assert retain.action_type.value == "kv.retain" and retain.payload.priority >= 50


def test_user_gaps_are_learnt_per_session_tempo_and_never_pinned() -> None:
    ctx = make_ctx()
    first = finish(ctx, session_after_turn(ctx), FinishReason.STOP).session
    assert first.gap_kind == USER_GAP and first.last_user_gap_s is None
    # The next turn 20 s later: the session's tempo is "fast" from now on.
    result = plan_turn_routed(make_ctx(now=21.0), first, TurnRouted("t/s", "t", "w0", 9 * BS, 21.0))
    assert result.observations == (GapObserved(USER_GAP, 1, 20.0),
                                   ReturnObserved(1, True, USER_GAP))
    assert result.session.last_user_gap_s == 20.0
    second = finish(make_ctx(now=22.0), result.session, FinishReason.STOP, at=22.0)
    assert second.session.gap_kind == user_gap_kind(20.0) == f"{USER_GAP}:fast"
    # A user gap is retained, never pinned, whatever its tempo.
    assert {typed(a).action_type.value for a in second.actions} == {"kv.retain"}
    # Tool gaps leave the tempo alone; tempo off keeps the pooled kind.
    assert user_gap_kind(100.0) == f"{USER_GAP}:mid" and user_gap_kind(900.0) == f"{USER_GAP}:slow"
    off = make_ctx(now=22.0, config=PlannerConfig(session_tempo=False))
    assert finish(off, result.session, FinishReason.STOP, at=22.0).session.gap_kind == USER_GAP


def test_a_turn_that_adds_a_long_user_message_opens_a_user_gap_learnt_apart() -> None:
    """A pasted document makes a return less likely (Mooncake, depth 2: 0.20 after 3,000+
    new tokens vs 0.48), so a turn that added long_message_tokens (2,048) or more opens a
    user gap of its own kind; the first turn never does."""
    ctx = make_ctx()
    first = finish(ctx, session_after_turn(ctx), FinishReason.STOP, prompt=4000,
                    completion=500)
    assert first.session.added_tokens == 0 and first.session.gap_kind == USER_GAP
    context = 4000 + 500

    def next_turn(added: int, config: PlannerConfig = PlannerConfig()) -> SessionPlanState:
        routed = plan_turn_routed(make_ctx(now=21.0), first.session,
                                  TurnRouted("t/s", "t", "w0", context + added, 21.0))
        assert routed.session.added_tokens == added
        return finish(make_ctx(now=22.0, config=config), routed.session, FinishReason.STOP,
                       at=22.0, prompt=context + added).session

    assert next_turn(2048).gap_kind == user_gap_kind(20.0, True) == f"{USER_GAP}:fast:long"
    assert next_turn(2047).gap_kind == f"{USER_GAP}:fast"
    assert next_turn(5000, PlannerConfig(long_message_tokens=0)).gap_kind == f"{USER_GAP}:fast"
    assert user_gap_kind(None, True) == f"{USER_GAP}:long"
    # Its returns are counted apart and in the pooled user figure.
    stats = LearnedStats(decay=1.0)
    for _ in range(30):
        stats.apply(ReturnObserved(2, False, f"{USER_GAP}:fast:long"))
        stats.apply(ReturnObserved(2, True, f"{USER_GAP}:fast"))
    assert stats.return_probability(2, f"{USER_GAP}:fast:long") < 0.5 < stats.return_probability(
        2, f"{USER_GAP}:fast")


def test_a_session_not_due_back_within_the_horizon_is_left_to_lru() -> None:
    """The value horizon is 100 s by default: a tool that always takes ~4 minutes leaves
    its session worth too little to retain now (plain LRU keeps it if it can), while one
    that takes ~30 s is retained; with the old 300 s horizon both were retained."""
    stats = LearnedStats()
    for _ in range(20):
        stats.apply(GapObserved("crawl", 1, 240.0))
        stats.apply(GapObserved("build", 1, 30.0))

    def sent(config: PlannerConfig, tool: str) -> list[int]:
        ctx = make_ctx(stats=stats, config=config)
        result = finish(ctx, session_after_turn(ctx), FinishReason.TOOL_CALLS, (tool,))
        return [typed(a).payload.priority for a in result.actions]

    (build,) = sent(PlannerConfig(), "build")
    assert build >= 50
    assert sent(PlannerConfig(), "crawl") == []  # nothing held: nothing to release either
    (crawl,) = sent(PlannerConfig(horizon_s=300.0), "crawl")
    assert crawl >= PlannerConfig().min_retain_priority


def test_a_next_turn_on_the_same_worker_shows_whether_it_read_the_response() -> None:
    """The previous turn: an 8-block prompt and a 600-token response, so its chain has a
    9th full block holding response tokens. The next turn's cached count on the same
    worker says whether that block was read."""
    ctx = make_ctx()
    session = finish(ctx, session_after_turn(ctx), FinishReason.STOP, completion=600).session

    def observed(cached: int | None, worker: str = "w0", prompt: int = 10 * BS) -> list:
        event = TurnRouted("t/s", "t", worker, prompt, 30.0, cached)
        result = plan_turn_routed(make_ctx(now=30.0), session, event)
        return [o for o in result.observations if isinstance(o, CompletionReadObserved)]

    assert observed(9 * BS) == [CompletionReadObserved(True)]
    assert observed(8 * BS) == [CompletionReadObserved(False)]
    # Silent where the turn does not tell: the prompt itself partly evicted (the response
    # block may have gone the same way), no count, another worker, a prompt too short.
    assert observed(7 * BS) == []
    assert observed(None) == []
    two = make_ctx(w0=WorkerPlanView("w0", BS, BUDGETS, NO_HOST),
               w1=WorkerPlanView("w1", BS, BUDGETS, NO_HOST))
    moved = plan_turn_routed(two, session, TurnRouted("t/s", "t", "w1", 10 * BS, 30.0, 0))
    assert not any(isinstance(o, CompletionReadObserved) for o in moved.observations)
    assert observed(8 * BS, prompt=9 * BS) == []
    # A response that filled no block of its own tells nothing either.
    short = finish(ctx, session_after_turn(ctx), FinishReason.STOP, completion=100).session
    result = plan_turn_routed(make_ctx(now=30.0), short, TurnRouted("t/s", "t", "w0", 10 * BS,
                                                                30.0, 8 * BS))
    assert not any(isinstance(o, CompletionReadObserved) for o in result.observations)


def test_protection_covers_the_response_only_while_next_turns_read_it() -> None:
    def retained_tokens(stats: LearnedStats) -> int:
        ctx = make_ctx(stats=stats)
        result = finish(ctx, session_after_turn(ctx), FinishReason.STOP, completion=600)
        (action,) = result.actions
        assert result.session.protection is not None
        assert result.session.protection.blocks * BS == typed(action).payload.target.prefix_tokens
        return typed(action).payload.target.prefix_tokens

    assert retained_tokens(LearnedStats()) == 9 * BS  # the prior: responses are read
    not_read = LearnedStats()
    for _ in range(20):
        not_read.apply(CompletionReadObserved(False))
    assert retained_tokens(not_read) == 8 * BS  # the prompt's blocks only


def test_the_rest_of_a_session_goes_first_where_the_worker_takes_it() -> None:
    """On a worker that runs Pin/Retain 1.1 a protection (which covers all the next turn
    reads) also sends the rest of the session first, a top-priority retain in place of a
    pin that does not fit too; a 1.0 worker gets 1.0 actions."""
    new = WorkerPlanView("w0", BS, BUDGETS, NO_HOST, evict_rest_first=True)
    old = WorkerPlanView("w0", BS, BUDGETS, NO_HOST)

    def sent(view: WorkerPlanView, reason: FinishReason, tools: tuple[str, ...] = ()):
        ctx = make_ctx(stats=fast_search(), w0=view)
        (planned,) = finish(ctx, session_after_turn(ctx), reason, tools).actions
        return planned.action.action_version, typed(planned).payload

    assert sent(new, FinishReason.STOP)[0] == "1.1"
    assert sent(new, FinishReason.STOP)[1].evict_rest_first
    version, pin = sent(new, FinishReason.TOOL_CALLS, ("search",))
    assert version == "1.1" and pin.evict_rest_first
    full = replace(new, held=Holdings(pinned_blocks=97))  # 3 of 8 blocks pinnable
    version, retain = sent(full, FinishReason.TOOL_CALLS, ("search",))
    assert (retain.priority, retain.target.prefix_tokens) == (100, 8 * BS)
    assert retain.evict_rest_first and version == "1.1"
    for reason, tools in ((FinishReason.STOP, ()), (FinishReason.TOOL_CALLS, ("search",))):
        version, payload = sent(old, reason, tools)
        assert version == "1.0" and not payload.evict_rest_first
