"""Property checks of the hint planner over many seeded random fleets and session
lifecycles (hypothesis is not installed: seeded ``random`` loops, each failure names its
seed). The planner is driven as the live router and the simulator drive it: a context
rebuilt from a real :class:`HoldingsLedger` before every call, every planned action
recorded in that ledger. Invariants:

- the planner's own plans never take a worker's pin budget, or a tenant's pin or retain
  budget, past its limit (the worker's retain budget is soft by design: the worker
  displaces lower priorities);
- every action is valid on the wire, names its own session's tenant and session;
- a call is a pure function of its context: same seed, same plan; the context's
  statistics are not changed.

Targeted regressions of the defects this found are at the end.
"""

from __future__ import annotations

import random

from planner_fixtures import BS, BUDGETS, NO_HOST, fast_search, finish, make_ctx, typed

from kvhint.router.policy import (
    FinishReason,
    GapObserved,
    Holdings,
    HoldingsLedger,
    LearnedStats,
    PlannerConfig,
    PlannerContext,
    Protection,
    ResponseFinished,
    ReturnObserved,
    SessionEnded,
    SessionPlanState,
    TurnRouted,
    WorkerPlanView,
    plan_idle,
    plan_response_finished,
    plan_session_end,
    plan_turn_routed,
)
from kvhint.schemas import Budgets, parse_action
from kvhint.schemas.hints import ParsedAction

ALL = ("kv.retain", "kv.pin", "kv.demote", "kv.prefetch", "kv.share")
TENANTS = ("a", "b")


def _stats(r: random.Random) -> LearnedStats:
    stats = LearnedStats()
    for _ in range(r.randrange(0, 40)):
        kind = r.choice(["search", "edit", "@user", "@user:fast"])
        if r.random() < 0.6:
            stats.apply(GapObserved(kind, r.randrange(1, 10), r.choice([1.0, 4.0, 30.0, 900.0])))
        else:
            stats.apply(ReturnObserved(r.randrange(1, 10), r.random() < 0.6, kind))
    return stats


def _fleet(r: random.Random) -> dict[str, WorkerPlanView]:
    fleet = {}
    for worker_id in ("w0", "w1", "w2"):
        budgets = Budgets(max_pinned_blocks=r.choice([0, 8, 40, 200]),
                          max_pin_ttl_s=r.choice([5.0, 600.0]),
                          max_retained_blocks=r.choice([50, 5000]),
                          max_retain_ttl_s=r.choice([10.0, 3600.0]))
        fleet[worker_id] = WorkerPlanView(
            worker_id, r.choice([16, 512]), budgets,
            frozenset(a for a in ALL if r.random() < 0.85), host_tier=r.random() < 0.5)
    return fleet


def _config(r: random.Random) -> PlannerConfig:
    return PlannerConfig(tenant_max_pinned_blocks=r.choice([None, 0, 10, 60]),
                         tenant_max_retained_blocks=r.choice([None, 0, 20, 200]),
                         ended_retain_ttl_s=r.choice([0.0, 30.0]))


class _Driver:
    """The caller's side: sessions, a holdings ledger, contexts built from it."""

    def __init__(self, seed: int) -> None:
        self.r = random.Random(seed)
        self.seed = seed
        self.stats = {t: _stats(self.r) for t in TENANTS}
        self.fleet = _fleet(self.r)
        self.config = _config(self.r)
        self.ledger = HoldingsLedger()
        self.sessions: dict[str, SessionPlanState | None] = {
            f"{t}/s{i}": None for t in TENANTS for i in range(3)}
        self.now = 0.0

    def context(self, tenant: str, seed: int) -> PlannerContext:
        self.ledger.expire(self.now)
        workers = {w: WorkerPlanView(v.worker_id, v.block_size, v.budgets,
                                     v.supported_actions, v.host_tier,
                                     held=self.ledger.worker(w))
                   for w, v in self.fleet.items()}
        return PlannerContext(now=self.now, stats=self.stats[tenant], workers=workers,
                              rng=random.Random(seed), config=self.config,
                              tenant_held={tenant: self.ledger.tenant(tenant)})

    def step(self, index: int) -> None:
        r = self.r
        self.now += r.choice([0.5, 3.0, 12.0, 60.0, 700.0])
        key = r.choice(sorted(self.sessions))
        tenant = key.split("/")[0]
        session = self.sessions[key]
        choice = r.random()
        if session is None or choice < 0.3:
            event = TurnRouted(key, tenant, r.choice(sorted(self.fleet)),
                               r.randrange(0, 60_000), self.now)
            call = lambda ctx: plan_turn_routed(ctx, session, event)  # noqa: E731
        elif choice < 0.65:
            finished = ResponseFinished(
                key, r.choice(list(FinishReason)), r.randrange(0, 60_000),
                r.randrange(0, 4000), self.now, tuple(r.sample(["search", "edit"], r.randrange(3))))
            call = lambda ctx: plan_response_finished(ctx, session, finished)  # noqa: E731
        elif choice < 0.93:
            call = lambda ctx: plan_idle(ctx, session)  # noqa: E731
        else:
            end = SessionEnded(key, self.now)
            call = lambda ctx: plan_session_end(ctx, session, end)  # noqa: E731
        where = f"seed {self.seed} step {index}"
        stats_before = self.stats[tenant].to_dict()
        ctx = self.context(tenant, self.seed * 1000 + index)
        result = call(ctx)
        assert call(self.context(tenant, self.seed * 1000 + index)) == result, where
        assert self.stats[tenant].to_dict() == stats_before, where
        for planned in result.actions:
            parsed = parse_action(planned.action)
            assert isinstance(parsed, ParsedAction), (where, parsed)
            assert planned.tenant == tenant and planned.scope == key, where
            assert parsed.payload.target.session_id == key, where
            self.ledger.record(action_id=planned.action.action_id,
                               worker_id=planned.worker_id, tenant=planned.tenant,
                               scope=planned.scope, action_type=planned.action_type,
                               blocks=planned.blocks, expires_at=planned.expires_at)
        self.sessions[key] = result.session
        self._check_budgets(where, result)

    def _check_budgets(self, where: str, result: object) -> None:
        for worker_id, view in self.fleet.items():
            held = self.ledger.worker(worker_id)
            assert held.pinned_blocks <= view.budgets.max_pinned_blocks, (where, result)
        for tenant in TENANTS:
            held = self.ledger.tenant(tenant)
            if self.config.tenant_max_pinned_blocks is not None:
                assert held.pinned_blocks <= self.config.tenant_max_pinned_blocks, (where,
                                                                                    result)
            if self.config.tenant_max_retained_blocks is not None:
                assert held.retained_blocks <= self.config.tenant_max_retained_blocks, (
                    where, result)


def test_random_lifecycles_keep_budgets_wire_bounds_tenancy_and_determinism() -> None:
    for seed in range(400):
        driver = _Driver(seed)
        for index in range(40):
            driver.step(index)


# -- targeted regressions -------------------------------------------------------------


def test_an_expired_pin_of_the_session_frees_no_room_for_its_next_pin() -> None:
    """A short tool's pin that expired during the next turn is no longer in the ledger:
    the next pin's room is the budget less what others hold, not that plus the expired
    pin's blocks (before: 60 pinned by others, an expired pin of 40, a budget of 100: a
    pin of 80 went out, 140 pinned)."""
    view = WorkerPlanView("w0", BS, BUDGETS, NO_HOST, held=Holdings(pinned_blocks=60))
    ctx = make_ctx(now=100.0, stats=fast_search(), w0=view)
    expired = Protection("kvh-old", "kv.pin", "w0", 100, 40, expires_at=20.0)
    session = SessionPlanState("t/s", "t", worker_id="w0", turns=1, context_tokens=80 * BS,
                               prompt_tokens=80 * BS, protection=expired)
    result = finish(ctx, session, FinishReason.TOOL_CALLS, ("search",), at=100.0,
                    prompt=80 * BS, completion=0)
    (planned,) = result.actions
    assert planned.action_type == "kv.retain" and typed(planned).payload.priority == 100
    # While it lasts, the session's own pin is room for its next one.
    live = make_ctx(now=10.0, stats=fast_search(), w0=view)
    result = finish(live, session, FinishReason.TOOL_CALLS, ("search",), at=10.0,
                    prompt=80 * BS, completion=0)
    (planned,) = result.actions
    assert planned.action_type == "kv.pin" and planned.blocks == 80


def test_a_moved_sessions_prefetch_fits_its_tenants_retain_budget() -> None:
    """A Prefetch retains what it brings into G1 until its deadline (the ledger and the
    sessions API's budget check count it as retained): over the tenant's retain budget it
    is not sent."""
    host = WorkerPlanView("w1", BS, BUDGETS, NO_HOST | {"kv.demote"}, host_tier=True)
    workers = {"w0": WorkerPlanView("w0", BS, BUDGETS, NO_HOST), "w1": host}
    session = SessionPlanState("t/s", "t", worker_id="w0", turns=1, context_tokens=8 * BS,
                               prompt_tokens=8 * BS)
    event = TurnRouted("t/s", "t", "w1", 9 * BS, 5.0)
    for cap, sent in ((None, True), (10, True), (7, False)):
        ctx = make_ctx(now=5.0, config=PlannerConfig(tenant_max_retained_blocks=cap),
                       **workers)
        ctx = PlannerContext(now=ctx.now, stats=ctx.stats, workers=ctx.workers, rng=ctx.rng,
                             config=ctx.config, tenant_held={"t": Holdings(0, 2)})
        kinds = [a.action_type for a in plan_turn_routed(ctx, session, event).actions]
        assert kinds == (["kv.prefetch"] if sent else []), cap


def test_an_ended_sessions_lowest_retain_fits_its_tenants_retain_budget() -> None:
    config = PlannerConfig(ended_retain_ttl_s=30.0, tenant_max_retained_blocks=10)
    session = SessionPlanState("t/s", "t", worker_id="w0", turns=2, context_tokens=8 * BS,
                               prompt_tokens=8 * BS)
    for held, kind, priority in ((2, "kv.retain", 1), (3, "kv.retain", 0)):
        ctx = make_ctx(now=5.0, config=config)
        ctx = PlannerContext(now=ctx.now, stats=ctx.stats, workers=ctx.workers, rng=ctx.rng,
                             config=config, tenant_held={"t": Holdings(0, held)})
        (planned,) = plan_session_end(ctx, session, SessionEnded("t/s", 5.0)).actions
        assert planned.action_type == kind and typed(planned).payload.priority == priority
        assert planned.blocks == (8 if priority else 0)
