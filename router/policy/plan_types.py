"""The planner's inputs and outputs: its configuration, the frozen context of one
planning call (time, learned statistics, the workers as the planner sees them), and the
actions and session state a plan returns. Data only; the planning is in :mod:`.planner` and
:mod:`.shared_prefixes`.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from kvhint.router.policy.feedback import WorkerFeedback
from kvhint.router.policy.holdings import HoldingChange, Holdings
from kvhint.router.policy.session import SessionPlanState
from kvhint.router.policy.stats import LearnedStats, Observation
from kvhint.schemas.hints import ActionType, HintPayload, KvHintAction, make_action
from kvhint.schemas.status import Budgets, ClaimCost

ALL_ACTIONS = frozenset(t.value for t in ActionType)


@dataclass(frozen=True, slots=True)
class PlannerConfig:
    # "Soon": a session's value is its hit density up to horizon_s (P(next turn within the
    # horizon) over its expected occupancy until then), so a session not expected back
    # within it is worth little. Measured on the simulator after the hold-ledger fix
    # (BENCHMARKS.md): 300 s -> 100 s gains on Mooncake 1 x 5,000 (14.34% -> 14.62%),
    # 4 x 1,250 (12.86% -> 13.38%) and both gen-agents seeds (1.1% and 1.9% fewer
    # recomputed tokens), loses 0.3 points with the host tier; 50 s and 150-200 s are
    # worse on at least one gen-agents seed.
    horizon_s: float = 100.0
    gap_quantile: float = 0.9
    # Learn user gaps and returns per session tempo (the previous user gap; see
    # stats.user_gap_kind) instead of per depth only.
    session_tempo: bool = True
    # With session_tempo, a user gap opened by a turn whose prompt added at least this many
    # tokens beyond the previous turn's prompt and completion (a long user message) is
    # learnt apart (stats.user_gap_kind). 0: off. Measured in BENCHMARKS.md.
    long_message_tokens: int = 2048
    # Tool gaps predicted at most this long are pinned; longer ones are retained. Pins are
    # hard (never relieved under pressure), so they are kept for fast tools: on the
    # gen-agents workload (2 x 400 blocks) 120 s -> 7.24M, 15 s -> 6.94M recomputed tokens
    # (soft, priority-ordered retains use the space better; BENCHMARKS.md).
    pin_max_gap_s: float = 15.0
    pin_ttl_margin: float = 1.5
    min_ttl_s: float = 5.0
    # Sessions valued below this priority are left to vLLM's own LRU (a protection they
    # hold is released).
    min_retain_priority: int = 5
    # An ended (or abandoned) session without a host tier is kept at priority 1 this long
    # (its blocks go first, a prefix shared with live sessions stays); 0 = release it.
    ended_retain_ttl_s: float = 0.0
    # Re-send a retain when its priority would move by at least this much. 1: whenever it
    # moves. The worker orders retained blocks by priority, and a stale one keeps an
    # idle session above fresher ones (BENCHMARKS.md: 10 -> 1 gained on every simulator
    # config, e.g. Mooncake 1 x 5,000 13.72% -> 13.97%); an idle review sends at most one
    # message per session, on the review schedule.
    refresh_priority_step: int = 1
    # With a host tier, sessions valued below this priority are demoted (G1 is left to
    # the rest). Retuned after the 100 s horizon moved the priority scale (2026-12-01,
    # BENCHMARKS.md): 20 -> 30 gained on every host-tier config measured (Mooncake 1 x
    # 5,000 + 20,000 host 30.14% -> 31.02%, + 10,000 and 4 x (1,250 + 5,000) -0.6% to
    # -1.2% recomputed tokens; gen-agents 2 x (400 + 800) -4.4% / +0.6%); 25-40 all
    # beat 20, 50 does not.
    demote_below_priority: int = 30
    abandon_after_s: float = 3600.0
    # A session's return is learnt as "returned within return_window_s": a gap longer
    # than this counts as not returning (observed when plan_idle passes the window), so
    # the estimate is not biased by waiting an hour for every non-return. A return is
    # observed as soon as it happens, a non-return only when the window closes, so until
    # one window has passed (a fresh router) the estimate leans high; 10 minutes keeps
    # that lean short. Measured on the Mooncake trace (with the 300 s horizon of the
    # time): 1200 s -> 12.95%, 600 s -> 13.48% token hits (BENCHMARKS.md).
    return_window_s: float = 600.0
    # plan_idle schedule (see next_idle_review): first review, then x growth each time.
    idle_review_first_s: float = 15.0
    idle_review_growth: float = 1.5
    release_ttl_s: float = 1.0
    share_ttl_s: float = 60.0
    prefetch_deadline_s: float = 5.0
    # A prefix is retained when this many sessions the planner values (in flight or
    # protected) share it on one worker, at the priority of their summed hit density
    # (each one's next turn reads it).
    shared_prefix_min_sessions: int = 3
    # How often the caller looks for shared prefixes (live router and simulator alike).
    shared_prefix_scan_s: float = 10.0
    tenant_max_pinned_blocks: int | None = None
    tenant_max_retained_blocks: int | None = None
    # Action types the operator lets the planner send at all.
    enabled_actions: frozenset[str] = ALL_ACTIONS

    def __post_init__(self) -> None:
        # next_idle_review grows the first review's idle time until it passes now: from 0
        # (or less) it never did, and the planner's caller hung for good.
        if not 0.0 < self.idle_review_first_s < math.inf:
            raise ValueError(f"idle_review_first_s must be > 0 and finite, not "
                             f"{self.idle_review_first_s!r}")


@dataclass(frozen=True, slots=True)
class WorkerPlanView:
    """One worker as the planner sees it: from its status heartbeat (block size, budgets,
    supported actions, host tier), the caller's :class:`HoldingsLedger` and the worker's
    outcome feedback. ``evict_rest_first``: the worker takes Pins and Retains that send
    the rest of the session's blocks first (their action version 1.1). ``claim_cost``:
    the pool blocks a claim of n positions takes there (status 1.3; None: n, a one-group
    model) and ``pinned_claims`` the ledger's live Pins on it, so the pin room is checked
    in the budget's unit, pool blocks (:mod:`.claim_cost`)."""

    worker_id: str
    block_size: int
    budgets: Budgets
    supported_actions: frozenset[str] = ALL_ACTIONS
    host_tier: bool = False
    evict_rest_first: bool = False
    held: Holdings = Holdings()
    feedback: WorkerFeedback | None = None
    claim_cost: ClaimCost | None = None
    pinned_claims: int = 0

    def can_send(self, action_type: ActionType, config: PlannerConfig) -> bool:
        value = action_type.value
        if value not in config.enabled_actions or value not in self.supported_actions:
            return False
        return self.feedback is None or self.feedback.allows(value)


@dataclass(frozen=True, slots=True)
class PlannerContext:
    """Frozen inputs of one planning call. ``rng`` only draws action ids.
    ``tenant_retain_added``: how many retained blocks a Retain naming ``keys`` (block
    hashes, root first) on a worker would add to a tenant's count in ``tenant_held``,
    ``(tenant, worker_id, keys) -> blocks``, as the caller's holdings ledger counts them
    (distinct blocks: one another holding of the tenant already holds adds nothing;
    :meth:`~kvhint.router.policy.holdings.HoldingsLedger.tenant_retain_added`, read
    only). None: every block adds one.

    ``chain``: the block hashes (root first) of the last prompt of the session this call
    plans, on its worker (the live router's session record's ``last_block_hashes``, the
    simulator's the same): the blocks its Pin/Retain/Prefetch names, as the caller's
    ledger records them (:func:`~kvhint.router.policy.holdings.target_keys`).
    ``holding_change``: what such an action would free and add in the worker's and the
    tenant's counts, ``(worker_id, tenant, scope, action_type, blocks, keys) ->
    (worker, tenant)``
    (:meth:`~kvhint.router.policy.holdings.HoldingsLedger.replacing`, read only; tenant
    None: none for it), so a session's protection costs the budgets only the blocks no
    other holding counts (a system prompt a shared prefix's Retain or other sessions
    hold). None: every block adds one, and the session's own live protection of the
    kind is all freed."""

    now: float
    stats: LearnedStats
    workers: Mapping[str, WorkerPlanView]
    rng: random.Random
    config: PlannerConfig = PlannerConfig()
    tenant_held: Mapping[str, Holdings] = field(default_factory=dict)
    tenant_retain_added: Callable[[str, str, Sequence[int]], int] | None = None
    chain: Sequence[int] = ()
    holding_change: Callable[[str, str | None, str, str, int, Sequence[int]],
                             tuple[HoldingChange, HoldingChange]] | None = None


@dataclass(frozen=True, slots=True)
class PlannedAction:
    """One action for one worker. ``scope`` is what it protects (the session id, or
    ``prefix:<key>`` for a shared prefix); ``blocks`` the planner's estimate of what it
    covers; ``expires_at`` when its TTL ends (``now`` for one-shot actions)."""

    worker_id: str
    action: KvHintAction
    scope: str
    tenant: str | None
    blocks: int
    expires_at: float
    reason: str

    @property
    def action_type(self) -> str:
        return self.action.action_type

    @classmethod
    def make(cls, ctx: PlannerContext, worker_id: str, payload: HintPayload, scope: str,
             tenant: str | None, blocks: int, expires_at: float, reason: str
             ) -> PlannedAction:
        """A new action for ``payload``, its id drawn from ``ctx.rng``."""
        action = make_action(f"kvh-{ctx.rng.getrandbits(64):016x}", payload)
        return cls(worker_id, action, scope, tenant, blocks, expires_at, reason)


@dataclass(frozen=True, slots=True)
class PlanResult:
    session: SessionPlanState | None
    actions: tuple[PlannedAction, ...] = ()
    observations: tuple[Observation, ...] = ()


@dataclass(frozen=True, slots=True)
class SharedPrefix:
    """A prefix used by several sessions on one worker (from the cluster index).
    ``hit_density``: the sharing sessions' hit densities summed (see
    :func:`~kvhint.router.policy.shared_prefixes.session_hit_density`).
    ``protected_until``: when the planner's current retain of it ends (None: none)."""

    worker_id: str
    key: str
    block_hashes: tuple[int, ...]
    sessions: int
    tenant: str | None = None
    protected_until: float | None = None
    hit_density: float = 0.0
