"""kvhint's policies: routing, hint planning, donor choice.

Pure functions of frozen contexts plus an injected clock (``now`` in the context) and a
seeded ``random.Random``; no I/O, no module state. The live router builds the contexts
from its index, sessions and worker status; the simulator builds them from simulated
workers; both call the same functions.

- :mod:`.routing` — :func:`route` (``round_robin``, ``session_affinity``, ``kv_aware``,
  ``kvhint``) -> :class:`RouteDecision` with fallbacks for a retry.
- :mod:`.planner` — lifecycle -> hints: :func:`plan_turn_routed`,
  :func:`plan_response_finished`, :func:`plan_idle`, :func:`plan_session_end`.
- :mod:`.shared_prefixes` — :func:`find_shared_prefixes` (prefixes many sessions use),
  :func:`plan_shared_prefixes` (their retains) and :class:`SharedPrefixRetains` (when to
  scan, what was sent).
- :mod:`.priority` — :func:`retain_priority` / :func:`priority_density` (the retain
  priority scale).
- :mod:`.session` — :class:`SessionPlanState` (plain data per session) and the events.
- :mod:`.stats` — :class:`LearnedStats` (tool-gap histograms per tool and depth, return
  probability by depth), persisted by the caller as JSON.
- :mod:`.tenant_stats` — :class:`TenantStats` (each tenant's own :class:`LearnedStats`;
  nothing learnt crosses tenants).
- :mod:`.feedback` — :func:`apply_outcome` -> :class:`WorkerFeedback` (pin ask scale,
  disabled action types).
- :mod:`.tenant_feedback` — :class:`SplitFeedback` (a worker's capabilities, shared by
  every tenant, and each tenant's own feedback: no tenant's outcomes steer another's).
- :mod:`.holdings` — :class:`HoldingsLedger` (what live actions hold, for budgets);
  :mod:`.block_counts` its distinct blocks per owner, :mod:`.holding_rules` its pure
  rules (blocks an answer leaves held, scopes, block names).
- :mod:`.donor` — :func:`choose_donor`.
"""

from kvhint.router.policy.donor import (
    DonorCandidate,
    DonorChoice,
    DonorConfig,
    DonorContext,
    choose_donor,
)
from kvhint.router.policy.feedback import FeedbackConfig, WorkerFeedback, apply_outcome
from kvhint.router.policy.holdings import (
    HoldingChange,
    Holdings,
    HoldingsLedger,
    agent_scope,
    target_keys,
)
from kvhint.router.policy.plan_types import (
    ALL_ACTIONS,
    PlannedAction,
    PlannerConfig,
    PlannerContext,
    PlanResult,
    SharedPrefix,
    WorkerPlanView,
)
from kvhint.router.policy.planner import (
    next_idle_review,
    plan_idle,
    plan_response_finished,
    plan_session_end,
    plan_turn_routed,
)
from kvhint.router.policy.priority import priority_density, retain_priority
from kvhint.router.policy.routing import (
    NoWorkerAvailable,
    Overlap,
    RecentLoad,
    RouteDecision,
    RouteRequest,
    RoutingConfig,
    RoutingContext,
    RoutingPolicy,
    SessionPlacement,
    WorkerLoad,
    WorkerScore,
    cached_tokens,
    decay_recent,
    route,
)
from kvhint.router.policy.session import (
    FinishReason,
    Protection,
    ResponseFinished,
    SessionEnded,
    SessionPlanState,
    TurnRouted,
)
from kvhint.router.policy.shared_prefixes import (
    SessionChain,
    SharedPrefixRetains,
    find_shared_prefixes,
    plan_shared_prefixes,
    session_chain,
    session_hit_density,
)
from kvhint.router.policy.stats import (
    ANY_TOOL,
    MAX_GAP_KEYS,
    USER_GAP,
    CompletionReadObserved,
    GapObserved,
    LearnedStats,
    Observation,
    ReturnObserved,
    is_user_kind,
    user_gap_kind,
)
from kvhint.router.policy.tenant_feedback import SplitFeedback, feedback_from_stored
from kvhint.router.policy.tenant_stats import MAX_TENANTS, TenantStats

__all__ = [
    "ALL_ACTIONS",
    "ANY_TOOL",
    "MAX_GAP_KEYS",
    "MAX_TENANTS",
    "USER_GAP",
    "CompletionReadObserved",
    "DonorCandidate",
    "DonorChoice",
    "DonorConfig",
    "DonorContext",
    "FeedbackConfig",
    "FinishReason",
    "GapObserved",
    "HoldingChange",
    "Holdings",
    "HoldingsLedger",
    "LearnedStats",
    "NoWorkerAvailable",
    "Observation",
    "Overlap",
    "PlanResult",
    "PlannedAction",
    "PlannerConfig",
    "PlannerContext",
    "Protection",
    "RecentLoad",
    "ResponseFinished",
    "ReturnObserved",
    "RouteDecision",
    "RouteRequest",
    "RoutingConfig",
    "RoutingContext",
    "RoutingPolicy",
    "SessionChain",
    "SessionEnded",
    "SessionPlacement",
    "SessionPlanState",
    "SharedPrefix",
    "SharedPrefixRetains",
    "SplitFeedback",
    "TenantStats",
    "TurnRouted",
    "WorkerFeedback",
    "WorkerLoad",
    "WorkerPlanView",
    "WorkerScore",
    "agent_scope",
    "apply_outcome",
    "cached_tokens",
    "choose_donor",
    "decay_recent",
    "feedback_from_stored",
    "find_shared_prefixes",
    "is_user_kind",
    "next_idle_review",
    "plan_idle",
    "plan_response_finished",
    "plan_session_end",
    "plan_shared_prefixes",
    "plan_turn_routed",
    "priority_density",
    "retain_priority",
    "route",
    "session_chain",
    "session_hit_density",
    "target_keys",
    "user_gap_kind",
]
