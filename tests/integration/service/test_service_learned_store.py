"""Learned statistics in the store, per tenant, on SQLite and PostgreSQL: one row per
tenant, and the upgrade from a router that kept one pooled row for every tenant."""

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


def _restarted(engine, tenants: tuple[str, ...]) -> tuple[HintDispatcher, StoreWriter]:
    writer = StoreWriter(engine, flush_interval_s=10, queue_max=100, on_drop=lambda *_: None)
    hints = HintDispatcher(None, Subjects("t"), WorkerRegistry([]), writer, RouterMetrics(),
                           PlannerConfig(), seed=1, tenants=tenants)
    hints.restore(load_recovery(engine, active_since=0.0, max_sessions=10).learned, [])
    return hints, writer


def test_an_upgrade_takes_the_pooled_row_as_every_tenants_start_once(
        database_url: str) -> None:
    """An older router's pooled row ("*", "tool_gaps": "search" in 2 s) and a row of
    tenant a's own (60 s). After the upgrade, default and b start from copies of the
    pooled statistics, a keeps its own; their rows are written and the pooled row marked
    taken, so after the next restart they keep what they learnt and a tenant configured
    later (c) starts from the priors, not from the other tenants' old traffic, whatever
    an older router sharing the store still writes into the pooled row."""
    engine = create_store_engine(database_url)
    try:
        migrate(engine)
        pooled, own = _learnt(2.0), _learnt(60.0)
        with engine.begin() as conn:
            for tenant, kind, stats in (("*", "tool_gaps", pooled), ("a", "tenant_gaps", own)):
                conn.execute(LearnedStatsRow.__table__.insert().values(
                    tenant=tenant, kind=kind, data=stats.to_dict(), updated_at=NOW))
        expect_pooled = pooled.gap_quantile("search", 1, Q)
        expect_own = own.gap_quantile("search", 1, Q)
        assert expect_pooled < 5.0 < 40.0 < expect_own

        async def upgrade() -> None:
            hints, writer = _restarted(engine, ("default", "a", "b"))
            for tenant in ("default", "b"):
                assert hints.stats_of(tenant).gap_quantile("search", 1, Q) == expect_pooled
            assert hints.stats_of("a").gap_quantile("search", 1, Q) == expect_own
            # Copies: b's traffic moves b's statistics only.
            hints.observe([GapObserved("search", 1, 900.0)] * 40, "b")
            assert hints.stats_of("b").gap_quantile("search", 1, Q) > 500.0
            assert hints.stats_of("default").gap_quantile("search", 1, Q) == expect_pooled
            hints.save_learned(NOW + 1)
            await writer.close()

        asyncio.run(upgrade())
        rows = _rows(engine)
        # The pooled row is left as it is (an older router sharing the store during the
        # rollout reads it, and only it, as its statistics); that it was taken is a row
        # of its own, which no older router writes over.
        assert rows[("*", "tool_gaps")] == pooled.to_dict()
        assert rows[("*", "tool_gaps_adopted")] == {"adopted_at": NOW + 1}
        assert {key for key in rows if key[0] != "*"} == {
            ("default", "tenant_gaps"), ("a", "tenant_gaps"), ("b", "tenant_gaps")}
        assert rows[("a", "tenant_gaps")] == own.to_dict()  # unchanged, not rewritten
        # An older router still running saves its pooled statistics (b's traffic, say).
        with engine.begin() as conn:
            conn.execute(LearnedStatsRow.__table__.update().where(
                LearnedStatsRow.tenant == "*", LearnedStatsRow.kind == "tool_gaps").values(
                data=_learnt(900.0).to_dict()))
        rows = _rows(engine)

        async def next_restart() -> None:
            hints, writer = _restarted(engine, ("default", "a", "b", "c"))
            assert hints.stats_of("default").gap_quantile("search", 1, Q) == expect_pooled
            assert hints.stats_of("a").gap_quantile("search", 1, Q) == expect_own
            assert hints.stats_of("b").gap_quantile("search", 1, Q) > 500.0
            assert hints.stats_of("c").gap_quantile("search", 1, Q) == (
                LearnedStats().gap_quantile("search", 1, Q))
            assert not hints.learned.has_own("c")
            hints.save_learned(NOW + 2)  # nothing changed: nothing written
            assert writer.queued == 0
            await writer.close()

        asyncio.run(next_restart())
        assert _rows(engine) == rows
    finally:
        engine.dispose()
