"""What the hint dispatcher does when workers' engines, or the router, start afresh.

:class:`HintResets` is a part of :class:`~kvhint.router.service.hint_dispatch.HintDispatcher`
(a mixin, split from it along this seam: the dispatcher sends hints and folds their
outcomes back; this keeps its holdings ledger and actions waiting for an outcome true to
what the workers hold when that continuity breaks). Each way it breaks:

- a worker's new engine epoch (:meth:`HintResets.reset_worker`): the old engine's holds
  let go, counted, their rows marked released by a ``reset``; an action the new engine
  answers after all comes back (:meth:`HintResets._answered_by_new_engine`, called by the
  dispatcher's ``on_outcome``);
- a worker the registry forgot, or whose rows store retention pruned
  (:meth:`HintResets.forget_worker`, :meth:`HintResets.workers_pruned`): its holds and
  waiting actions go, counted;
- a router restart (:meth:`HintResets.restore`): learned statistics, waiting actions and
  the holds still standing read back from the store, those of a worker gone counted.

Contract with the dispatcher: it owns the fields annotated below
(``HintDispatcher.__init__`` sets them) and ends an action as expired
(``HintDispatcher._expire``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from kvhint.router.policy import HoldingsLedger, target_keys
from kvhint.router.service.hint_learned import LearnedState
from kvhint.router.service.hint_records import API_SOURCE, SentAction
from kvhint.router.service.metrics import RouterMetrics
from kvhint.router.service.workers import WorkerRegistry
from kvhint.router.store.writer import StoreWriter
from kvhint.schemas import ActionType, ReleaseReason
from kvhint.schemas.status import epoch_started_ms


class HintResets:
    """The engine-restart, forgotten-worker and restore side of a
    :class:`~kvhint.router.service.hint_dispatch.HintDispatcher`."""

    # Set by HintDispatcher.__init__ (declared here for the methods below; no class values).
    _workers: WorkerRegistry
    _writer: StoreWriter | None
    _metrics: RouterMetrics
    _clock: Callable[[], float]
    _learning: LearnedState
    holdings: HoldingsLedger
    pending: dict[str, SentAction]
    _recent_by_id: dict[str, SentAction]
    _restored_answers: dict[str, float]

    def _expire(self, record: SentAction, now: float, reason: str, save: bool = True) -> None:
        raise NotImplementedError  # the dispatcher's: the action ends expired, counted

    # --- workers' engines come and go ---------------------------------------------------

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
        reset forgot both though the new engine held them. Both survive a router restart:
        the answer's ``at`` and the epoch's start are stored (``answered_at``,
        ``reset_by_engine_at``; before, not: a restored router let go of what the new
        engine had answered, and capped its later answer at the reset's 0). An epoch
        without order (an older plugin's) tells nothing: all are let go, as before."""
        self._learning.reset_worker(worker_id)
        now = self._clock()
        started_ms = epoch_started_ms(epoch) if epoch is not None else None
        started = None if started_ms is None else started_ms / 1000

        def new_engines(action_id: str) -> bool:
            record = self.pending.get(action_id) or self._recent_by_id.get(action_id)
            at = (record.answered_at if record is not None
                  else self._restored_answers.get(action_id))
            return started is not None and at is not None and at >= started

        waiting = [r for r in self.pending.values()
                   if r.worker_id == worker_id and not new_engines(r.action_id)]
        kept = {a for a in self.holdings.held_on(worker_id) if new_engines(a)}
        let_go = dict.fromkeys([*(a for a in self.holdings.held_on(worker_id)
                                  if a not in kept),
                                *(r.action_id for r in waiting)])
        dropped = self.holdings.forget_worker(worker_id, keep=kept)
        if dropped:
            self._metrics.drop("hint_dropped:worker_restarted", dropped)
        for record in waiting:
            record.cut_wait(now)
            record.reset_by_engine_at = started
        for action_id in let_go:
            self._engine_restarted(action_id, now)
        self._prune_restored_answers()

    def _engine_restarted(self, action_id: str, now: float) -> None:
        """The action's holds went with its worker's old engine: its record and row say
        so as a ``reset`` release would (a late answer is capped: :meth:`effective`)."""
        record = self.pending.get(action_id) or self._recent_by_id.get(action_id)
        columns: dict[str, Any] = {"action_id": action_id,
                                   "release_reason": ReleaseReason.RESET.value,
                                   "released_at": now, "held_after_release_blocks": 0}
        if record is not None:
            record.release_reason, record.released_at = ReleaseReason.RESET.value, now
            record.held_after_release_blocks = 0
            # Which engine's answer brings it back, for a restart's restore too (before,
            # not stored: restored, that engine's answer was capped at this reset's 0).
            columns["reset_by_engine_at"] = record.reset_by_engine_at
        if self._writer is not None:  # the action's row (a no-op for one never stored)
            self._writer.update("hint_actions", (action_id,), columns)

    def _prune_restored_answers(self) -> None:
        """Forget the answer times of restored holdings that are over."""
        for action_id in [a for a in self._restored_answers if a not in self.holdings]:
            del self._restored_answers[action_id]

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
        self._prune_restored_answers()
        return dropped

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

    # --- restore at start -----------------------------------------------------------

    def restore(self, learned: list[dict[str, Any]], pending: list[dict[str, Any]],
                held: Sequence[dict[str, Any]] = ()) -> None:
        """State from the store after a restart: learned statistics and feedback
        (:meth:`LearnedState.restore`), actions still waiting for an outcome, and the
        Pins/Retains/Prefetches workers still hold (``held``: answered, TTL not over,
        oldest first; a Prefetch's retain until its deadline, each its own holding as
        before the restart), so budgets count them again (before, answered Prefetches
        were not read back). A pending Pin/Retain/Prefetch is held at what it asked for
        until its outcome settles it (a Prefetch whose wait its worker clipped, at what it
        waits for: ``waits_for_blocks``; before, at all it asked for). The actions of a
        worker the registry (filled before this is called) does not hold are not restored
        (before, its holds counted against their tenant's budget until their TTL); their
        rows go with the worker's own row (by the foreign key). Each is counted
        (``hint_not_restored:worker_gone``), and so is a held one whose holding cannot be
        rebuilt (``hint_not_restored:unscoped``: a row that does not say what it
        protects)."""
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
            elif blocks > 0 and record.answered_at is not None:
                # Which engine answered it: a worker's new epoch heard after the restart
                # keeps it if that engine did (:meth:`reset_worker`; before, not stored,
                # the restored router let go of holds the new engine had).
                self._restored_answers[record.action_id] = record.answered_at
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
