"""Sending hints and taking their outcomes back.

The planner (pure, :mod:`kvhint.router.policy`) decides; this module does the rest:
builds its frozen context from the workers' heartbeats, the holdings ledger and the
outcome feedback (each worker's capabilities and the planning tenant's own); sends each
worker's actions in one ``KvHintsEnvelope`` on ``<prefix>.v1.hints.<w>``, every action
recorded (memory + store) before it is published (:mod:`.hint_send`); and folds each outcome
back into holdings, feedback, metrics, the store and any API caller waiting for it.
What the planner learns (each tenant's statistics, each worker's outcome feedback) and
its ``learned_stats`` rows are :mod:`.hint_learned`. The record of an action is
:mod:`.hint_records`, re-exported here, where callers have imported it; the sessions
API's budget check, :mod:`.hint_api_budget`.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import deque
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import msgspec

from kvhint.router.policy import (
    HoldingsLedger,
    LearnedStats,
    Observation,
    PlannedAction,
    PlannerConfig,
    PlannerContext,
    SplitFeedback,
    TenantStats,
    WorkerPlanView,
    target_keys,
)
from kvhint.router.policy.holdings import prefetch_held_until
from kvhint.router.service.hint_api_budget import ApiBudgetGate
from kvhint.router.service.hint_learned import LearnedState
from kvhint.router.service.hint_records import (
    API_SOURCE,
    EXPIRED,
    FAILED,
    HINT_RELEASE_TYPES,
    OUTCOME_DEADLINE_S,
    PENDING,
    PLANNER_SOURCE,
    SentAction,
    outcome_columns,
)
from kvhint.router.service.hint_send import HintSender
from kvhint.router.service.metrics import RouterMetrics
from kvhint.router.service.nats_link import NatsLink
from kvhint.router.service.settings import TenantBudget
from kvhint.router.service.tenancy import DEFAULT_TENANT
from kvhint.router.service.workers import WorkerRegistry
from kvhint.router.store.writer import StoreWriter
from kvhint.schemas import (
    DONOR_ACTION_TYPE,
    ActionType,
    Amount,
    HintOutcome,
    HoldRelease,
    ReleaseReason,
    Subjects,
    evict_rest_supported,
)
from kvhint.schemas.status import epoch_started_ms

__all__ = ["API_SOURCE", "EXPIRED", "FAILED", "OUTCOME_DEADLINE_S", "PENDING",
           "PLANNER_SOURCE", "HintDispatcher", "SentAction"]

_RECENT_KEPT = 2000


class HintDispatcher:
    def __init__(self, link: NatsLink | None, subjects: Subjects, workers: WorkerRegistry,
                 writer: StoreWriter | None, metrics: RouterMetrics,
                 planner_config: PlannerConfig, seed: int,
                 budget_of: Callable[[str], TenantBudget | None] = lambda _tenant: None,
                 clock: Callable[[], float] = time.time,
                 tenants: Collection[str] = (DEFAULT_TENANT,)) -> None:
        """``tenants``: the tenants the router serves (the configured ones and the default
        tenant); only they learn statistics (any other plans from the priors, its
        observations dropped and counted: ``learned_stats_unknown_tenant``)."""
        self._link = link
        self._subjects = subjects
        self._workers = workers
        self._writer = writer
        self._metrics = metrics
        self.planner_config = planner_config
        self._rng = random.Random(seed)
        self._clock = clock
        self._budget_of = budget_of
        self._tenants = tuple(tenants)
        self._learning = LearnedState(writer, metrics, workers, self._tenants)
        self.holdings = HoldingsLedger()
        self.pending: dict[str, SentAction] = {}
        self.recent: deque[SentAction] = deque(maxlen=_RECENT_KEPT)
        self._recent_by_id: dict[str, SentAction] = {}
        # Actions per tenant (None: actions of no tenant) and status they ended in.
        self._status_counts: dict[str | None, dict[str, int]] = {}
        self._api_gate = ApiBudgetGate(self.holdings, workers, self._block_size)
        self._sender = HintSender(link, subjects, self.holdings, self.pending, metrics,
                                  self._block_size, self._save, self._finish, clock)

    @property
    def learned(self) -> TenantStats:
        """Each served tenant's statistics (:mod:`.hint_learned`)."""
        return self._learning.stats

    @property
    def feedback(self) -> dict[str, SplitFeedback]:
        """Each worker's outcome feedback, its capabilities and each tenant's own
        (:mod:`.hint_learned`)."""
        return self._learning.feedback

    # --- planner context ----------------------------------------------------------------

    def context(self, now: float | None = None, tenant: str | None = None) -> PlannerContext:
        """The planner's frozen view; with ``tenant``, that tenant's budget and outcome
        feedback apply (no other tenant's outcomes turn its hints off or shrink them)."""
        now = self._clock() if now is None else now
        # Holdings past their TTL go first: the planner counts a session's own protection
        # as held only until its TTL (planner._own_held), so the ledger must agree at now.
        self.holdings.expire(now)
        views = {}
        for worker in self._workers.all():
            status = worker.status
            if status is None or not worker.plugin_alive:
                continue
            views[worker.worker_id] = WorkerPlanView(
                worker_id=worker.worker_id,
                block_size=status.block_size,
                budgets=status.budgets,
                supported_actions=frozenset(status.supported_actions),
                host_tier=status.host_tier,
                evict_rest_first=evict_rest_supported(status.supported_actions),
                held=self.holdings.worker(worker.worker_id),
                feedback=(None if (feedback := self.feedback.get(worker.worker_id)) is None
                          else feedback.view(tenant)),
            )
        config = self.planner_config
        tenant_held = {}
        if tenant is not None:
            tenant_held[tenant] = self.holdings.tenant(tenant)
            budget = self._budget_of(tenant)
            if budget is not None:
                config = replace(config, tenant_max_pinned_blocks=budget.max_pinned_blocks,
                                 tenant_max_retained_blocks=budget.max_retained_blocks)
        return PlannerContext(now=now, stats=self.learned.of(tenant), workers=views,
                              rng=self._rng, config=config, tenant_held=tenant_held)

    def stats_of(self, tenant: str | None) -> LearnedStats:
        """What ``tenant``'s planning predicts from (read only; the priors for a tenant
        with nothing learnt yet, or for None)."""
        return self.learned.of(tenant)

    @property
    def tenants(self) -> tuple[str, ...]:
        return self._tenants

    def observe(self, observations: Iterable[Observation], tenant: str | None) -> None:
        """Fold the planner's observations of a session of ``tenant`` into that tenant's
        statistics only."""
        self._learning.observe(observations, tenant)

    def reset_worker(self, worker_id: str, epoch: str | None = None) -> None:
        """A new engine epoch: forget what the old engine taught us about this worker, and
        what it held (a restarted engine holds nothing). The holdings let go are counted,
        one each (``hint_dropped:worker_restarted``, by design: the holds went with the
        old engine, and the ledger now agrees with the worker); before, silently. Its
        actions still waiting stay so: the old engine may have answered before it went
        (the outcome is on its stream), else they expire at their deadline
        (``hints_total{outcome="expired"}``), at most ``OUTCOME_DEADLINE_S`` from now: a
        Prefetch the old engine still had waiting is no longer waited for until its own
        deadline (the new engine never answers it); an answer no longer brings their
        holding back. Both are stored: each action let go is marked released by a
        ``reset``, holding nothing, which :meth:`restore` reads (before, a router restart
        counted the old engine's holds until their TTL, and a Prefetch it had waiting
        was held and waited for until its own deadline).

        ``epoch``: the new engine's. A hint sent after it took the worker's hints subject
        but before this router heard it is its own: one it answered already (``at``, the
        worker's clock, at or after the epoch's start) is not let go; one still waiting
        is, but comes back with that engine's answer (:meth:`on_outcome`). Before, the
        reset forgot both though the new engine held them. An epoch without order (an
        older plugin's) tells nothing: all are let go, as before."""
        self._learning.reset_worker(worker_id)
        now = self._clock()
        started_ms = epoch_started_ms(epoch) if epoch is not None else None
        started = None if started_ms is None else started_ms / 1000

        def new_engines(action_id: str) -> bool:
            record = self.pending.get(action_id) or self._recent_by_id.get(action_id)
            return (started is not None and record is not None
                    and record.answered_at is not None and record.answered_at >= started)

        waiting = [r for r in self.pending.values()
                   if r.worker_id == worker_id and not new_engines(r.action_id)]
        kept = {a for a in self.holdings.held_on(worker_id) if new_engines(a)}
        let_go = dict.fromkeys([*(a for a in self.holdings.held_on(worker_id)
                                  if a not in kept),
                                *(r.action_id for r in waiting)])
        dropped = self.holdings.forget_worker(worker_id, keep=kept)
        if dropped:
            self._metrics.drop("hint_dropped:worker_restarted", dropped)
        for action_id in let_go:
            self._engine_restarted(action_id, now)
        for record in waiting:
            record.cut_wait(now)
            record.reset_by_engine_at = started

    def _engine_restarted(self, action_id: str, now: float) -> None:
        """The action's holds went with its worker's old engine: its record and row say
        so as a ``reset`` release would (a late answer is capped: :meth:`effective`)."""
        record = self.pending.get(action_id) or self._recent_by_id.get(action_id)
        if record is not None:
            record.release_reason, record.released_at = ReleaseReason.RESET.value, now
            record.held_after_release_blocks = 0
        if self._writer is not None:  # the action's row (a no-op for one never stored)
            self._writer.update("hint_actions", (action_id,), {
                "action_id": action_id, "release_reason": ReleaseReason.RESET.value,
                "released_at": now, "held_after_release_blocks": 0})

    def forget_worker(self, worker_id: str) -> None:
        """The registry forgot the worker (heard only by its heartbeats, silent for good):
        what it taught the planner, and what it held, go from memory, and its stored
        feedback row from the store (before, the row stayed and a restarted router read
        it back). A worker heard again under its id starts afresh (a new engine, as
        after :meth:`reset_worker`). Its actions still waiting expire now, saved in the
        batch that deletes its row (and, by the foreign key, its actions' rows): later,
        with its row gone, the store would refuse them. The actions let go (held or
        waiting) are counted, one each (``hint_dropped:worker_forgotten``, by design:
        the worker is gone); before, silently."""
        self._learning.forget_worker(worker_id)
        dropped = self._let_go(worker_id, "worker forgotten", save=True)
        if dropped:
            self._metrics.drop("hint_dropped:worker_forgotten", dropped)

    def workers_pruned(self, worker_ids: Iterable[str], retention_s: float) -> None:
        """Retention deleted these workers' rows (store.retention.prune), their actions'
        and feedback rows with them: what memory keeps of each goes too. What it taught
        (:meth:`LearnedState.worker_pruned`); what it held (its Pins/Retains no longer
        count against budgets); its actions still waiting for an outcome, which end
        ``expired`` now, not saved (their rows are gone, and the store would refuse them
        without the worker's). The actions let go are counted
        (``hint_dropped:worker_pruned``). Before, its pending actions and holdings stayed
        until their deadline and TTL, or until the registry forgot the worker
        (:meth:`forget_worker`), which may be later (``events_stream_max_age_s``).
        A worker this router heard within ``retention_s`` is live (a heartbeat the store
        had not had yet, a plugin clock behind the router's) and keeps all of it: its
        next heartbeat writes its row again."""
        for worker_id in worker_ids:
            if self._workers.heard_within(worker_id, retention_s):
                continue
            self._learning.worker_pruned(worker_id)
            dropped = self._let_go(worker_id, "worker pruned by store retention", save=False)
            if dropped:
                self._metrics.drop("hint_dropped:worker_pruned", dropped)

    def _let_go(self, worker_id: str, reason: str, save: bool) -> int:
        """Forget the worker's holdings and expire its actions still waiting (``reason``;
        their rows saved or not); returns how many actions that let go, each once (a
        waiting Pin/Retain is held too)."""
        now = self._clock()
        waiting = [r for r in self.pending.values() if r.worker_id == worker_id]
        held_too = sum(record.action_id in self.holdings for record in waiting)
        dropped = len(waiting) + self.holdings.forget_worker(worker_id) - held_too
        for record in waiting:
            self._expire(record, now, reason, save=save)
        return dropped

    # --- sending ------------------------------------------------------------------------

    async def send(self, planned: Sequence[PlannedAction], session_ids: dict[str, str | None],
                   source: str = PLANNER_SOURCE,
                   chains: Mapping[str, Sequence[int]] | None = None) -> list[SentAction]:
        """Publish ``planned`` (one envelope per worker), each action recorded before its
        envelope is published and undone if NATS refuses it (:mod:`.hint_send`: a check
        the caller makes before this call, with no await between, and the record are
        one step). ``session_ids`` maps each action's scope to the client session id for
        the record; ``chains`` a session scope to the block hashes of its last prompt, so
        that its holdings count the blocks it shares with others once
        (:func:`target_keys`)."""
        if not planned:
            return []
        return await self._sender.send(planned, session_ids, source, chains or {})

    @property
    def status_counts(self) -> dict[str, int]:
        """Actions per status they ended in, all tenants (the dashboard's timeline
        differences it)."""
        totals: dict[str, int] = {}
        for of_tenant in self._status_counts.values():
            for status, count in of_tenant.items():
                totals[status] = totals.get(status, 0) + count
        return totals

    def status_counts_of(self, tenant: str | None) -> dict[str, int]:
        """Actions per status they ended in: ``tenant``'s, or all tenants' for None."""
        return self.status_counts if tenant is None else dict(self._status_counts.get(tenant, {}))

    def new_id(self) -> str:
        return f"{self._rng.getrandbits(64):016x}"

    def api_rate_wait_s(self, tenant: str, actions: int, budget: TenantBudget,
                        now: float) -> float | None:
        """:meth:`ApiBudgetGate.rate_wait_s`."""
        return self._api_gate.rate_wait_s(tenant, actions, budget, now)

    def api_rate_refund(self, tenant: str, at: float, actions: int) -> None:
        """:meth:`ApiBudgetGate.refund`."""
        self._api_gate.refund(tenant, at, actions)

    def api_budget_problem(self, tenant: str, budget: TenantBudget, worker_id: str,
                           planned: Sequence[PlannedAction], now: float,
                           chain: Sequence[int] = (), worker_share: float = 1.0) -> str | None:
        """:meth:`ApiBudgetGate.problem`."""
        return self._api_gate.problem(tenant, budget, worker_id, planned, now, chain,
                                      worker_share)

    # --- outcomes -----------------------------------------------------------------------

    def effective(self, outcome: HintOutcome) -> HintOutcome:
        """``outcome`` as it stands now: where the worker has since reported releasing
        blocks of the action (that report came first), ``applied`` is capped at what it
        still holds. Pass what this returns to :meth:`on_outcome` and on."""
        record = self.pending.get(outcome.action_id)
        cap = record.held_after_release_blocks if record is not None else None
        if record is not None and record.answered_by_reset_engine(outcome.at):
            cap = None  # the reset's 0 was the old engine's (:meth:`reset_worker`)
        applied = outcome.applied
        if cap is None or not outcome.status.is_terminal or applied.blocks <= cap:
            return outcome
        tokens = applied.tokens * cap // applied.blocks
        return msgspec.structs.replace(outcome, applied=Amount(blocks=cap, tokens=tokens))

    def on_release(self, release: HoldRelease) -> None:
        """A worker let blocks of an accepted Pin/Retain go unasked: its holding shrinks
        (for a still pending action, its coming outcome is capped; :meth:`effective`), and
        its stored row says why and what is left. Counted in the metrics only by the
        router that sent the action (or restored it): every replica hears every release,
        and a fleet's total must count each once.

        Only a release of a hint action's type (:data:`HINT_RELEASE_TYPES`) is looked up
        by its id: a donor advice's (``kv.donor``, keyed apart on the worker, its id
        possibly a hint action's) changes no hint action and is counted
        (``foreign_hint_messages{kind="donor_release"}``: the router keeps no record of
        advice); one of any other type is dropped, counted
        (``release_unknown_type``)."""
        if release.action_type not in HINT_RELEASE_TYPES:
            if release.action_type == DONOR_ACTION_TYPE:
                self._metrics.foreign_messages.labels("donor_release").inc()
            else:
                self._metrics.drop("release_unknown_type")
            return
        now = self._clock()
        pending = self.pending.get(release.action_id)
        record = pending or self._recent_by_id.get(release.action_id)
        if record is not None or release.action_id in self.holdings:
            # The label's value is the router's own record's, or a hint type (above).
            action = record.action_type if record is not None else release.action_type
            self._metrics.hold_releases.labels(action, release.reason.value).inc(
                release.released.blocks)
        else:
            self._metrics.foreign_messages.labels("release").inc()
        held = release.held.blocks
        if record is not None:
            if record.held_after_release_blocks is not None:
                held = min(held, record.held_after_release_blocks)  # reports never grow it
            record.release_reason, record.released_at = release.reason.value, now
            record.held_after_release_blocks = held
        if self._writer is not None:  # the action's row (a no-op for one never stored)
            self._writer.update("hint_actions", (release.action_id,), {
                "action_id": release.action_id, "release_reason": release.reason.value,
                "released_at": now, "held_after_release_blocks": held})
        if pending is None:
            self.holdings.released(release.action_id, held)

    def on_outcome(self, outcome: HintOutcome) -> SentAction | None:
        """A worker's answer to a hint action, looked up by its id; a donor advice's
        (``kv.donor``: the plugin keys advice apart, its id possibly a hint action's)
        settles no hint action and updates no row, counted
        (``foreign_hint_messages{kind="donor_outcome"}``), as its releases are
        (:meth:`on_release`). Before, it settled a pending hint action of the same id
        with the advice's status and amounts (the holdings ledger counted the advice's
        resident blocks as that action's) or overwrote another replica's row."""
        if outcome.action_type == DONOR_ACTION_TYPE:
            self._metrics.foreign_messages.labels("donor_outcome").inc()
            return None
        record = self.pending.get(outcome.action_id)
        if record is None:
            # Another replica's action (replicas share the outcome stream and its cursor),
            # normal traffic in a fleet of routers, not a drop: its row gets the answer, so
            # that replica, restarted from the shared cursor after this message, does not
            # wait for it. A no-op for a row never stored.
            self._metrics.foreign_messages.labels("outcome").inc()
            if self._writer is not None:
                self._writer.update("hint_actions", (outcome.action_id,), {
                    "action_id": outcome.action_id, **outcome_columns(outcome),
                    "updated_at": self._clock()})
            return None
        if record.terminal:
            self._metrics.drop("outcome_duplicate")
            return record
        if record.answered_by_reset_engine(outcome.at):
            self._answered_by_new_engine(record)
        record.answered_at = outcome.at
        for column, value in outcome_columns(outcome).items():
            setattr(record, column, value)
        record.updated_at = self._clock()
        retain_max = self._retain_max_s(record.worker_id)
        if (outcome.status.is_terminal and record.expires_at is not None
                and record.action_type == ActionType.PREFETCH.value):
            # Its retain ends by its deadline and at most max_retain_ttl_s past this answer
            # (the ledger's holding likewise): the row says so for a restart's restore.
            record.expires_at = prefetch_held_until(record.expires_at, record.updated_at,
                                                    retain_max)
        self._save(record)
        if not outcome.status.is_terminal:
            # A Prefetch whose wait its worker clipped reserves no more than it waits for
            # (HoldingsLedger.settle; outcome 1.1 ``waits_for``).
            self.holdings.settle(outcome)
            return record
        self._metrics.hints.labels(record.action_type, record.status, record.source).inc()
        self.holdings.settle(outcome, record.updated_at, retain_max)
        if record.source == PLANNER_SOURCE:  # an agent's actions never steer the planner
            self._learning.learn_outcome(record.worker_id, record.tenant, outcome)
        self._finish(record)
        return record

    def _answered_by_new_engine(self, record: SentAction) -> None:
        """``record``, let go by its worker's new epoch while it waited, is answered by
        that engine (:meth:`reset_worker`): its reset marks and cut wait go (its row,
        saved next, too) and its holding comes back at what it asked for, for its answer
        to settle, unless another action holds its scope on the worker now (sent later,
        it superseded this one there too); its blocks named as a restored one's
        (:meth:`_hold`)."""
        record.reset_by_engine_at = None
        if record.release_reason == ReleaseReason.RESET.value:
            record.release_reason = record.released_at = None
            record.held_after_release_blocks = None
        record.due_at = None
        if (record.action_type == ActionType.PREFETCH.value or record.scope is None
                or not self.holdings.holds(record.worker_id, record.scope)):
            self._hold(record, record.requested_blocks)

    def expire(self, now: float | None = None) -> int:
        """Holdings past their TTL are forgotten; actions without a terminal outcome past
        their due time (:meth:`SentAction.outcome_due`: ``OUTCOME_DEADLINE_S`` past when
        the worker must answer, a Prefetch's deadline included) are marked expired.
        Returns how many actions expired."""
        now = self._clock() if now is None else now
        self.holdings.expire(now)
        late = [a for a in self.pending.values() if now > a.outcome_due()]
        for record in late:
            self._expire(record, now, record.overdue_reason())
        return len(late)

    def _expire(self, record: SentAction, now: float, reason: str, save: bool = True) -> None:
        record.status = EXPIRED
        record.reason = reason
        record.updated_at = now
        self._metrics.hints.labels(record.action_type, EXPIRED, record.source).inc()
        if save:
            self._save(record)
        self._finish(record)

    def _finish(self, record: SentAction) -> None:
        of_tenant = self._status_counts.setdefault(record.tenant, {})
        of_tenant[record.status] = of_tenant.get(record.status, 0) + 1
        self.pending.pop(record.action_id, None)
        if len(self.recent) == self.recent.maxlen:
            self._recent_by_id.pop(self.recent[0].action_id, None)
        self.recent.append(record)
        self._recent_by_id[record.action_id] = record
        if record.waiter is not None and not record.waiter.done():
            record.waiter.set_result(record)

    async def wait_terminal(self, records: Sequence[SentAction], timeout_s: float) -> None:
        loop = asyncio.get_running_loop()
        waiters = []
        for record in records:
            if record.terminal:
                continue
            record.waiter = loop.create_future()
            waiters.append(record.waiter)
        if waiters and timeout_s > 0:
            await asyncio.wait(waiters, timeout=timeout_s)

    # --- persistence --------------------------------------------------------------------

    def _save(self, record: SentAction) -> None:
        if self._writer is not None:
            self._writer.upsert("hint_actions", (record.action_id,), record.row())

    def save_learned(self, now: float) -> None:
        """Queue the ``learned_stats`` rows changed since saved (:meth:`LearnedState.save`)."""
        self._learning.save(now)

    def restore(self, learned: list[dict[str, Any]], pending: list[dict[str, Any]],
                held: Sequence[dict[str, Any]] = ()) -> None:
        """State from the store after a restart: learned statistics and feedback
        (:meth:`LearnedState.restore`), actions still waiting for an outcome, and the
        Pins/Retains/Prefetches workers still hold (``held``: answered, TTL not over,
        oldest first; a Prefetch's retain until its deadline, each its own holding as
        before the restart), so budgets count them again (before, answered Prefetches
        were not read back). A pending Pin/Retain/Prefetch is held at what it asked for
        until its outcome settles it. The actions of a worker the registry (filled before
        this is called) does not hold are not restored (before, its holds counted against
        their tenant's budget until their TTL); their rows go with the worker's own row
        (by the foreign key). Each is counted (``hint_not_restored:worker_gone``), and so
        is a held one whose holding cannot be rebuilt (``hint_not_restored:unscoped``:
        a row that does not say what it protects)."""
        self._learning.restore(learned)
        gone = sum(row["worker_id"] not in self._workers for row in (*held, *pending))
        if gone:
            self._metrics.drop("hint_not_restored:worker_gone", gone)
        held = [row for row in held if row["worker_id"] in self._workers]
        pending = [row for row in pending if row["worker_id"] in self._workers]
        for row in held:
            record = SentAction.from_row(row)
            blocks = record.still_held()
            if blocks > 0 and not self._hold(record, blocks):
                self._metrics.drop("hint_not_restored:unscoped")
        now = self._clock()
        for row in pending:
            record = SentAction.from_row(row)
            record.restored_waiting(now)
            self.pending[record.action_id] = record
            self._hold(record, record.still_held())

    def _hold(self, record: SentAction, blocks: int) -> bool:
        """Count a stored action's holding again; False when it cannot be (nothing held,
        or a row without its scope or end). Only a target's own ``block_hashes`` are
        known here (session prompts are not stored): a session's blocks count as its
        own until its next protection replaces the holding (a session's Prefetches on
        one worker count theirs once: :meth:`HoldingsLedger.record`)."""
        if blocks > 0 and record.scope is not None and record.expires_at is not None:
            keys = target_keys(record.action_type, record.payload, 1)
            self.holdings.record(action_id=record.action_id, worker_id=record.worker_id,
                                 tenant=record.tenant, scope=record.scope,
                                 action_type=record.action_type, blocks=blocks,
                                 expires_at=record.expires_at, keys=keys,
                                 api=record.source == API_SOURCE)
            return True
        return False

    def _retain_max_s(self, worker_id: str) -> float | None:
        """The worker's ``max_retain_ttl_s`` as its heartbeat says (None: not heard)."""
        worker = self._workers.get(worker_id)
        if worker is None or worker.status is None:
            return None
        return worker.status.budgets.max_retain_ttl_s

    def _block_size(self, worker_id: str) -> int:
        worker = self._workers.get(worker_id)
        return worker.status.block_size if worker is not None and worker.status else 1
