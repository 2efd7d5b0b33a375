"""What the hint planner learnt, and its rows in the store's ``learned_stats`` table.

Two kinds of learning (:mod:`kvhint.router.policy`): each tenant's statistics
(:class:`TenantStats`; a tenant's planning reads, and its observations update, only its
own) and each worker's outcome feedback (:class:`SplitFeedback`, from the outcomes of the
planner's actions: what the worker cannot do, shared by every tenant, and each tenant's
own, which no other tenant's outcomes move). :class:`LearnedState` holds both for
:class:`HintDispatcher`, knows what changed since it last saved, and reads them back after
a restart.

Invariants:

- only the tenants the router serves learn (``tenants``); any other plans from the
  priors, its observations, its outcomes' feedback (but for what the worker cannot do)
  and its stored row dropped and counted (``learned_stats_unknown_tenant``);
- a worker's feedback is replaced, never mutated, so "changed since saved" is identity
  against what was saved;
- a worker the registry does not hold has no feedback row in the store: forgetting the
  worker, or restoring without it, deletes the row (and retention, pruning the worker's
  row, deletes it in the same transaction: store.retention).

Rows (tenant, kind). A tenant's statistics: (tenant, TENANT_STATS_KIND). Routers from
before statistics were per tenant kept one pooled row, (POOLED_TENANT, POOLED_KIND), and
read every row of that kind as it: a kind of its own keeps them from taking a tenant's
row for everyone while old and new routers share the store (a rolling upgrade, a
rollback). That the pooled row was dealt with is a row of its own too, (POOLED_TENANT,
ADOPTED_KIND), which no older router writes over. No tenant is named "*" (TenantConfig's
names are letters, digits, "_", "." and "-"). Per-worker feedback: (FEEDBACK_TENANT,
"feedback:<worker>"), the key the store's models define (retention deletes by it), one row
with the worker's part and every tenant's (:meth:`SplitFeedback.to_dict`).
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Container, Iterable
from dataclasses import replace
from typing import Any

from kvhint.router.policy import (
    FeedbackConfig,
    LearnedStats,
    Observation,
    SplitFeedback,
    TenantStats,
    feedback_from_stored,
)
from kvhint.router.policy.tenant_feedback import TENANTS_KEY
from kvhint.router.service.metrics import RouterMetrics
from kvhint.router.store.models import FEEDBACK_KIND_PREFIX, FEEDBACK_TENANT
from kvhint.router.store.writer import StoreWriter
from kvhint.schemas import HintOutcome, OutcomeStatus
from kvhint.schemas.outcomes import is_capability_rejection

log = logging.getLogger(__name__)

TENANT_STATS_KIND = "tenant_gaps"
POOLED_KIND = "tool_gaps"
ADOPTED_KIND = "tool_gaps_adopted"
POOLED_TENANT = "*"


class LearnedState:
    """The planner's learned statistics and per-worker feedback (module doc).

    Args:
        writer: where rows are queued (None: nothing is saved).
        metrics: counts what is dropped.
        workers: the worker ids the registry holds now (read at :meth:`restore`).
        tenants: the tenants the router serves.
    """

    def __init__(self, writer: StoreWriter | None, metrics: RouterMetrics,
                 workers: Container[str], tenants: Collection[str]) -> None:
        self._writer = writer
        self._metrics = metrics
        self._workers = workers
        self._tenants = tuple(tenants)
        self.stats = TenantStats(frozenset(self._tenants))
        self.feedback: dict[str, SplitFeedback] = {}
        self._feedback_config = FeedbackConfig()
        self._stats_dirty: set[str] = set()  # tenants whose statistics are not saved yet
        self._pooled_adopted = False  # restore() found a pooled row not yet marked
        self._feedback_saved: dict[str, SplitFeedback] = {}  # what save() last wrote

    def observe(self, observations: Iterable[Observation], tenant: str | None) -> None:
        """Fold the planner's observations of a session of ``tenant`` into that tenant's
        statistics only."""
        for observation in observations:
            if tenant is not None and self.stats.apply(tenant, observation):
                self._stats_dirty.add(tenant)
            else:
                self._metrics.drop("learned_stats_unknown_tenant")

    def learn_outcome(self, worker_id: str, tenant: str | None, outcome: HintOutcome) -> None:
        """A planner's action of ``tenant`` to ``worker_id`` ended in ``outcome``: what the
        worker cannot do is learnt for every tenant, the rest for ``tenant`` only (for a
        tenant the router does not serve, dropped and counted)."""
        feedback = self.feedback.get(worker_id) or SplitFeedback(worker_id)
        if tenant not in self._tenants:
            tenant = None
            if not (outcome.status is OutcomeStatus.REJECTED
                    and is_capability_rejection(outcome.reason)):
                self._metrics.drop("learned_stats_unknown_tenant")
        self.feedback[worker_id] = feedback.learn(tenant, outcome, self._feedback_config)

    def reset_worker(self, worker_id: str) -> None:
        """A new engine epoch: what the old engine taught is forgotten."""
        self.feedback[worker_id] = SplitFeedback(worker_id)

    def forget_worker(self, worker_id: str) -> None:
        """The registry forgot the worker: its feedback goes, from memory and the store."""
        self.feedback.pop(worker_id, None)
        self._feedback_saved.pop(worker_id, None)
        self._delete_feedback_row(worker_id)

    def worker_pruned(self, worker_id: str) -> None:
        """Retention deleted the worker's row and its feedback row (store.retention): its
        feedback goes from memory too. Before, it stayed, and its next change was
        written back as a row of a worker the store no longer held. Nothing is queued:
        the row went in the prune's transaction."""
        self.feedback.pop(worker_id, None)
        self._feedback_saved.pop(worker_id, None)

    def save(self, now: float) -> None:
        """Queue a row per tenant whose statistics changed since saved ((tenant,
        ``tenant_gaps``)), and per worker whose feedback did. After :meth:`restore` found
        a pooled row not marked yet, the row marking it ((``*``, ``tool_gaps_adopted``))
        goes too."""
        if self._writer is None:
            return
        for tenant in sorted(self._stats_dirty):
            self._writer.upsert("learned_stats", (tenant, TENANT_STATS_KIND), {
                "tenant": tenant, "kind": TENANT_STATS_KIND,
                "data": self.stats.of(tenant).to_dict(), "updated_at": now})
        self._stats_dirty.clear()
        if self._pooled_adopted:
            self._writer.upsert("learned_stats", (POOLED_TENANT, ADOPTED_KIND), {
                "tenant": POOLED_TENANT, "kind": ADOPTED_KIND, "data": {"adopted_at": now},
                "updated_at": now})
            self._pooled_adopted = False
        for worker_id, feedback in self.feedback.items():
            if self._feedback_saved.get(worker_id) is feedback:
                continue  # unchanged since saved (feedback is replaced, never mutated)
            self._writer.upsert("learned_stats", (FEEDBACK_TENANT, _feedback_kind(worker_id)), {
                "tenant": FEEDBACK_TENANT, "kind": _feedback_kind(worker_id),
                "data": feedback.to_dict(), "updated_at": now})
            self._feedback_saved[worker_id] = feedback

    def restore(self, learned: list[dict[str, Any]]) -> None:
        """The ``learned_stats`` rows read back after a restart.

        Each tenant's row ((tenant, ``tenant_gaps``)) is its own; the row of a tenant no
        longer served is left in the store, unused (counted,
        ``learned_stats_unknown_tenant``). Upgrade from a router that kept one pooled row
        for all tenants ((``*``, ``tool_gaps``)): no tenant starts from it. It is every
        tenant's traffic together, kept by tool name (other tenants' tool names, verbatim,
        and their gaps per tool, which a tenant admin's learnt figures list and its
        sessions' TTLs follow), so a copy would hand each tenant the others' history, and
        an aggregate of it gives it away as well in a fleet of few tenants (the aggregate
        less one's own is the others'); nothing in the store says which tenants fed it.
        Every tenant without a row of its own plans from the priors, as a fresh router
        does; the pooled row is counted once (``learned_stats_pooled_unused``) and
        :meth:`save` writes the row (``*``, ``tool_gaps_adopted``) marking it dealt with,
        after which it is never looked at again (nor taken by a router of the version that
        seeded from it), whatever an older router sharing the store still writes into it.

        Feedback: a worker's row is read back if the registry (filled before this is
        called) holds the worker; the row of one it does not (dropped from the config, or
        silent too long to be restored) is deleted, as :meth:`forget_worker` does. A row
        from before feedback was split by tenant keeps only what the worker cannot do
        (:func:`feedback_from_stored`; what it leaves out is counted,
        ``feedback_pooled_unused``) and is written again in the new form."""
        pooled = False
        adopted = any(row.get("kind") == ADOPTED_KIND and row.get("tenant") == POOLED_TENANT
                      for row in learned)
        for row in learned:
            try:
                if row["kind"] == POOLED_KIND and row["tenant"] == POOLED_TENANT:
                    pooled = not adopted
                elif row["kind"] == TENANT_STATS_KIND:
                    if not self.stats.put(row["tenant"], LearnedStats.from_dict(row["data"])):
                        self._metrics.drop("learned_stats_unknown_tenant")
                elif row["kind"].startswith(FEEDBACK_KIND_PREFIX):
                    worker_id = row["kind"][len(FEEDBACK_KIND_PREFIX):]
                    if worker_id not in self._workers:
                        self._delete_feedback_row(worker_id)
                        continue
                    self._restore_feedback(row["data"])
            # AttributeError: data of another shape (a string, a list: a hand edit, or
            # on SQLite text that is not JSON, store.database._stored_json), which
            # failed the router's start before.
            except (AttributeError, KeyError, TypeError, ValueError) as exc:
                log.warning("ignoring stored %s: %s", row.get("kind"), exc)
                self._metrics.drop("learned_stats_unreadable")
        if pooled:
            self._metrics.drop("learned_stats_pooled_unused")
            self._pooled_adopted = True

    def _restore_feedback(self, data: dict[str, Any]) -> None:
        """One worker's stored feedback, less the parts of tenants no longer served
        (counted, ``learned_stats_unknown_tenant``); a row of another form than this
        router writes (from before the split, or with such parts) is written again."""
        feedback, left_out = feedback_from_stored(data)
        if left_out:
            self._metrics.drop("feedback_pooled_unused")
        served = {t: f for t, f in feedback.tenants.items() if t in self._tenants}
        if len(served) < len(feedback.tenants):
            self._metrics.drop("learned_stats_unknown_tenant",
                               len(feedback.tenants) - len(served))
            feedback = replace(feedback, tenants=served)
        elif TENANTS_KEY in data:
            self._feedback_saved[feedback.worker_id] = feedback
        self.feedback[feedback.worker_id] = feedback

    def _delete_feedback_row(self, worker_id: str) -> None:
        if self._writer is not None:
            self._writer.delete("learned_stats", (FEEDBACK_TENANT, _feedback_kind(worker_id)))


def _feedback_kind(worker_id: str) -> str:
    """The ``kind`` of ``worker_id``'s feedback row (tenant ``FEEDBACK_TENANT``)."""
    return f"{FEEDBACK_KIND_PREFIX}{worker_id}"
