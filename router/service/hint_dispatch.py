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
API's budget check, :mod:`.hint_api_budget`. What a worker's new engine, a worker gone
and a router restart do to the holdings and the actions still waiting (engine resets,
forgotten and pruned workers, the restore from the store) is :mod:`.hint_resets`, a part
of :class:`HintDispatcher`.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import deque
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import replace

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
)
from kvhint.router.policy.holdings import prefetch_held_until
from kvhint.router.service.agent_releases import released_claim
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
from kvhint.router.service.hint_resets import HintResets
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
    Subjects,
    evict_rest_supported,
)

__all__ = ["API_SOURCE", "EXPIRED", "FAILED", "OUTCOME_DEADLINE_S", "PENDING",
           "PLANNER_SOURCE", "HintDispatcher", "SentAction"]

_RECENT_KEPT = 2000


class HintDispatcher(HintResets):
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
        # The worker's clock of the answer of each holding restored from the store
        # (HintResets.restore; pruned as their holdings go).
        self._restored_answers: dict[str, float] = {}
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

    def context(self, now: float | None = None, tenant: str | None = None,
                chain: Sequence[int] = ()) -> PlannerContext:
        """The planner's frozen view; with ``tenant``, that tenant's budget and outcome
        feedback apply (no other tenant's outcomes turn its hints off or shrink them).
        ``chain``: the block hashes of the last prompt of the session planned (its
        record's ``last_block_hashes``, which :meth:`send` records its Pin/Retain by), so
        its protection is charged the blocks it adds to the ledger's counts
        (``PlannerContext.holding_change``)."""
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
                # Status 1.3: pins planned in pool blocks on a hybrid model.
                claim_cost=status.claim_cost or None,
                pinned_claims=self.holdings.claims(worker.worker_id)[0],
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
                              rng=self._rng, config=config, tenant_held=tenant_held,
                              tenant_retain_added=self.holdings.tenant_retain_added,
                              chain=tuple(chain), holding_change=self.holdings.replacing)

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

    def api_rate_problem(self, tenant: str, actions: int, budget: TenantBudget,
                         now: float) -> str | None:
        """:meth:`ApiBudgetGate.rate_problem`."""
        return self._api_gate.rate_problem(tenant, actions, budget, now)

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
        (``release_unknown_type``).

        Counted (``hold_releases``) is what the release takes from what the router last
        knew the action held (:meth:`_release_removes`), at most the blocks it says it
        released: a release heard again (JetStream replaying the stream from a cursor
        behind what this router applied: a restart after another replica's older cursor
        write, an overlap of plain and JetStream delivery) removes nothing and counts
        nothing; each later release of the action counts its own blocks. Before, each
        hearing counted its blocks again, while the holding itself shrank only once. A
        release of an action this router does not know (another replica's) counts
        ``foreign_hint_messages{kind="release"}`` per message heard, as before."""
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
                self._release_removes(release, record))
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

    def _release_removes(self, release: HoldRelease, record: SentAction | None) -> int:
        """The blocks ``release`` takes from what the action held as this router last
        knew it: its record's count after its latest release (stored, so a restart
        knows it too), else its live holding's (an action restored from the store, or
        past the recent records), else, for its first release, all it says it released.
        Releases of one action reach the router in the order its worker sent them (one
        subject, one ordered consumer), each holding less than the one before."""
        before = None if record is None else record.held_after_release_blocks
        if before is None and record is None:
            before = self.holdings.blocks_of(release.action_id)
        released = release.released.blocks
        if before is None:
            return released
        return min(released, max(before - release.held.blocks, 0))

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
            if (claim := released_claim(outcome)) is not None:
                # Another replica's end released this replica's claim (agent_releases.py).
                self.holdings.released(claim, 0)
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

    def _retain_max_s(self, worker_id: str) -> float | None:
        """The worker's ``max_retain_ttl_s`` as its heartbeat says (None: not heard)."""
        worker = self._workers.get(worker_id)
        if worker is None or worker.status is None:
            return None
        return worker.status.budgets.max_retain_ttl_s

    def _block_size(self, worker_id: str) -> int:
        worker = self._workers.get(worker_id)
        return worker.status.block_size if worker is not None and worker.status else 1
