"""Outcome feedback split by what it is about: the worker's capabilities, shared by every
tenant, and each tenant's own.

One :class:`~kvhint.router.policy.feedback.WorkerFeedback` per worker, fed by every
tenant's planner actions, let one tenant's outcomes steer another's planning: tenant B's
sessions whose Demotes kept finding no finished host copy (or whose ``prefix_tokens``
named less than a block, or whose next turns superseded a waiting Demote) turned Demote
off on that worker for tenant A too, until the engine restarted; and B's clipped Pins
(chains partly resident, TTLs clipped) shrank A's pin asks there.

:class:`SplitFeedback` keeps, per worker:

- ``capability``: fed only rejections whose reason says the worker cannot do the action
  at all, whatever its target or sender
  (:func:`~kvhint.schemas.outcomes.is_capability_rejection`: a type, version or protocol
  it does not know, no host tier for Demote, no tier for Share, no prefix caching). They
  change only with a new engine (an epoch: the caller starts afresh), so they turn the
  type off for every tenant, as before; no tenant's outcome resets them.
- ``tenants``: each tenant's own :class:`WorkerFeedback`, fed every other terminal outcome
  of that tenant's planner actions (other rejections, the pin ask scale).

What a tenant's planning reads is :meth:`SplitFeedback.view`: the capability part's
disabled types, plus its own; its own pin ask scale. A tenant's outcomes therefore never
turn off or shrink another tenant's hints; a reason a router cannot classify (a newer
plugin's) counts as the tenant's: isolation is the default, and each tenant then learns
a real incapacity on its own after ``reject_disable_after`` rejections.

Plain, frozen data; the caller bounds which tenants learn and persists it
(:meth:`SplitFeedback.to_dict`, :func:`feedback_from_stored`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from kvhint.router.policy.feedback import FeedbackConfig, WorkerFeedback, apply_outcome
from kvhint.schemas.outcomes import HintOutcome, OutcomeStatus, is_capability_rejection

# The key of the tenants' parts in a stored row; its absence marks a row of a router from
# before the split (one pooled WorkerFeedback, its fields at the top level).
TENANTS_KEY = "tenants"


@dataclass(frozen=True, slots=True)
class SplitFeedback:
    """One worker's feedback: ``capability`` (every tenant's) and ``tenants`` (each one's
    own). ``capability`` None: a fresh one for ``worker_id``."""

    worker_id: str
    capability: WorkerFeedback | None = None
    tenants: Mapping[str, WorkerFeedback] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.capability is None:
            object.__setattr__(self, "capability", WorkerFeedback(self.worker_id))

    @property
    def shared(self) -> WorkerFeedback:
        """The capability part (never None after construction)."""
        assert self.capability is not None
        return self.capability

    def view(self, tenant: str | None) -> WorkerFeedback:
        """What ``tenant``'s planning reads of this worker: the types the worker cannot do
        and those ``tenant``'s own rejections turned off; ``tenant``'s pin ask scale.
        None (no tenant): the capability part alone."""
        own = self.tenants.get(tenant) if tenant is not None else None
        if own is None:
            return self.shared
        return WorkerFeedback(
            self.worker_id, pin_ask_scale=own.pin_ask_scale,
            disabled_actions=self.shared.disabled_actions | own.disabled_actions,
            disabled_reasons={**own.disabled_reasons, **self.shared.disabled_reasons},
            rejections_in_row=dict(own.rejections_in_row))

    def learn(self, tenant: str | None, outcome: HintOutcome,
              config: FeedbackConfig = FeedbackConfig()) -> SplitFeedback:
        """Fold one terminal outcome of a planner action of ``tenant``. A capability
        rejection goes to the worker's part; anything else to ``tenant``'s (None: nothing
        is learnt of it; the caller counts). Returns ``self`` when nothing changed."""
        if outcome.status is OutcomeStatus.REJECTED and is_capability_rejection(outcome.reason):
            shared = apply_outcome(self.shared, outcome, config)
            return self if shared is self.shared else replace(self, capability=shared)
        if tenant is None:
            return self
        own = self.tenants.get(tenant) or WorkerFeedback(self.worker_id)
        learnt = apply_outcome(own, outcome, config)
        if learnt is own:
            return self
        return replace(self, tenants={**self.tenants, tenant: learnt})

    def to_dict(self) -> dict[str, Any]:
        """The capability part's fields at the top level (what a router from before the
        split reads as the worker's feedback: it then disables only what the worker
        cannot do), each tenant's part under ``tenants``."""
        return {**self.shared.to_dict(),
                TENANTS_KEY: {t: f.to_dict() for t, f in sorted(self.tenants.items())}}

    def to_dict_of(self, tenant: str) -> dict[str, Any]:
        """What of :meth:`to_dict` ``tenant`` may read, in its shape: the capability part
        (what the worker cannot do: learnt from any tenant's outcomes, about none of
        them) and, under ``tenants``, ``tenant``'s own part alone (empty: none yet).
        Another tenant's part (its outcomes, its reasons) is never in it."""
        own = self.tenants.get(tenant)
        return {**self.shared.to_dict(),
                TENANTS_KEY: {} if own is None else {tenant: own.to_dict()}}


def feedback_from_stored(data: Mapping[str, Any]) -> tuple[SplitFeedback, bool]:
    """A stored row's feedback, and whether part of it was left out. A row of a router
    from before the split (no ``tenants``) pooled every tenant's outcomes: of it only the
    types disabled by a capability rejection are kept (the worker's); its pin ask scale,
    its other disabled types and its rejection counts cannot be told apart by tenant, so
    they are left out (True), and every tenant starts afresh."""
    if TENANTS_KEY in data:
        tenants = data[TENANTS_KEY]
        if not isinstance(tenants, Mapping):
            raise ValueError("feedback: tenants must be an object")
        return SplitFeedback(
            str(data["worker_id"]), WorkerFeedback.from_dict(dict(data)),
            {str(t): WorkerFeedback.from_dict(f) for t, f in tenants.items()}), False
    pooled = WorkerFeedback.from_dict(dict(data))
    kept = {kind: reason for kind, reason in pooled.disabled_reasons.items()
            if kind in pooled.disabled_actions and is_capability_rejection(reason)}
    capability = WorkerFeedback(pooled.worker_id, disabled_actions=frozenset(kept),
                                disabled_reasons=kept)
    left_out = (pooled.pin_ask_scale != 1.0 or bool(pooled.rejections_in_row)
                or pooled.disabled_actions != capability.disabled_actions)
    return SplitFeedback(pooled.worker_id, capability), left_out
