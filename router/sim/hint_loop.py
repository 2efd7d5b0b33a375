"""The simulation's hint side: the router's real planner, holdings ledger and outcome
feedback, driven as the live router drives them (router/service/lifecycle.py and
hint_dispatch.py), with the simulated workers' PluginCore answering at once. Learned
statistics are per tenant as there (:class:`TenantStats`, the trace's tenants): a trace
of one tenant plans exactly as with one :class:`LearnedStats`.

:class:`HintLoop` is a part of :class:`~kvhint.router.sim.engine.Simulation` (a mixin,
so the event loop and this side share one set of fields and the simulation's results
stay what they were before the split). Contract with the engine: it owns the fields
annotated below (``Simulation.__init__`` sets them), pushes idle reviews on the engine's
heap (``_push_review``) and hands them back to :meth:`HintLoop._on_review`, and calls
``_try_start`` on a worker after hints may have freed blocks a waiting prompt needs, and
``_arm_deadline`` after hints, so the engine wakes the worker at its plugin's next
deadline (a hold's TTL).
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from kvhint.router.policy import (
    HoldingsLedger,
    PlannedAction,
    PlannerContext,
    PlanResult,
    SessionChain,
    SessionPlanState,
    SharedPrefixRetains,
    SplitFeedback,
    TenantStats,
    WorkerPlanView,
    find_shared_prefixes,
    next_idle_review,
    plan_idle,
    plan_shared_prefixes,
    session_chain,
    target_keys,
)
from kvhint.schemas import DecodedHints, HintOutcome, parse_action

if TYPE_CHECKING:
    from kvhint.router.sim.config import SimConfig
    from kvhint.router.sim.results import PolicyResult
    from kvhint.router.sim.scheduler_worker import SchedulerSimWorker
    from kvhint.router.sim.worker import SimWorker

class HintLoop:
    """The planner's half of a :class:`~kvhint.router.sim.engine.Simulation`."""

    # Set by Simulation.__init__ (declared here for the methods below; no class values).
    now: float
    config: SimConfig
    hints_on: bool
    result: PolicyResult
    workers: dict[str, SimWorker | SchedulerSimWorker]
    learned: TenantStats
    ledger: HoldingsLedger
    sessions: dict[str, SessionPlanState]
    feedback: dict[str, SplitFeedback]
    _planned: dict[str, PlannedAction]
    _last_hashes: dict[str, tuple[int, ...]]
    _prefix_retains: SharedPrefixRetains
    _static_views: dict[str, WorkerPlanView]
    _plan_rng: random.Random
    _message_ids: Iterator[int]
    _tick_index: int
    _scan_tick: int

    def _push_review(self, at: float, payload: tuple[str, float]) -> None:
        raise NotImplementedError  # the engine's heap: an idle review of (session, gap)

    def _try_start(self, worker: SimWorker | SchedulerSimWorker) -> None:
        raise NotImplementedError  # the engine's admission

    def _arm_deadline(self, worker: SimWorker | SchedulerSimWorker) -> None:
        raise NotImplementedError  # the engine's wake-up at the worker's next hold deadline

    def _scan_could_act(self) -> bool:
        """Whether a shared-prefix scan now has any session to count (else it sends
        nothing, whenever it runs, until an event changes the sessions)."""
        return any(True for _ in self._chains())

    def _chains(self) -> Iterator[SessionChain]:
        """The sessions' shared-prefix scan input, each valued from its tenant's
        statistics (the live lifecycle's _retain_shared_prefixes does the same)."""
        contexts: dict[str, PlannerContext] = {}
        for key, session in self.sessions.items():
            ctx = contexts.get(session.tenant)
            if ctx is None:
                ctx = contexts[session.tenant] = self._planner_ctx(session.tenant)
            chain = session_chain(ctx, session, session.worker_id,
                                  self._last_hashes.get(key, ()))
            if chain is not None:
                yield chain

    def _planner_ctx(self, tenant: str | None, session_key: str | None = None
                     ) -> PlannerContext:
        """The planner's view for a session of ``tenant`` (its statistics and outcome
        feedback only, and what each worker cannot do); with ``session_key``, that
        session's chain (the hashes its Pin/Retain is recorded by, :meth:`_send`), so it
        is charged what it adds to the ledger's counts, as the live router's context."""
        # As the live router's context: holdings past their TTL go first (the planner
        # counts a session's own protection only until its TTL, planner._own_held).
        self.ledger.expire(self.now)
        views = {}
        for worker_id, static in self._static_views.items():
            views[worker_id] = replace(static, held=self.ledger.worker(worker_id),
                                       feedback=self.feedback[worker_id].view(tenant),
                                       pinned_claims=self.ledger.claims(worker_id)[0])
        chain = self._last_hashes.get(session_key, ()) if session_key is not None else ()
        return PlannerContext(now=self.now, stats=self.learned.of(tenant), workers=views,
                              rng=self._plan_rng, config=self.config.planner, chain=chain,
                              holding_change=self.ledger.replacing)

    def _apply_plan(self, result: PlanResult, tenant: str) -> None:
        if result.session is not None:
            previous = self.sessions.get(result.session.session_id)
            self.sessions[result.session.session_id] = result.session
            self._schedule_review(previous, result.session)
        for observation in result.observations:
            # Every tenant of the trace learns (Simulation.__init__): never refused.
            self.learned.apply(tenant, observation)
        self._send(result.actions)

    def _schedule_review(self, previous: SessionPlanState | None,
                         session: SessionPlanState) -> None:
        review_at = next_idle_review(self.config.planner, session, self.now)
        if review_at is None:
            return
        if previous is not None and previous.gap_opened_at == session.gap_opened_at and (
            previous.awaiting_return
        ):
            return  # a review for this gap is already queued
        self._push_review(max(review_at, self.now), (session.session_id, session.gap_opened_at))

    def _on_review(self, payload: tuple[str, float]) -> None:
        session_key, opened_at = payload
        session = self.sessions.get(session_key)
        if session is None or not session.awaiting_return or session.gap_opened_at != opened_at:
            return
        result = plan_idle(self._planner_ctx(session.tenant, session_key), session)
        self._apply_plan(result, session.tenant)
        if result.session is not None and result.session.awaiting_return:
            review_at = next_idle_review(self.config.planner, result.session, self.now)
            if review_at is not None and review_at > self.now:
                self._push_review(review_at, (session_key, opened_at))

    def _send(self, actions: Sequence[PlannedAction]) -> None:
        if not actions:
            return
        by_worker: dict[str, list[PlannedAction]] = {}
        for planned in actions:
            by_worker.setdefault(planned.worker_id, []).append(planned)
            keys = target_keys(planned.action_type, planned.action.payload,
                               self.config.block_size, self._last_hashes.get(planned.scope, ()))
            self.ledger.record(action_id=planned.action.action_id, worker_id=planned.worker_id,
                               tenant=planned.tenant, scope=planned.scope,
                               action_type=planned.action_type, blocks=planned.blocks,
                               expires_at=planned.expires_at, keys=keys)
            self._planned[planned.action.action_id] = planned
            self.result.hints[(planned.action_type, "sent")] += 1
        for worker_id, planned_list in by_worker.items():
            worker = self.workers[worker_id]
            message = DecodedHints(f"sim-{next(self._message_ids)}",
                                   [parse_action(p.action) for p in planned_list])
            self._on_outcomes(worker.core.apply_hints(message))
            self._take_releases(worker)
            worker.sync()
            self._arm_deadline(worker)
            # Hints may have released blocks a waiting prompt needs.
            self._try_start(worker)

    def _on_outcomes(self, outcomes: Sequence[HintOutcome]) -> None:
        for outcome in outcomes:
            self.result.hints[(outcome.action_type, outcome.status.value)] += 1
            if not outcome.status.is_terminal:
                continue
            view = self._static_views.get(outcome.worker_id)
            self.ledger.settle(outcome, self.now,
                               view.budgets.max_retain_ttl_s if view is not None else None)
            planned = self._planned.pop(outcome.action_id, None)
            if planned is not None and (session := self.sessions.get(planned.scope)):
                self.sessions[planned.scope] = session.settled(outcome)
            worker_id = outcome.worker_id
            if worker_id in self.feedback and planned is not None:
                self.feedback[worker_id] = self.feedback[worker_id].learn(planned.tenant,
                                                                          outcome)

    def _take_releases(self, worker: SimWorker | SchedulerSimWorker) -> None:
        """What the worker's holds lost unasked (displaced, relieved), as the live router
        takes it: holdings shrink and the session's protection covers what is left."""
        message = worker.core.take_releases()
        if message is None:
            return
        for release in message.releases:
            self.result.released_blocks[(release.action_type, release.reason.value)] += (
                release.released.blocks)
            self.ledger.released(release.action_id, release.held.blocks)
            session = self.sessions.get(release.session_id) if release.session_id else None
            if session is not None:
                self.sessions[release.session_id] = session.holding(release.action_id,
                                                                    release.held.blocks)

    def _on_tick(self) -> None:
        self.ledger.expire(self.now)
        if self.hints_on:
            self._retain_shared_prefixes()
        for worker in self.workers.values():
            self._advance_worker(worker)

    def _advance_worker(self, worker: SimWorker | SchedulerSimWorker) -> None:
        """The plugin's TTL expiry and deferred outcomes at ``now``, then admission (an
        ended hold may leave room for a waiting prompt)."""
        outcomes = worker.core.advance()
        worker.sync()
        if outcomes:
            self._on_outcomes(outcomes)
        self._try_start(worker)

    def _retain_shared_prefixes(self) -> None:
        """The live lifecycle's scan (router/service/lifecycle.py), on the tick."""
        config = self.config.planner
        retains = self._prefix_retains
        if not retains.scan_due(self.now, config.shared_prefix_scan_s):
            return
        self._scan_tick = self._tick_index
        retains.expire(self.now)
        prefixes = find_shared_prefixes(list(self._chains()), config.shared_prefix_min_sessions,
                                        retains.until)
        # No tenant budgets in the simulator: one context (statistics unread) plans all.
        actions = plan_shared_prefixes(self._planner_ctx(None), prefixes)
        self._send(actions)
        retains.sent(actions)
