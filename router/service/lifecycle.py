"""Session lifecycle: what each turn, response, end and idle tick does to a session, and
which planner function it asks for hints.

- turn starts: the session's record opens (created on its first turn); an open tool gap
  closes (its length is recorded for the operator; the planner learns it too);
- turn routed: :func:`plan_turn_routed` (a move to another worker plans Share/Prefetch);
- response finished: counters from the worker's usage; :func:`plan_response_finished`
  (a response ending in tool calls opens a tool gap: Pin/Retain for the predicted gap);
- end (``DELETE /v1/sessions/{id}``, or ``X-Session-End: true`` on a turn that
  succeeded): what an agent runtime asked the session's worker to hold through the API
  is released, then :func:`plan_session_end`; the session then takes no agent hints
  (sessions_api) until its next turn, which opens it again;
- an agent's Demote through the API: the planner's holding of the session on that worker
  is over, and the planner leaves it demoted until its next turn;
- a worker answers the session's Pin/Retain: the protection the planner remembers becomes
  what the worker applied (:meth:`SessionPlanState.settled`); one that could not be sent
  (NATS down) protects nothing;
- a turn in flight when its session ends (a DELETE while the worker answers) only
  updates the counters: nothing is planned for a session that ended;
- tick: :func:`plan_idle` for sessions awaiting a return (decay, release, abandon) when
  :func:`next_idle_review` says one is due, the same schedule the simulator keeps (of
  the sessions whose latest event this replica saw: idle_reviews.py); hint
  deadlines, learned statistics saved; ended sessions (an idle one ends when abandoned)
  and sessions awaiting nothing are forgotten from memory once long gone; every
  ``PlannerConfig.shared_prefix_scan_s`` prefixes shared by many sessions are retained
  (:func:`find_shared_prefixes`, :func:`plan_shared_prefixes`; the simulator runs the
  same scan).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

from kvhint.router.policy import (
    FinishReason,
    PlannerContext,
    PlanResult,
    ResponseFinished,
    SessionEnded,
    SharedPrefix,
    SharedPrefixRetains,
    TurnRouted,
    agent_scope,
    find_shared_prefixes,
    plan_idle,
    plan_response_finished,
    plan_shared_prefixes,
    plan_session_end,
    plan_turn_routed,
    session_chain,
)
from kvhint.router.service.agent_releases import release_actions, release_targets
from kvhint.router.service.hint_dispatch import API_SOURCE, FAILED, HintDispatcher, SentAction
from kvhint.router.service.hint_records import HINT_RELEASE_TYPES
from kvhint.router.service.idle_reviews import (
    SessionRevisions,
    due_reviews,
    reviewed_elsewhere,
    saved_elsewhere,
)
from kvhint.router.service.metrics import RouterMetrics
from kvhint.router.service.response_scan import ResponseObservation
from kvhint.router.service.sessions import (
    ACTIVE,
    ENDED,
    MAX_BEGINS_KEPT,
    MAX_GAPS_KEPT,
    TOOL_GAP,
    SessionRecord,
    SessionRegistry,
)
from kvhint.schemas import HintOutcome, HoldRelease

log = logging.getLogger(__name__)


class SessionLifecycle:
    def __init__(self, sessions: SessionRegistry, hints: HintDispatcher, metrics: RouterMetrics,
                 hints_enabled: bool, forget_after_s: float,
                 clock: Callable[[], float] = time.time,
                 on_end: Callable[[str, str], None] | None = None,
                 load_session: Callable[[str, str], Awaitable[dict[str, Any] | None]]
                 | None = None,
                 index_exact: Callable[[str], bool] | None = None,
                 max_prompt_blocks: int | None = None,
                 latest_session: Callable[[str, str],
                                          Awaitable[tuple[str, dict[str, Any] | None]]]
                 | None = None,
                 agent_claims: Callable[[str, str, float], Awaitable[list[dict[str, Any]]]]
                 | None = None, session_revisions: SessionRevisions | None = None) -> None:
        """``on_end(tenant, session_id)``: told of every end by a client or an admin,
        once each (the trace recorder), an abandoned session's too; never of the
        planner's abandonment.
        ``load_session(tenant, session_id)``: the session's stored row, or None (the
        store), asked by :meth:`recall`. ``index_exact(worker_id)``: whether the cluster
        index's view of the worker is exact now (``KvEventIngestor.view_exact``); None:
        always (no index feed to ask). ``max_prompt_blocks``: the most block hashes a
        session keeps of its last prompt (the longest prompt the workers take).
        ``latest_session(tenant, session_id)``: the read's outcome and the stored row of
        a session held in memory (session_reads.StoredSessions.latest), asked by
        :meth:`recall` before each turn. ``agent_claims(tenant, session_id, now)``: the
        session's live agent claims in the store, any replica's (agent_releases.py)."""
        self.sessions = sessions
        self.hints = hints
        self._metrics = metrics
        self._hints_enabled = hints_enabled
        self._forget_after_s = forget_after_s
        self._clock = clock
        self._prefix_retains = SharedPrefixRetains()
        self._on_end = on_end
        self._load_session = load_session
        self._latest_session = latest_session
        # A tick's due idle reviews' row revisions (StoredSessions.revisions; None: each
        # review with ``latest_session`` reads its row).
        self._session_revisions = session_revisions
        self._agent_claims = agent_claims
        self._index_exact = index_exact
        self._max_prompt_blocks = max_prompt_blocks
        # Each session's end in progress (:meth:`end`): a concurrent end joins it.
        self._ending: dict[tuple[str, str], asyncio.Future[list[SentAction]]] = {}

    async def recall(self, tenant: str, session_id: str) -> None:
        """Before a turn (an end, a hints call) of a session not in memory: bring its
        stored record back, so the turn continues its history instead of starting a
        blank one that the first save writes over the stored row. Any session id not in
        memory is looked up, once (the turn then makes its record): the store is shared
        with other replicas, whose sessions no registry's restore or bookkeeping can
        know of (another replica's session continued here; or one forgotten, evicted, or
        not restored). ``load_session`` bounds the wait (session_reads.py).

        A session in memory with no turn of it in flight here is read again
        (``latest_session``): another replica's saves since are merged into the record
        (``SessionRegistry.refresh``), so the turn continues the session as it is, not
        as this replica last saw it; counted (``session_refreshes``)."""
        record = self.sessions.get(tenant, session_id)
        if record is None:
            if self._load_session is not None:
                row = await self._load_session(tenant, session_id)
                if row is not None:
                    self.sessions.adopt(row)
            return
        if self._latest_session is None or record.inflight:
            return
        outcome, row = await self._latest_session(tenant, session_id)
        if row is not None:
            outcome = "merged" if self.sessions.refresh(record, row) else "current"
        self._metrics.session_refreshes.labels(outcome).inc()

    def begin_turn(self, tenant: str, session_id: str) -> SessionRecord:
        now = self._clock()
        record = self.sessions.open(tenant, session_id, now)
        if record.open_gap is not None:
            gap = record.open_gap
            # Never below 0: a gap another replica opened is stamped by its clock, which
            # may be ahead of this one's (the planner's own measure is kept so too).
            record.gaps.append({"tools": gap.get("tools", []),
                                "seconds": round(max(now - gap.get("started_at", now), 0.0),
                                                 3),
                                "depth": record.turns})
            del record.gaps[:-MAX_GAPS_KEPT]  # the stored row keeps as many
            record.open_gap = None
        record.began.append(now)
        del record.began[:-MAX_BEGINS_KEPT]
        record.state = ACTIVE
        record.ended_at = None
        record.last_activity = now
        record.latest_elsewhere = False  # this replica serves its latest turn
        record.inflight += 1
        return record

    async def routed(self, record: SessionRecord, worker_id: str, prompt_tokens: int,
                     predicted_cached: int, block_hashes: tuple[int, ...],
                     prediction_exact: bool = True) -> None:
        """``prediction_exact``: the prompt's block hashes are vLLM's own, so
        ``predicted_cached`` is what the worker's cache holds of it (the planner learns
        from it only then). It holds only while the index's view of the worker is exact
        too: routing reads a resyncing worker's view from before its stream's gap, and a
        silent one's as it was last heard, both estimates the planner must not learn
        whether next turns read their responses from."""
        now = self._clock()
        if prediction_exact and self._index_exact is not None:
            prediction_exact = self._index_exact(worker_id)
        if record.worker_id is not None and record.worker_id != worker_id:
            self._metrics.session_moves.inc()
        record.worker_id = worker_id
        record.last_block_hashes = block_hashes[:self._max_prompt_blocks]
        if record.state == ENDED:  # ended while this turn was on its way: plan nothing
            self.sessions.save(record)
            return
        # Its depth is the answered turns' (record.turns), as the operator's: a failed
        # turn before it (refused, failed, the client gone) does not deepen it.
        event = TurnRouted(record.worker_session_id, record.tenant, worker_id, prompt_tokens, now,
                           predicted_cached if prediction_exact else None,
                           depth=record.turns + 1)
        context = self.hints.context(now, record.tenant, record.last_block_hashes)
        await self._apply(record, plan_turn_routed(context, record.plan, event))
        self.sessions.save(record)

    async def finished(self, record: SessionRecord, worker_id: str,
                       observation: ResponseObservation | None, session_end: bool,
                       answered: bool = True, predicted_cached: int | None = None) -> None:
        """``answered``: the worker answered the turn (2xx, no error in its stream). Only
        an answered turn counts in the session's ``turns``: the exchanges it has had,
        what an operator reads as its depth (and what a tool gap's depth records), not
        its attempts: a turn the worker refused (a prompt too long) or failed, which the
        agent retries, would count twice (the request metrics count those by status).
        The planner's depth (``plan.turns``) counts the same turns. A refused one's
        block hashes are not kept either (the session keeps those of its last answered
        prompt).

        ``predicted_cached``: what routing predicted the worker's cache held of the turn's
        prompt, where that prediction is checked against the usage (as
        ``kvhint_router_cached_tokens_predicted_total`` counts it); it joins the session's
        ``predicted_cached_tokens`` with the usage's tokens, so a failed turn's prediction
        no longer counts without the cached tokens to compare it with (before, it was added
        when the turn was routed: a session whose turn failed showed more predicted than
        its answered turns could hit)."""
        now = self._clock()
        if answered:
            record.turns += 1
            record.answered_block_hashes = record.last_block_hashes
        else:
            record.last_block_hashes = record.answered_block_hashes
            if record.plan.turns != record.turns and record.inflight <= 1:
                # The planner took the turn's depth when it was routed; failed, it is
                # no turn of the session's: its depth is the answered turns' again
                # (unless another turn is in flight, whose depth the planner holds).
                record.plan = replace(record.plan, turns=record.turns)
        record.inflight = max(record.inflight - 1, 0)
        record.last_activity = now
        record.latest_elsewhere = False
        if observation is not None and observation.prompt_tokens is not None:
            record.prompt_tokens += observation.prompt_tokens
            record.cached_tokens += observation.cached_tokens or 0
            record.predicted_cached_tokens += predicted_cached or 0
        if record.state == ENDED:  # ended while the worker answered: plan nothing
            self.sessions.save(record)
            return
        if observation is not None and observation.prompt_tokens is not None:
            reason = observation.finish()
            if reason is FinishReason.TOOL_CALLS:
                record.state = TOOL_GAP
                record.open_gap = {"tools": sorted(set(observation.tool_names)),
                                   "started_at": now, "worker_id": worker_id}
            # One prompt's and one completion's tokens (a batch of prompts, n > 1: the
            # session continues one of them).
            event = ResponseFinished(
                record.worker_session_id, reason, observation.prompt_tokens_per_prompt or 0,
                observation.completion_tokens_per_choice, now,
                tuple(sorted(set(observation.tool_names))))
            await self._apply(record, plan_response_finished(
                self.hints.context(now, record.tenant, record.last_block_hashes),
                record.plan, event))
        if session_end:
            await self.end(record)
            return
        self.sessions.save(record)

    async def end(self, record: SessionRecord) -> list[SentAction]:
        """End the session; returns the hint actions the end sent. A session that has
        already ended (a repeated DELETE, or one the planner abandoned when idle) has
        nothing of the planner's left to end: only what an agent runtime still holds for
        it is released (its claims outlive an abandonment, and an agent may hint a session
        the planner abandoned), so a repeated end sends nothing when nothing is held. Either
        way the session is now one its client ended (``ended_explicitly``: it takes no
        more agent hints until its next turn).

        An end that comes while another end of the session is still sending (a second
        DELETE, or an admin's end, while the first publishes its releases) joins it: it
        sends nothing itself and answers with what that end sent (run again, it would
        send the same releases twice, and the planner's end after them). The end runs to
        its last step even if the caller that started it goes away meanwhile."""
        ending = self._ending.get(record.key)
        if ending is None or ending.done() or record.state != ENDED:
            # Marked ended before any await (hints checked from here on are refused);
            # what the end sends, in a task of its own that every end of it awaits.
            ending = asyncio.ensure_future(self._send_end(record, self._mark_ended(record)))
            self._ending[record.key] = ending
            ending.add_done_callback(functools.partial(self._end_done, record.key))
        return list(await asyncio.shield(ending))

    def _mark_ended(self, record: SessionRecord) -> float | None:
        """The steps of :meth:`end` before its first await; the clock reading of a new
        end, None for a session that had already ended (only the agent's claims left)."""
        if record.state == ENDED and record.plan.ended:
            if not record.plan.ended_explicitly:  # abandoned, now ended by its client too
                # Its end is the client's from here on (the abandonment's time goes),
                # stamped as every explicit end is: one clock reading in ended_at and the
                # plan's last_activity. A row of it that an older router saves again
                # without the flag is then still read as ended by its client
                # (sessions._ended_explicitly_before_the_flag).
                now = self._clock()
                record.ended_at = now
                record.latest_elsewhere = False
                record.plan = replace(record.plan, ended_explicitly=True, last_activity=now)
                self.sessions.save(record)
                # The client's end is told as every explicit end is, once (a repeated
                # one finds it ended explicitly): the trace holds the client's events, not
                # the planner's abandonment (a replay's planner abandons on its own).
                self._told_of_end(record)
            return None
        now = self._clock()
        record.state = ENDED
        # Ended by its client from here on, before the first await: a hints call checked
        # while this end publishes its releases is refused (session_ended), not sent
        # with a claim the release, already under way, does not cover.
        record.plan = replace(record.plan, ended_explicitly=True)
        record.ended_at = now
        record.latest_elsewhere = False
        record.open_gap = None
        self._told_of_end(record)
        return now

    def _told_of_end(self, record: SessionRecord) -> None:
        if self._on_end is not None:
            self._on_end(record.tenant, record.session_id)

    async def _send_end(self, record: SessionRecord, now: float | None) -> list[SentAction]:
        if now is None:  # had already ended: what an agent runtime still holds, if any
            return await self._release_agent_claims(record, self._clock(), None)
        event = SessionEnded(record.worker_session_id, now)
        # First, so that the planner's Demote that may follow can let go of those blocks.
        sent = await self._release_agent_claims(record, now, record.plan.worker_id)
        sent += await self._apply(record, plan_session_end(
            self.hints.context(now, record.tenant, record.last_block_hashes), record.plan,
            event))
        self.sessions.save(record)
        return sent

    def _end_done(self, key: tuple[str, str], ending: asyncio.Future[list[SentAction]]) -> None:
        if self._ending.get(key) is ending:
            del self._ending[key]
        if not ending.cancelled() and (error := ending.exception()) is not None:
            # Its callers, if any still wait, get the error too; one gone (a client that
            # left) would leave it to asyncio's "never retrieved" at collection.
            log.error("ending session %r/%r failed", *key, exc_info=error)

    async def _release_agent_claims(self, record: SessionRecord, now: float,
                                    planner_ends_on: str | None) -> list[SentAction]:
        """An ended session needs nothing an agent runtime asked a worker to hold for it:
        release them on every worker that holds some (the session's own, an earlier one
        it moved from, one the agent named), any replica's (agent_releases.py), since the
        planner's own end never touches an agent's claims. Two forms, as the claims went
        out: the agent's own (``owner: agent``, 1.2); the session's, with no owner (1.0:
        an old-form claim, a 1.0/1.1 worker's), not on ``planner_ends_on`` (the worker
        the planner's end goes to next: its Demote or Retain supersedes it)."""
        session_scope = record.worker_session_id
        scope = agent_scope(session_scope)
        if not self._hints_enabled:
            return []
        stored = ([] if self._agent_claims is None else
                  await self._agent_claims(record.tenant, record.session_id, now))
        holdings = self.hints.holdings
        targets = release_targets(holdings, session_scope, planner_ends_on, stored,
                                  self.hints.pending)
        if not targets:
            return []
        actions = release_actions(targets, session_scope, record.tenant,
                                  self.hints.planner_config.release_ttl_s, now,
                                  self.hints.new_id)
        # The agent's actions, not the planner's: sent as "api" like the claims they end,
        # so their outcomes never reach the planner's feedback (a worker rejecting an
        # agent-owned release must not turn Retain off for the planner there) and the
        # metrics count them with the agent's traffic.
        return await self.hints.send(actions, {scope: record.session_id,
                                               session_scope: record.session_id},
                                     source=API_SOURCE)

    def agent_demoted(self, record: SessionRecord, worker_id: str) -> None:
        """An agent runtime demoted the session on ``worker_id`` through the API (as its
        own, ``owner: agent``): the worker let that supersede the planner's claims too, so
        the planner's holding there is over; on the session's own worker the planner
        leaves it demoted until its next turn."""
        self.hints.holdings.release_scope(worker_id, record.worker_session_id)
        if worker_id == record.worker_id:
            record.plan = replace(record.plan, protection=None, demoted=True,
                                  agent_demoted=True)
            self.sessions.save(record)

    def on_hint_outcome(self, sent: SentAction, outcome: HintOutcome) -> None:
        """A worker answered ``sent``: fold it into its session's protection."""
        if sent.tenant is None or sent.session_id is None:
            return  # not a session's action (a shared prefix's)
        record = self.sessions.get(sent.tenant, sent.session_id)
        if record is None:
            return
        plan = record.plan.settled(outcome)
        if plan is not record.plan:
            record.plan = plan
            self.sessions.save(record)

    def on_hold_released(self, release: HoldRelease) -> None:
        """A worker let blocks of a session's Pin/Retain go unasked: the session's
        protection covers what is left (none: the next idle review asks again). A
        release of another type than a hint's (a donor advice's, whose id may equal a
        hint action's) is not one (counted by :meth:`HintDispatcher.on_release`)."""
        if release.session_id is None or release.action_type not in HINT_RELEASE_TYPES:
            return  # not a session's action (a shared prefix's, a donor advice's)
        record = self.sessions.by_worker_session_id(release.session_id)
        if record is None:
            return
        plan = record.plan.holding(release.action_id, release.held.blocks)
        if plan is not record.plan:
            record.plan = plan
            self.sessions.save(record)

    async def tick(self) -> None:
        now = self._clock()
        self.hints.expire(now)
        await self._retain_shared_prefixes(now)
        contexts: dict[str, PlannerContext] = {}  # per tenant, rebuilt after sends
        config = self.hints.planner_config
        due_now = due_reviews(self.sessions, config, now, self._forget_after_s)
        # One read of their rows' revisions; a row read only where it moved (idle_reviews.py).
        saved = (await saved_elsewhere([r for r, _ in due_now], self._session_revisions)
                 if self._latest_session is not None and due_now else None)
        for record, plan in due_now:
            if record.inflight or record.plan is not plan:  # changed meanwhile
                continue
            read = self._latest_session if saved is None or record.key in saved else None
            if await reviewed_elsewhere(record, self.sessions, self.hints.holdings, read,
                                        self._metrics):
                continue
            if record.inflight or record.plan is not plan:  # changed while read
                continue
            record.idle_reviewed_at = now
            context = contexts.get(record.tenant)
            if context is None:
                context = contexts[record.tenant] = self.hints.context(now, record.tenant)
            # The tenant's context, with this session's chain (what its Pin/Retain names).
            result = plan_idle(replace(context, chain=record.last_block_hashes), plan)
            if result.session is not plan or result.actions:
                await self._apply(record, result)
                if result.actions:
                    contexts.clear()  # holdings changed
                if result.session is not None and result.session.ended:
                    record.state = ENDED
                    record.ended_at = now
                self.sessions.save(record)
        self.hints.save_learned(now)

    async def _retain_shared_prefixes(self, now: float) -> None:
        config = self.hints.planner_config
        if not self._prefix_retains.scan_due(now, config.shared_prefix_scan_s):
            return
        self._prefix_retains.expire(now)
        # Each session is valued from its own tenant's statistics.
        contexts: dict[str, PlannerContext] = {}
        chains = []
        for record in self.sessions:
            if record.state == ENDED:
                continue
            context = contexts.get(record.tenant)
            if context is None:
                context = contexts[record.tenant] = self.hints.context(now, record.tenant)
            chain = session_chain(context, record.plan, record.worker_id,
                                  record.last_block_hashes)
            if chain is not None:
                chains.append(chain)
        prefixes = find_shared_prefixes(chains, config.shared_prefix_min_sessions,
                                        self._prefix_retains.until)
        # Each tenant's prefixes are planned against its own budget (the scan's context
        # has none: it pools every tenant's sessions, each tenant's apart).
        by_tenant: dict[str | None, list[SharedPrefix]] = {}
        for prefix in prefixes:
            by_tenant.setdefault(prefix.tenant, []).append(prefix)
        actions = [action for tenant, group in by_tenant.items()
                   for action in plan_shared_prefixes(self.hints.context(now, tenant), group)]
        if self._hints_enabled and actions:
            await self.hints.send(actions, {})
            self._prefix_retains.sent(actions)

    async def _apply(self, record: SessionRecord, result: PlanResult) -> list[SentAction]:
        if result.session is not None:
            record.plan = result.session
        self.hints.observe(result.observations, record.tenant)  # its tenant's statistics only
        if self._hints_enabled and result.actions:
            sent = await self.hints.send(
                result.actions, {record.worker_session_id: record.session_id},
                chains={record.worker_session_id: record.last_block_hashes})
            for action in sent:
                if action.status == FAILED:  # never reached the worker: holds nothing
                    record.plan = record.plan.holding(action.action_id, 0)
            return sent
        return []
