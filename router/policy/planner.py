"""The hint planner: session lifecycle -> bounded, soft hints for the session's worker.

Pure functions of a frozen :class:`~kvhint.router.policy.plan_types.PlannerContext`
(time, learned statistics, the workers' budgets/capabilities/holdings/feedback, a seeded
rng for action ids) and the session's
:class:`~kvhint.router.policy.session.SessionPlanState`. They do no I/O and never mutate
their inputs; each returns a :class:`PlanResult` with the session's new state, the actions
to send and the observations to fold into the statistics. The live router and the
simulator call exactly these functions.

The plan, per lifecycle event:

- **turn routed** (:func:`plan_turn_routed`): closes an open gap (observes its length and
  that the session returned); a session that moved worker gets Share (old worker ->
  new) when the old worker supports it, else Prefetch on the new worker when it has a host
  tier; the old worker's protection is released (Demote when it has a host tier).
- **response finished** (:func:`plan_response_finished`): opens a gap. Its value is the
  probability the session comes back within ``horizon_s`` (return probability by depth and
  gap kind, times the gap distribution learned per tool name and depth). A tool gap
  predicted shorter than ``pin_max_gap_s`` is pinned for its predicted length (quantile
  ``gap_quantile`` x ``pin_ttl_margin``) when its whole chain fits the pin budget left
  (scaled by the worker's pin feedback), else retained at top priority; otherwise the
  session is retained with priority = 100 x that probability, or demoted to the host
  tier when the value is low and the worker has one.
- **idle tick** (:func:`plan_idle`): the value decays as the session stays away; the
  retain priority is re-sent when it moved by ``refresh_priority_step``, a low-value session
  is demoted or released, and one idle past ``abandon_after_s`` counts as not returning.
- **explicit end** (:func:`plan_session_end`): Demote when the worker has a host tier,
  else release.
- **shared prefixes** (:func:`~kvhint.router.policy.shared_prefixes.plan_shared_prefixes`):
  prefixes (system prompts, tool schemas) used by many sessions are retained by block hash.

What a protection covers is the part of the session's chain its next turn is expected to
read (:mod:`.coverage`): the last prompt, plus the last response's blocks while next turns
are seen reading them. On workers that take it (Pin/Retain 1.1) the protection also sends
the rest of the session's blocks (a response not read, branches left behind) to the head
of the eviction order: nothing reads them again.

"Release" is a Retain with priority 0 and ``release_ttl_s``: the plugin lets a newer
Pin/Retain/Demote on the same session target supersede the older one, so this ends the
protection. Budgets: per worker (the ``Budgets`` its status advertises, against what the
planner's live actions hold there; in pool blocks, so on a hybrid model a claim costs its
status's ``claim_cost``, :mod:`.claim_cost`) and per tenant (``tenant_max_*``). Outcome feedback
(:mod:`.feedback`) shrinks the pin room and disables rejected action types per worker.
"""

from __future__ import annotations

from dataclasses import replace

from kvhint.router.policy.claim_cost import added_pool_blocks, held_pool_blocks
from kvhint.router.policy.coverage import completion_read, protected_tokens
from kvhint.router.policy.holdings import HoldingChange, Holdings, room_left
from kvhint.router.policy.plan_types import (
    PlannedAction,
    PlannerConfig,
    PlannerContext,
    PlanResult,
    WorkerPlanView,
)
from kvhint.router.policy.priority import retain_priority
from kvhint.router.policy.session import (
    FinishReason,
    Protection,
    ResponseFinished,
    SessionEnded,
    SessionPlanState,
    TurnRouted,
)
from kvhint.router.policy.stats import (
    USER_GAP,
    CompletionReadObserved,
    GapObserved,
    LearnedStats,
    Observation,
    ReturnObserved,
    is_user_kind,
    user_gap_kind,
)
from kvhint.schemas.hints import (
    ActionType,
    DemotePayload,
    HintPayload,
    PinPayload,
    PrefetchPayload,
    RetainPayload,
    SharePayload,
    Target,
)

# -- lifecycle ----------------------------------------------------------------------------


def plan_turn_routed(
    ctx: PlannerContext, session: SessionPlanState | None, event: TurnRouted
) -> PlanResult:
    """A new turn of ``event.session_id`` was routed; ``session`` is None for a new one."""
    if session is None:
        session = SessionPlanState(session_id=event.session_id, tenant=event.tenant)
    observations: list[Observation] = []
    last_user_gap = session.last_user_gap_s
    if session.awaiting_return and session.gap_opened_at is not None:
        kind = session.gap_kind or USER_GAP
        gap = max(event.at - session.gap_opened_at, 0.0)
        if is_user_kind(kind):
            last_user_gap = gap
        if gap <= ctx.config.return_window_s:
            observations.append(GapObserved(kind, session.turns, gap))
            observations.append(ReturnObserved(session.turns, True, kind))
        elif not session.return_counted:
            observations.append(ReturnObserved(session.turns, False, kind))
    read = completion_read(ctx, session, event)
    if read is not None:
        observations.append(CompletionReadObserved(read))
    actions: list[PlannedAction] = []
    moved_from = session.worker_id
    if moved_from is not None and moved_from != event.worker_id:
        actions.extend(_plan_move(ctx, session, moved_from, event.worker_id))
    new_state = replace(
        session,
        worker_id=event.worker_id,
        turns=event.depth if event.depth is not None else session.turns + 1,
        context_tokens=max(session.context_tokens, event.prompt_tokens),
        prompt_tokens=event.prompt_tokens,
        added_tokens=max(event.prompt_tokens - session.context_tokens, 0) if session.turns else 0,
        last_activity=event.at,
        gap_kind=None,
        gap_opened_at=None,
        gap_predicted_s=0.0,
        return_counted=False,
        last_user_gap_s=last_user_gap,
        protection=None if moved_from != event.worker_id else session.protection,
        demoted=False,
        agent_demoted=False,
        ended=False,
        ended_explicitly=False,
    )
    return PlanResult(new_state, tuple(actions), tuple(observations))


def plan_response_finished(
    ctx: PlannerContext, session: SessionPlanState, event: ResponseFinished
) -> PlanResult:
    """The session's response finished: open a gap and protect for what it predicts."""
    kind = _gap_kind(ctx.stats, event, session, ctx.config)
    predicted = ctx.stats.gap_quantile(kind, session.turns, ctx.config.gap_quantile)
    state = replace(
        session,
        context_tokens=event.prompt_tokens + event.completion_tokens,
        prompt_tokens=event.prompt_tokens,
        last_activity=event.at,
        gap_kind=kind,
        gap_opened_at=event.at,
        gap_predicted_s=predicted,
        agent_demoted=False,
    )
    return _protect(ctx, state, idle_s=0.0, reason=f"gap:{kind}", new_blocks=True)


def plan_idle(ctx: PlannerContext, session: SessionPlanState) -> PlanResult:
    """Re-plan an idle session (call it periodically for sessions awaiting a return)."""
    if not session.awaiting_return or session.gap_opened_at is None:
        return PlanResult(session)
    idle = ctx.now - session.gap_opened_at
    observed: tuple[Observation, ...] = ()
    if idle >= ctx.config.return_window_s and not session.return_counted:
        observed = (ReturnObserved(session.turns, False, session.gap_kind or USER_GAP),)
        session = replace(session, return_counted=True)
    if idle >= ctx.config.abandon_after_s:
        result = _end(ctx, session, "abandoned")
        return PlanResult(result.session, result.actions, observed)
    if session.agent_demoted:
        return PlanResult(session, (), observed)
    result = _protect(ctx, session, idle_s=idle, reason="idle")
    return PlanResult(result.session, result.actions, observed)


def next_idle_review(config: PlannerConfig, session: SessionPlanState, now: float) -> float | None:
    """When :func:`plan_idle` should next run for ``session`` (absolute time, > ``now``),
    or None when it awaits no return. Reviews come at idle times ``first``, ``first x
    growth``, ... and last at ``abandon_after_s``, so an hour of idleness costs ~15 calls."""
    if not session.awaiting_return or session.gap_opened_at is None:
        return None
    opened = session.gap_opened_at
    at = config.idle_review_first_s
    while opened + at <= now and at < config.abandon_after_s:
        at *= max(config.idle_review_growth, 1.01)
    at = min(at, config.abandon_after_s)
    if not session.return_counted and now < opened + config.return_window_s < opened + at:
        at = config.return_window_s
    return max(opened + at, now)


def plan_session_end(
    ctx: PlannerContext, session: SessionPlanState, event: SessionEnded
) -> PlanResult:
    """Explicit end: the session will not return; demote (host tier) or release."""
    observations: tuple[Observation, ...] = ()
    if session.awaiting_return and not session.return_counted:
        observations = (ReturnObserved(session.turns, False, session.gap_kind or USER_GAP),)
    result = _end(ctx, replace(session, last_activity=event.at, ended_explicitly=True), "end")
    return PlanResult(result.session, result.actions, observations)


# -- internals ----------------------------------------------------------------------------


def _gap_kind(stats: LearnedStats, event: ResponseFinished, session: SessionPlanState,
              config: PlannerConfig) -> str:
    depth, q = session.turns, config.gap_quantile
    if event.finish_reason is not FinishReason.TOOL_CALLS:
        if not config.session_tempo:
            return USER_GAP
        long_message = 0 < config.long_message_tokens <= session.added_tokens
        return user_gap_kind(session.last_user_gap_s, long_message)
    if not event.tool_names:
        return "@unnamed"
    # Several tools in one response: the session waits for the slowest.
    return max(sorted(set(event.tool_names)), key=lambda t: stats.gap_quantile(t, depth, q))


def _blocks_of(ctx: PlannerContext, session: SessionPlanState, block_size: int) -> int:
    return max(protected_tokens(ctx, session) // max(block_size, 1), 0)


def _chain_target(session: SessionPlanState, worker: WorkerPlanView, blocks: int) -> Target:
    """The session's current chain, ``blocks`` long (:func:`_blocks_of`, see
    :func:`protected_tokens`), not every branch it ever had: earlier turns' completion
    blocks hang off the chain as dead branches that the next turn never reads, and
    retaining them would leak space turn after turn."""
    return Target(session_id=session.session_id,
                  prefix_tokens=max(blocks, 1) * worker.block_size)


def _priority(ctx: PlannerContext, session: SessionPlanState, idle_s: float) -> int:
    density = ctx.stats.hit_density(
        session.gap_kind or USER_GAP, session.turns, idle_s, ctx.config.horizon_s
    )
    return retain_priority(density)


def _protect(
    ctx: PlannerContext, session: SessionPlanState, idle_s: float, reason: str,
    new_blocks: bool = False,
) -> PlanResult:
    """Decide Pin / Retain / Demote / release for a session awaiting its next turn.
    ``new_blocks``: the session's chain grew since its last protection (a response just
    finished), so the protection is always re-sent: the worker resolves a session
    target to the blocks resident at that moment, and the old claim does not cover the
    new ones."""
    config = ctx.config
    worker = ctx.workers.get(session.worker_id or "")
    blocks = _blocks_of(ctx, session, worker.block_size) if worker is not None else 0
    if worker is None or blocks == 0:
        return PlanResult(session)
    kind = session.gap_kind or USER_GAP
    # Twice past its predicted gap (a quantile), a session is overdue: its tool may never
    # answer, so it is no longer pinned (a hard hold it would keep until abandonment, an
    # hour) and is valued by hit density like any idle session. Up to twice the gap, a
    # late return is still likely enough to pin for (gen-agents 2 x 400, seeds 1-5:
    # -0.5% recomputed tokens against pinning until abandonment, -0.9% against stopping
    # at the predicted gap; BENCHMARKS.md).
    overdue = idle_s > 2.0 * session.gap_predicted_s
    remaining = max(session.gap_predicted_s - idle_s, config.min_ttl_s)
    current = session.protection
    own_pinned = _own_held(ctx, current, ActionType.PIN)
    tenant = ctx.tenant_held.get(session.tenant, Holdings())

    if not is_user_kind(kind) and not overdue and remaining <= config.pin_max_gap_s and worker.can_send(
        ActionType.PIN, config
    ):
        if not new_blocks and current is not None and (
            current.action_type == ActionType.PIN.value
        ) and current.expires_at >= ctx.now + remaining:
            return PlanResult(session)
        # A pin covers the whole chain the next turn reads, or the session is retained at
        # top priority instead: a pin cut to the room left would leave the rest of that
        # chain to LRU, which a large retain budget all but empties (gen-agents, retain
        # budget 0.9: 4% more recomputed tokens with cut pins; BENCHMARKS.md). The room is
        # the pin budget left (worker and tenant) times the worker's pin feedback: a
        # clipped pin says the worker had only that share of the room the planner counted
        # (see feedback.py), and pins that fit again are accepted and raise it back.
        # The worker's room is in pool blocks, its budget's unit: on a hybrid model a
        # claim of n positions takes more (status 1.3 claim_cost; before, positions were
        # checked against pool blocks and the worker clipped the pins it was sent). The
        # tenant's budget stays in positions. Both count distinct blocks, as the ledger
        # and the worker do: the pin costs the blocks no other pin there holds
        # (_change; before, a session's first pin was charged its whole chain, a system
        # prompt other sessions' pins hold included).
        scale = worker.feedback.pin_ask_scale if worker.feedback is not None else 1.0
        cost = worker.claim_cost
        on_worker, of_tenant = _change(ctx, session, worker, ActionType.PIN, blocks,
                                       config.tenant_max_pinned_blocks)
        held = held_pool_blocks(worker.held.pinned_blocks - on_worker.freed.pinned_blocks,
                                max(worker.pinned_claims - (own_pinned > 0), 0), cost)
        room = room_left(held, worker.budgets.max_pinned_blocks)
        tenant_room = room_left(tenant.pinned_blocks - of_tenant.freed.pinned_blocks,
                                config.tenant_max_pinned_blocks)
        added = on_worker.added.pinned_blocks
        if added_pool_blocks(added, (blocks,), cost) <= room * scale and (
                of_tenant.added.pinned_blocks <= tenant_room * scale):
            ttl = min(remaining * config.pin_ttl_margin, worker.budgets.max_pin_ttl_s)
            payload = PinPayload(target=_chain_target(session, worker, blocks), ttl_s=ttl,
                                 evict_rest_first=worker.evict_rest_first)
            return _send(ctx, session, worker, payload, blocks, 100, ttl, f"{reason}:pin")
        top_priority = True
    else:
        top_priority = False

    priority = 100 if top_priority else _priority(ctx, session, idle_s)
    wants_host = worker.host_tier and priority < config.demote_below_priority
    if wants_host and worker.can_send(ActionType.DEMOTE, config):
        if session.demoted:
            return PlanResult(session)
        payload = DemotePayload(target=Target(session_id=session.session_id))
        result = _send(ctx, session, worker, payload, blocks, 0, 0.0, f"{reason}:demote")
        return PlanResult(replace(result.session, demoted=True), result.actions)

    if priority >= config.min_retain_priority and worker.can_send(ActionType.RETAIN, config):
        if not new_blocks and current is not None and (
            current.action_type == ActionType.RETAIN.value
        ) and abs(current.priority - priority) < config.refresh_priority_step and (
            current.expires_at > ctx.now
        ):
            return PlanResult(session)
        # Retains are soft: the worker enforces its own retain budget by displacing lower
        # priorities, so only the tenant's share is checked here.
        if _tenant_retain_fits(ctx, session, worker, ActionType.RETAIN, blocks):
            # Cover at least until the next idle review, which re-plans the retain.
            review = next_idle_review(config, session, ctx.now)
            until_review = (review - ctx.now) * 1.25 if review is not None else 0.0
            ttl = min(max(remaining * config.pin_ttl_margin, until_review),
                      worker.budgets.max_retain_ttl_s)
            # A retain re-sent for this gap (its priority moved) already sent the rest
            # first; the worker would walk the session's blocks again for nothing.
            re_sent = not new_blocks and current is not None and (
                current.action_type == ActionType.RETAIN.value)
            payload = RetainPayload(target=_chain_target(session, worker, blocks),
                                    priority=priority, ttl_s=ttl,
                                    evict_rest_first=worker.evict_rest_first and not re_sent)
            return _send(ctx, session, worker, payload, blocks, priority, ttl, f"{reason}:retain")
    return _release(ctx, session, worker, f"{reason}:low_value")


def _end(ctx: PlannerContext, session: SessionPlanState, reason: str) -> PlanResult:
    ended = replace(session, ended=True, gap_opened_at=None)
    worker = ctx.workers.get(session.worker_id or "")
    if worker is None:
        return PlanResult(replace(ended, protection=None))
    blocks = _blocks_of(ctx, session, worker.block_size)
    if worker.host_tier and not session.demoted and worker.can_send(ActionType.DEMOTE, ctx.config):
        payload = DemotePayload(target=Target(session_id=session.session_id))
        result = _send(ctx, ended, worker, payload, blocks, 0, 0.0, f"{reason}:demote")
        return PlanResult(replace(result.session, demoted=True), result.actions)
    if blocks and ctx.config.ended_retain_ttl_s > 0 and _tenant_retain_fits(
            ctx, session, worker, ActionType.RETAIN, blocks
    ) and worker.can_send(ActionType.RETAIN, ctx.config):
        # Lowest class, not a release: its blocks go first, while a prefix it shares with
        # live sessions keeps their priority (a release would queue the blocks behind
        # every other free block, as the most recently used). Within the tenant's retain
        # budget like any retain (before, unchecked), else released.
        ttl = min(ctx.config.ended_retain_ttl_s, worker.budgets.max_retain_ttl_s)
        payload = RetainPayload(target=Target(session_id=session.session_id), priority=1,
                                ttl_s=ttl)
        return _send(ctx, ended, worker, payload, blocks, 1, ttl, f"{reason}:lowest")
    return _release(ctx, ended, worker, f"{reason}:release", always=True)


def _release(
    ctx: PlannerContext, session: SessionPlanState, worker: WorkerPlanView, reason: str,
    always: bool = False,
) -> PlanResult:
    """Retain priority 0: the worker drops the session's claims and its blocks follow
    vLLM's LRU. Sent only when the session holds a protection, or ``always`` (an ended
    session: the worker may then let its exclusive blocks go first)."""
    if (session.protection is None and not always) or not worker.can_send(
        ActionType.RETAIN, ctx.config
    ):
        return PlanResult(replace(session, protection=None))
    ttl = ctx.config.release_ttl_s
    payload = RetainPayload(target=Target(session_id=session.session_id), priority=0, ttl_s=ttl)
    result = _send(ctx, session, worker, payload, 0, 0, ttl, reason)
    return PlanResult(replace(result.session, protection=None), result.actions)


def _plan_move(
    ctx: PlannerContext, session: SessionPlanState, old: str, new: str
) -> list[PlannedAction]:
    config = ctx.config
    old_worker = ctx.workers.get(old)
    new_worker = ctx.workers.get(new)
    actions: list[PlannedAction] = []
    target = Target(session_id=session.session_id)
    if old_worker is not None and old_worker.can_send(ActionType.SHARE, config):
        blocks = _blocks_of(ctx, session, old_worker.block_size)
        payload = SharePayload(target=target, destination_worker=new, ttl_s=config.share_ttl_s)
        actions.append(PlannedAction.make(ctx, old, payload, session.session_id,
                                          session.tenant, blocks,
                                          ctx.now + config.share_ttl_s, "moved:share"))
    elif (
        new_worker is not None
        and new_worker.host_tier
        and new_worker.can_send(ActionType.PREFETCH, config)
        and _tenant_retain_fits(ctx, session, new_worker, ActionType.PREFETCH,
                                blocks := _blocks_of(ctx, session, new_worker.block_size))
    ):
        # A Prefetch retains what it brings into G1 until its deadline: the holdings
        # ledger and the sessions API's budget check count that as retained, so it fits
        # the tenant's retain budget whole or is not sent (before, unchecked). The old
        # worker's protection, released below, is still counted: conservative.
        payload = PrefetchPayload(target=target, deadline_s=config.prefetch_deadline_s)
        # Until its deadline: the worker retains what it brought into G1 that long.
        actions.append(PlannedAction.make(ctx, new, payload, session.session_id,
                                          session.tenant, blocks,
                                          ctx.now + config.prefetch_deadline_s,
                                          "moved:prefetch"))
    if old_worker is not None and session.protection is not None:
        if old_worker.host_tier and old_worker.can_send(ActionType.DEMOTE, config):
            payload = DemotePayload(target=target)
            actions.append(PlannedAction.make(ctx, old, payload, session.session_id,
                                              session.tenant, session.protection.blocks,
                                              ctx.now, "moved:demote"))
        else:
            actions.extend(_release(ctx, session, old_worker, "moved:release").actions)
    return actions


def _own_held(ctx: PlannerContext, protection: Protection | None, kind: ActionType) -> int:
    """The blocks ``protection`` (the session's own, which a new protection of it
    supersedes) still counts in its worker's and tenant's holdings, when it is of type
    ``kind``: none once its TTL is over, as the holdings ledger drops it then
    (``HoldingsLedger.expire``). Before, an expired one was still subtracted from what
    the ledger holds, and the room it showed exceeded the budget by its blocks (a short
    tool's pin, expired during the next turn, let that turn's pin past the pin budget)."""
    if protection is None or protection.action_type != kind.value or (
            protection.expires_at <= ctx.now):
        return 0
    return protection.blocks


def _change(ctx: PlannerContext, session: SessionPlanState, worker: WorkerPlanView,
            kind: ActionType, blocks: int, tenant_cap: int | None
            ) -> tuple[HoldingChange, HoldingChange]:
    """(worker, tenant): what a ``kind`` (Pin, Retain, Prefetch) of the session's first
    ``blocks`` on ``worker`` frees and adds in their counts, as the caller's ledger counts
    them (``ctx.holding_change``, its blocks named by ``ctx.chain``; the tenant's only
    where ``tenant_cap`` bounds it): blocks other holdings hold add nothing (before, a
    first Pin/Retain was charged its whole chain, a system prompt held already too).
    Without a ledger: every block adds one, a Pin/Retain frees the session's own."""
    if ctx.holding_change is not None:
        return ctx.holding_change(worker.worker_id,
                                  session.tenant if tenant_cap is not None else None,
                                  session.session_id, kind.value, blocks,
                                  tuple(ctx.chain[:blocks]))
    own = 0 if kind is ActionType.PREFETCH else _own_held(ctx, session.protection, kind)
    if kind is ActionType.PIN:
        change = HoldingChange(Holdings(own, 0), Holdings(blocks, 0))
    else:
        change = HoldingChange(Holdings(0, own), Holdings(0, blocks))
    return change, change


def _tenant_retain_fits(ctx: PlannerContext, session: SessionPlanState,
                        worker: WorkerPlanView, kind: ActionType, blocks: int) -> bool:
    """Whether a Retain (or a Prefetch, which retains what it brings) of the session's
    first ``blocks`` on ``worker`` fits its tenant's retain budget: what it adds
    (:func:`_change`) within the room left once the holding it supersedes is gone."""
    cap = ctx.config.tenant_max_retained_blocks
    if cap is None:
        return True
    _, change = _change(ctx, session, worker, kind, blocks, cap)
    tenant = ctx.tenant_held.get(session.tenant, Holdings())
    return change.added.retained_blocks <= room_left(
        tenant.retained_blocks - change.freed.retained_blocks, cap)


def _send(
    ctx: PlannerContext,
    session: SessionPlanState,
    worker: WorkerPlanView,
    payload: HintPayload,
    blocks: int,
    priority: int,
    ttl: float,
    reason: str,
) -> PlanResult:
    planned = PlannedAction.make(ctx, worker.worker_id, payload, session.session_id,
                                 session.tenant, blocks, ctx.now + ttl, reason)
    protection = Protection(
        action_id=planned.action.action_id,
        action_type=planned.action_type,
        worker_id=worker.worker_id,
        priority=priority,
        blocks=blocks,
        expires_at=ctx.now + ttl,
    )
    holds = planned.action_type in (ActionType.PIN.value, ActionType.RETAIN.value) and blocks > 0
    return PlanResult(replace(session, protection=protection if holds else None), (planned,))
