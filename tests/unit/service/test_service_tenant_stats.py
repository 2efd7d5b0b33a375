"""Each tenant's learned statistics are its own (policy.tenant_stats): the live lifecycle,
dispatcher and admin overview on an injected clock, NATS replaced by a recording link.

Before, one LearnedStats served every tenant: tenant a's tool gaps moved tenant b's
predictions (b's pins expired before b came back), a's tool names filled the key table
so b's tools were never learnt, and b's admin saw figures learnt from a's traffic."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvhint.router.kv_index import InMemoryClusterKvIndex
from kvhint.router.policy import MAX_GAP_KEYS, GapObserved, LearnedStats, PlannerConfig
from kvhint.router.service.admin_api import overview_of, session_view
from kvhint.router.service.hint_dispatch import HintDispatcher
from kvhint.router.service.lifecycle import SessionLifecycle
from kvhint.router.service.metrics import RouterMetrics
from kvhint.router.service.response_scan import ResponseObservation
from kvhint.router.service.sessions import SessionRegistry
from kvhint.router.service.settings import TenantBudget
from kvhint.router.service.tenancy import Principal, Tenant
from kvhint.router.service.timeline import Timeline
from kvhint.router.service.workers import WorkerRegistry
from kvhint.schemas import Subjects
from test_service_planning import RecordingLink, status

START = 1_000_000.0
Q = PlannerConfig().gap_quantile
FRESH = LearnedStats()  # what a fresh router predicts from


class Clock:
    def __init__(self) -> None:
        self.now = START

    def __call__(self) -> float:
        return self.now


def build(tenants: tuple[str, ...] = ("default", "a", "b")):
    clock = Clock()
    registry = WorkerRegistry([("w0", "http://w0")])
    registry.on_heartbeat(status("w0"))
    metrics = RouterMetrics()
    hints = HintDispatcher(RecordingLink(), Subjects("t"), registry, None, metrics,
                           PlannerConfig(), seed=1, clock=clock, tenants=tenants)
    sessions = SessionRegistry(None, max_sessions=100)
    lifecycle = SessionLifecycle(sessions, hints, metrics, hints_enabled=True,
                                 forget_after_s=3600.0, clock=clock)
    runtime = SimpleNamespace(  # what the admin overview reads
        sessions=sessions, hints=hints, workers=registry, metrics=metrics,
        index=InMemoryClusterKvIndex(), timeline=Timeline(), started_at=START,
        directory=SimpleNamespace(dev_mode=False), link=None,
        ingestor=SimpleNamespace(worker_views=dict))
    return clock, hints, lifecycle, metrics, runtime


async def tool_turns(lifecycle: SessionLifecycle, clock: Clock, tenant: str, session: str,
                     tools: list[str], gap_s: float) -> None:
    """One turn per tool, each ending in a call of it, the next turn ``gap_s`` later (the
    planner learns the gap when that turn is routed)."""
    for tool in [*tools, None]:
        record = lifecycle.begin_turn(tenant, session)
        await lifecycle.routed(record, "w0", 400, 0, ())
        if tool is None:
            return
        await lifecycle.finished(record, "w0", ResponseObservation(
            finish_reason="tool_calls", tool_names=[tool], prompt_tokens=400,
            completion_tokens=8, cached_tokens=0), session_end=False)
        clock.now += gap_s


async def test_one_tenants_gaps_do_not_move_another_tenants_predictions() -> None:
    """Tenant a's "search" answers in 2 s; b has used no tool yet: b's predictions stay
    a fresh router's (p90 about 410 s), and b's session is protected for that, not for
    a's 2 s. Before, b's predicted p90 fell to ~2.8 s after a's 50 gaps."""
    clock, hints, lifecycle, _metrics, _runtime = build()
    await tool_turns(lifecycle, clock, "a", "s1", ["search"] * 50, 2.0)
    assert hints.context(clock.now, "a").stats.gap_quantile("search", 3, Q) < 5.0
    b = hints.context(clock.now, "b").stats
    for depth in (1, 3, 8):
        assert b.gap_quantile("search", depth, Q) == FRESH.gap_quantile("search", depth, Q)
        assert b.return_probability(depth) == FRESH.return_probability(depth)
    assert b.completion_read_probability() == FRESH.completion_read_probability()
    record = lifecycle.begin_turn("b", "s1")
    await lifecycle.routed(record, "w0", 400, 0, ())
    await lifecycle.finished(record, "w0", ResponseObservation(
        finish_reason="tool_calls", tool_names=["search"], prompt_tokens=400,
        completion_tokens=8, cached_tokens=0), session_end=False)
    assert record.plan.gap_predicted_s == FRESH.gap_quantile("search", 1, Q) > 400.0


async def test_one_tenants_many_tool_names_leave_room_for_another_tenants_tools() -> None:
    """Tenant a calls more distinct tools than the key table holds; b's own tool is still
    learnt under its name, and a's table stays bounded. Before, a's names filled the one
    table and b's tool was learnt only in the pool."""
    clock, hints, lifecycle, _metrics, _runtime = build()
    names = [f"a_tool_{n}" for n in range(MAX_GAP_KEYS // 2 + 8)]  # two keys per name
    await tool_turns(lifecycle, clock, "a", "s1", names, 5.0)
    a = hints.context(clock.now, "a").stats
    assert len(a.gaps) <= MAX_GAP_KEYS and f"{names[-1]}|*" not in a.gaps
    await tool_turns(lifecycle, clock, "b", "s1", ["b_private_tool"] * 12, 300.0)
    b = hints.context(clock.now, "b").stats
    assert "b_private_tool|*" in b.gaps
    assert 300.0 <= b.gap_quantile("b_private_tool", 3, 0.5) < 450.0


async def test_a_tenant_not_served_plans_from_the_priors_and_its_learning_is_counted() -> None:
    """Only the tenants the router serves learn (memory bounded by the configuration);
    a session of another one (restored from a tenant since removed) learns nothing,
    plans as a fresh router does, and what it would have taught is counted dropped."""
    clock, hints, lifecycle, metrics, _runtime = build()
    await tool_turns(lifecycle, clock, "gone", "s1", ["search"] * 10, 2.0)
    assert not hints.learned.has_own("gone")
    assert hints.stats_of("gone").gap_quantile("search", 3, Q) == FRESH.gap_quantile(
        "search", 3, Q)
    assert 'kvhint_router_drops_total{what="learned_stats_unknown_tenant"}' in (
        metrics.render().decode())


async def test_a_tenant_admin_sees_its_own_tenants_learnt_figures_only() -> None:
    """b's admin: b's session shows the gap predicted from b's traffic (a fresh router's
    here), and the overview's learnt figures are b's alone (a's tool absent). A global
    admin sees each served tenant's apart. Before, b's session showed a's 2 s gap."""
    clock, hints, lifecycle, _metrics, runtime = build()
    await tool_turns(lifecycle, clock, "a", "s1", ["search"] * 20, 2.0)
    record = lifecycle.begin_turn("b", "s1")
    await lifecycle.routed(record, "w0", 400, 0, ())
    await lifecycle.finished(record, "w0", ResponseObservation(
        finish_reason="tool_calls", tool_names=["search"], prompt_tokens=400,
        completion_tokens=8, cached_tokens=0), session_end=False)
    b_admin = Principal(Tenant("b", "salt-b", TenantBudget()), is_admin=True)
    overview = overview_of(runtime, b_admin)  # type: ignore[arg-type]
    assert [s["tenant"] for s in overview["sessions"]] == ["b"]
    planner = overview["sessions"][0]["planner"]
    assert planner["gap_predicted_s"] == FRESH.gap_quantile("search", 1, Q)
    view = session_view(runtime, record, detail=False)  # type: ignore[arg-type]
    assert view["planner"] == planner
    assert list(overview["learned"]) == ["b"]
    learned = overview["learned"]["b"]
    assert learned["tools_gap_predicted_s"] == {} and learned["tools_learnt"] == 0
    assert learned["tool_gap_predicted_s"] == FRESH.gap_quantile("@tool", 1, Q)
    everyone = overview_of(runtime, Principal(None, is_admin=True))  # type: ignore[arg-type]
    assert set(everyone["learned"]) == {"default", "a", "b"}
    assert everyone["learned"]["a"]["tools_gap_predicted_s"]["search"] < 5.0
    assert everyone["learned"]["b"] == learned
    assert everyone["learned"]["default"] == learned  # no traffic: the priors, like b


@pytest.mark.parametrize("tenant", ["a", "b"])
def test_save_writes_one_row_per_tenant_that_learnt(tenant: str) -> None:
    """One learned_stats row per tenant whose statistics changed, none pooled."""
    rows: list[tuple[tuple, dict]] = []
    writer = SimpleNamespace(upsert=lambda _table, key, values: rows.append((key, values)))
    hints = HintDispatcher(RecordingLink(), Subjects("t"), WorkerRegistry([]),
                           writer,  # type: ignore[arg-type]
                           RouterMetrics(), PlannerConfig(), seed=1, tenants=("a", "b"))
    hints.observe([GapObserved("search", 1, 2.0)] * 3, tenant)
    hints.save_learned(START)
    assert [key for key, _values in rows] == [(tenant, "tenant_gaps")]
    assert LearnedStats.from_dict(rows[0][1]["data"]).gaps
    hints.save_learned(START + 1)  # unchanged: not written again
    assert len(rows) == 1
