"""Learned statistics in the store, per tenant, on SQLite and PostgreSQL: one row per
tenant, and the upgrade from a router that kept one pooled row for every tenant (of
statistics, of a worker's outcome feedback)."""

from __future__ import annotations

import asyncio

from sqlalchemy import select

from kvhint.router.policy import GapObserved, LearnedStats, PlannerConfig
from kvhint.router.service.hint_dispatch import HintDispatcher
from kvhint.router.service.metrics import RouterMetrics
from kvhint.router.service.workers import WorkerRegistry
from kvhint.router.store.database import create_store_engine, migrate
from kvhint.router.store.models import LearnedStatsRow
from kvhint.router.store.reader import load_recovery
from kvhint.router.store.writer import StoreWriter
from kvhint.schemas import Subjects

Q = PlannerConfig().gap_quantile
NOW = 1_700_000_000.0


def _learnt(gap_s: float) -> LearnedStats:
    stats = LearnedStats()
    for _ in range(20):
        stats.apply(GapObserved("search", 1, gap_s))
    return stats


def _rows(engine) -> dict[tuple[str, str], dict]:
    with engine.connect() as conn:
        return {(r.tenant, r.kind): r.data
                for r in conn.execute(select(LearnedStatsRow.__table__))}


def _restarted(engine, tenants: tuple[str, ...], workers: tuple[str, ...] = ()
               ) -> tuple[HintDispatcher, StoreWriter, RouterMetrics]:
    writer = StoreWriter(engine, flush_interval_s=10, queue_max=100, on_drop=lambda *_: None)
    metrics = RouterMetrics()
    hints = HintDispatcher(None, Subjects("t"),
                           WorkerRegistry([(w, f"http://{w}") for w in workers]), writer,
                           metrics, PlannerConfig(), seed=1, tenants=tenants)
    hints.restore(load_recovery(engine, active_since=0.0, max_sessions=10).learned, [])
    return hints, writer, metrics


def _dropped(metrics: RouterMetrics, what: str) -> float:
    return metrics.drops.labels(what)._value.get()


def test_an_upgrade_starts_no_tenant_from_the_pooled_row(database_url: str) -> None:
    """An older router's pooled row ("*", "tool_gaps": every tenant's traffic together,
    here "search" in 2 s and tool names of another tenant's) and a row of tenant a's own
    (60 s). After the upgrade default and b plan from the priors, as a fresh router does,
    a keeps its own. Before, default and b each started from a copy of the pooled row:
    the other tenants' pre-upgrade history, their tool names (listed in a tenant admin's
    learnt figures) and gaps (its sessions' TTLs followed them). The pooled row is left
    as it is (an older router sharing the store during the rollout reads it, and only it,
    as its statistics), counted once and marked dealt with by a row of its own, so the
    next restart neither looks at it again nor counts it, whatever an older router still
    writes into it."""
    engine = create_store_engine(database_url)
    try:
        migrate(engine)
        pooled, own = _learnt(2.0), _learnt(60.0)
        pooled.apply(GapObserved("acme_crm_lookup", 1, 3.0))  # another tenant's tool
        with engine.begin() as conn:
            for tenant, kind, stats in (("*", "tool_gaps", pooled), ("a", "tenant_gaps", own)):
                conn.execute(LearnedStatsRow.__table__.insert().values(
                    tenant=tenant, kind=kind, data=stats.to_dict(), updated_at=NOW))
        prior = LearnedStats().gap_quantile("search", 1, Q)
        expect_own = own.gap_quantile("search", 1, Q)
        assert pooled.gap_quantile("search", 1, Q) < 5.0 < 40.0 < expect_own < prior

        async def upgrade() -> None:
            hints, writer, metrics = _restarted(engine, ("default", "a", "b"))
            for tenant in ("default", "b"):
                assert hints.stats_of(tenant).gap_quantile("search", 1, Q) == prior
                assert "acme_crm_lookup|*" not in hints.stats_of(tenant).gaps
                assert not hints.learned.has_own(tenant)
            assert hints.stats_of("a").gap_quantile("search", 1, Q) == expect_own
            assert _dropped(metrics, "learned_stats_pooled_unused") == 1
            hints.save_learned(NOW + 1)
            await writer.close()

        asyncio.run(upgrade())
        rows = _rows(engine)
        assert rows[("*", "tool_gaps")] == pooled.to_dict()
        assert rows[("*", "tool_gaps_adopted")] == {"adopted_at": NOW + 1}
        assert {key for key in rows if key[0] != "*"} == {("a", "tenant_gaps")}
        assert rows[("a", "tenant_gaps")] == own.to_dict()  # unchanged, not rewritten
        # An older router still running saves its pooled statistics.
        with engine.begin() as conn:
            conn.execute(LearnedStatsRow.__table__.update().where(
                LearnedStatsRow.tenant == "*", LearnedStatsRow.kind == "tool_gaps").values(
                data=_learnt(900.0).to_dict()))
        rows = _rows(engine)

        async def next_restart() -> None:
            hints, writer, metrics = _restarted(engine, ("default", "a", "b", "c"))
            for tenant in ("default", "b", "c"):
                assert hints.stats_of(tenant).gap_quantile("search", 1, Q) == prior
            assert hints.stats_of("a").gap_quantile("search", 1, Q) == expect_own
            assert _dropped(metrics, "learned_stats_pooled_unused") == 0
            hints.save_learned(NOW + 2)  # nothing changed: nothing written
            assert writer.queued == 0
            await writer.close()

        asyncio.run(next_restart())
        assert _rows(engine) == rows
    finally:
        engine.dispose()


def test_an_upgrade_keeps_of_a_pooled_feedback_row_only_what_the_worker_cannot_do(
        database_url: str) -> None:
    """A feedback row of a router from before feedback was split by tenant pooled every
    tenant's outcomes: Demote off for want of a host tier (the worker's), Pin off after
    some tenant's rejections and a pin ask scale of 0.25 from some tenant's clipped Pins
    (whose, nothing says). After the upgrade Demote stays off for every tenant; Pin is on
    and asks in full for each (counted, feedback_pooled_unused), and the row is written
    again in the new form, which a restart reads back unchanged."""
    engine = create_store_engine(database_url)
    try:
        migrate(engine)
        legacy = {"worker_id": "w0", "pin_ask_scale": 0.25,
                  "disabled_actions": ["kv.demote", "kv.pin"],
                  "disabled_reasons": {
                      "kv.demote": "demote needs a host tier: none here; nothing changed",
                      "kv.pin": "invalid payload: b/s1 names 9 block hashes"},
                  "rejections_in_row": {"kv.pin": 2}}
        with engine.begin() as conn:
            conn.execute(LearnedStatsRow.__table__.insert().values(
                tenant="*", kind="feedback:w0", data=legacy, updated_at=NOW))

        async def upgrade() -> None:
            hints, writer, metrics = _restarted(engine, ("default", "a", "b"), ("w0",))
            for tenant in ("a", "b", None):
                view = hints.feedback["w0"].view(tenant)
                assert not view.allows("kv.demote") and view.allows("kv.pin")
                assert view.pin_ask_scale == 1.0
            assert _dropped(metrics, "feedback_pooled_unused") == 1
            hints.save_learned(NOW + 1)
            await writer.close()

        asyncio.run(upgrade())
        stored = _rows(engine)[("*", "feedback:w0")]
        assert stored["disabled_actions"] == ["kv.demote"] and stored["tenants"] == {}

        async def next_restart() -> None:
            hints, writer, metrics = _restarted(engine, ("default", "a", "b"), ("w0",))
            assert not hints.feedback["w0"].view("a").allows("kv.demote")
            assert _dropped(metrics, "feedback_pooled_unused") == 0
            hints.save_learned(NOW + 2)
            assert writer.queued == 0
            await writer.close()

        asyncio.run(next_restart())
    finally:
        engine.dispose()
