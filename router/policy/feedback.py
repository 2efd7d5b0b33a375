"""Outcome feedback: what the workers' answers teach the planner, per worker.

Plain, frozen data: :func:`apply_outcome` returns a new :class:`WorkerFeedback`. The
caller keeps one per worker, persists it if it likes (:meth:`WorkerFeedback.to_dict`),
and starts a fresh one when the worker's epoch changes (a restarted engine may support
more). Rules:

- a ``clipped`` Pin lowers ``pin_ask_scale`` to the applied fraction (floored at
  ``min_pin_scale``): the planner then counts only that share of the pin room its ledger
  shows left on the worker (a session whose chain does not fit is retained at top
  priority, not pinned in part); each ``accepted`` Pin raises it back by
  ``pin_recovery``. On a hybrid model a Pin clipped at the hit point its other KV cache
  groups allow (:func:`~kvhint.schemas.outcomes.clipped_hit_reach`: it applies no
  position past it) counts the fraction of that hit point (positions held; with EAGLE
  vLLM's hit is one block shorter, never used here as a hit length), so a clip for residency
  alone leaves the scale as it is (the budget took all it could hold); before the
  worker applied only the hit point, it applied every position and this was 1 too;
- ``reject_disable_after`` consecutive ``rejected`` outcomes of one action type disable
  that type for this worker (a worker without a host tier answers Demote ``rejected``:
  the planner stops sending it); any ``accepted``/``clipped`` of that type resets the count.
  ``missing`` (the blocks were already gone), ``deferred``, and a rejection that says
  nothing of what the worker supports (expired in transit, a full inbox:
  :func:`~kvhint.schemas.outcomes.is_transient_rejection`) change nothing: a burst that
  filled a worker's inbox used to disable Pin and Retain there until its engine restarted.

Feed it only the planner's own actions: an agent's actions say what the agent asked, and
one tenant's agent must not turn the planner off on a worker for every tenant. Nor may
one tenant's planner actions: the router and the simulator keep one per worker for what
the worker cannot do and one per tenant for the rest (:mod:`.tenant_feedback`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from kvhint.schemas.hints import ActionType
from kvhint.schemas.outcomes import (
    HintOutcome,
    OutcomeStatus,
    clipped_hit_reach,
    is_transient_rejection,
)


@dataclass(frozen=True, slots=True)
class FeedbackConfig:
    min_pin_scale: float = 0.125
    pin_recovery: float = 1.25
    reject_disable_after: int = 2


@dataclass(frozen=True, slots=True)
class WorkerFeedback:
    worker_id: str
    pin_ask_scale: float = 1.0
    disabled_actions: frozenset[str] = frozenset()
    # action type -> the rejection reason that disabled it (for operators)
    disabled_reasons: dict[str, str] = field(default_factory=dict)
    # action type -> consecutive rejections so far
    rejections_in_row: dict[str, int] = field(default_factory=dict)

    def allows(self, action_type: ActionType | str) -> bool:
        value = action_type.value if isinstance(action_type, ActionType) else action_type
        return value not in self.disabled_actions

    def to_dict(self) -> dict[str, object]:
        return {
            "worker_id": self.worker_id,
            "pin_ask_scale": self.pin_ask_scale,
            "disabled_actions": sorted(self.disabled_actions),
            "disabled_reasons": dict(self.disabled_reasons),
            "rejections_in_row": dict(self.rejections_in_row),
        }

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> WorkerFeedback:
        """Inverse of :meth:`to_dict`; raises ValueError on values :func:`apply_outcome`
        never makes: a pin ask scale outside [0, 1] (NaN and infinities: PostgreSQL gives
        back ``"NaN"``, a ``1e999``, SQLite a bare NaN), a rejection count that is not a
        whole number >= 0, action types or reasons that are not strings. Before, such a
        row (a hand edit, a restore from elsewhere) was taken: a NaN or negative scale
        stopped every Pin on the worker for good (no Pin sent, none accepted to raise it
        back), one over 1 planned Pins past the room left, and a count of another type
        failed every later outcome of its action type."""
        scale = float(data.get("pin_ask_scale", 1.0))  # type: ignore[arg-type]
        if not 0.0 <= scale <= 1.0:  # NaN fails it too
            raise ValueError(f"feedback: pin_ask_scale {scale!r} is not in [0, 1]")
        actions = data.get("disabled_actions", ())
        reasons = data.get("disabled_reasons", {})
        counts = data.get("rejections_in_row", {})
        if not (isinstance(actions, (list, tuple)) and isinstance(reasons, dict)
                and isinstance(counts, dict)):
            raise ValueError("feedback: disabled_actions must be a list, disabled_reasons "
                             "and rejections_in_row objects")
        if not all(isinstance(a, str) for a in (*actions, *reasons, *reasons.values(),
                                                  *counts)):
            raise ValueError("feedback: action types and reasons must be strings")
        if not all(type(n) is int and n >= 0 for n in counts.values()):
            raise ValueError("feedback: a rejection count is not a whole number >= 0")
        return cls(worker_id=str(data["worker_id"]), pin_ask_scale=scale,
                   disabled_actions=frozenset(actions), disabled_reasons=dict(reasons),
                   rejections_in_row=dict(counts))


def apply_outcome(
    feedback: WorkerFeedback, outcome: HintOutcome, config: FeedbackConfig = FeedbackConfig()
) -> WorkerFeedback:
    """Fold one terminal outcome from ``feedback.worker_id`` into a new feedback value."""
    kind = outcome.action_type
    status = outcome.status
    if not kind or status in (OutcomeStatus.DEFERRED, OutcomeStatus.MISSING):
        return feedback
    if status is OutcomeStatus.REJECTED and is_transient_rejection(outcome.reason):
        return feedback
    if status is OutcomeStatus.REJECTED:
        count = feedback.rejections_in_row.get(kind, 0) + 1
        rejections = {**feedback.rejections_in_row, kind: count}
        if count >= config.reject_disable_after and kind not in feedback.disabled_actions:
            return replace(
                feedback,
                rejections_in_row=rejections,
                disabled_actions=feedback.disabled_actions | {kind},
                disabled_reasons={**feedback.disabled_reasons, kind: outcome.reason},
            )
        return replace(feedback, rejections_in_row=rejections)
    # accepted or clipped: the type works on this worker.
    rejections = {k: v for k, v in feedback.rejections_in_row.items() if k != kind}
    scale = feedback.pin_ask_scale
    if kind == ActionType.PIN.value:
        # A hybrid model's Pin holds no position past the hit point the other KV cache
        # groups' resident blocks allow, and says it: the applied fraction of that, not
        # of the target, is what its budget took (a clip for residency alone is 1).
        asked = outcome.requested.blocks
        if (reach := clipped_hit_reach(outcome.reason)) is not None:
            asked = min(asked, reach)
        if status is OutcomeStatus.CLIPPED and asked > 0:
            fraction = outcome.applied.blocks / asked
            scale = max(config.min_pin_scale, min(scale, scale * fraction))
        elif status is OutcomeStatus.ACCEPTED:
            scale = min(1.0, scale * config.pin_recovery)
    return replace(feedback, pin_ask_scale=scale, rejections_in_row=rejections)
