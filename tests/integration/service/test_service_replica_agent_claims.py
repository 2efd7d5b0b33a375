"""Two router replicas on one store (PostgreSQL, or one SQLite file) and one NATS, w0 the
real plugin's HintCore on vLLM's real Scheduler and block pool (its hints carried to it,
its outcomes back: feed_helpers.plugin_on_nats; its heartbeat played). An agent
runtime's Pin sent through replica A, the session then ended through replica B (a load
balancer without affinity): B releases the Pin on w0, and A's ledger (its tenant's and
the worker's budgets) stops counting it when it hears B's release answered.

Before, B released only the agent claims its own ledger counted (none: A's): w0 kept the
Pin until its TTL (600 s here), and A's budgets counted it as long."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import nats
import pytest
import sqlalchemy as sa
from conftest import StubWorker, router_settings, running_router
from feed_helpers import ACTIONS_WITH_OWNER, plugin_on_nats, plugin_registered, status, until

from kvhint.engine_plugin.headless import (
    HeadlessScheduler,
    HeadlessSchedulerSpec,
    build_scheduler,
    tokens_for_block_ids,
)
from kvhint.router.policy import agent_scope
from kvhint.router.service.metrics import RouterMetrics
from kvhint.router.service.session_reads import StoredSessions
from kvhint.router.store.database import create_store_engine, migrate
from kvhint.router.store.models import HintActionRow, WorkerRow
from kvhint.router.store.reader import live_agent_claims_within
from kvhint.schemas import HintOwner, Subjects

pytestmark = pytest.mark.usefixtures("throwaway_streams")

BS = 32


def _turn(h: HeadlessScheduler, session: str, block_ids: list[int]) -> None:
    h.run(h.make_request(tokens_for_block_ids(block_ids, BS) + [3] * 5, session_id=session))


async def test_an_agents_pin_sent_through_a_is_released_by_an_end_through_b(
        tmp_path: Path, nats_url: str, subject_prefix: str, database_url: str,
        stub_workers: list[StubWorker]) -> None:
    subjects = Subjects(subject_prefix)
    h = build_scheduler(HeadlessSchedulerSpec(
        block_size=BS, num_blocks=64, connector_module="kvhint.engine_plugin.connector",
        connector_extra_config={"worker_id": "w0"}))
    core = h.connector.core
    nc = await nats.connect(nats_url)
    await plugin_on_nats(nc, subjects, core)

    async def heartbeats() -> None:
        for seq in range(1, 1_000_000):
            await asyncio.sleep(0.25)
            await nc.publish(subjects.status("w0"),
                             status("w0", "e1", seq, actions=ACTIONS_WITH_OWNER))

    settings = router_settings(
        tmp_path, [("w0", stub_workers[0].url)], nats_url=nats_url,
        subject_prefix=subject_prefix, database_url=database_url,
        store_flush_interval_s=3600.0, hints={"tick_s": 3600.0},
        routing={"session_refresh": True})
    beating = None
    try:
        async with running_router(settings) as a, running_router(settings) as b, \
                httpx.AsyncClient(timeout=30) as client:
            for router in (a, b):
                await plugin_registered(router.runtime, nc, subjects, ACTIONS_WITH_OWNER)
            beating = asyncio.create_task(heartbeats())
            turn = await client.post(f"{a.url}/v1/chat/completions", json={
                "model": "stub", "session_id": "s",
                "messages": [{"role": "user", "content": "s: " + "x" * 400}]})
            assert turn.status_code == 200, turn.text
            sid = a.runtime.sessions.get("default", "s").worker_session_id
            _turn(h, sid, [1, 2, 3, 4, 5, 6])
            pinned_before = core.executor.pinned_blocks
            answer = await client.post(f"{a.url}/v1/sessions/s/hints", json={"actions": [{
                "action_type": "kv.pin", "payload": {"ttl_s": 600}}]})
            assert answer.status_code == 200, answer.text
            (action,) = answer.json()["actions"]
            assert action["payload"]["owner"] == HintOwner.AGENT.value, action
            assert action["status"] == "accepted", action
            assert core.executor.pinned_blocks > pinned_before
            ledger = a.runtime.hints.holdings
            assert ledger.workers_holding(agent_scope(sid)) == ["w0"]
            assert ledger.tenant("default").pinned_blocks > 0
            assert ledger.api_on_worker("default", "w0").pinned_blocks > 0
            await a.runtime.writer.flush()  # A's turn and its action's row in the store

            end = await client.delete(f"{b.url}/v1/sessions/s")
            assert end.status_code == 200, end.text
            released = [row for row in end.json()["hints"]
                        if row["payload"].get("owner") == HintOwner.AGENT.value]
            assert len(released) == 1 and released[0]["worker_id"] == "w0", end.json()
            # w0 lets the agent's Pin go (the planner's end pins nothing)...
            await until(lambda: core.executor.pinned_blocks == pinned_before, timeout_s=5)
            # ...and A stops counting it once it hears B's release answered.
            await until(lambda: not ledger.workers_holding(agent_scope(sid)), timeout_s=5)
            assert ledger.tenant("default").pinned_blocks == 0
            assert ledger.api_on_worker("default", "w0").pinned_blocks == 0
            # Ended again through A: nothing of the agent's left for it to release.
            again = await client.delete(f"{a.url}/v1/sessions/s")
            assert again.status_code == 200, again.text
    finally:
        if beating is not None:
            beating.cancel()
        await nc.drain()
        h.connector.shutdown()


async def test_an_ends_read_of_the_agent_claims_that_fails_is_counted(tmp_path: Path) -> None:
    """StoredSessions.agent_claims on a store that cannot answer (a real SQLite file never
    migrated: no ``hint_actions`` table): no claims, counted as a drop (another replica's
    claims are left to their TTL); on a migrated one with none stored, none and no drop."""
    metrics = RouterMetrics()
    bare = create_store_engine(f"sqlite:///{tmp_path / 'bare.db'}")
    store = create_store_engine(f"sqlite:///{tmp_path / 'store.db'}")
    try:
        migrate(store)
        assert await StoredSessions(bare, metrics, 3.0).agent_claims("t", "s", 0.0) == []
        assert _dropped(metrics, "agent_claims_unread") == 1
        assert await StoredSessions(store, metrics, 3.0).agent_claims("t", "s", 0.0) == []
        assert _dropped(metrics, "agent_claims_unread") == 1
    finally:
        bare.dispose()
        store.dispose()


def _dropped(metrics: RouterMetrics, what: str) -> float:
    return sum(sample.value for metric in metrics.drops.collect() for sample in metric.samples
               if sample.name.endswith("_total") and sample.labels.get("what") == what)


def test_the_read_finds_live_api_claims_of_the_session_only(tmp_path: Path) -> None:
    """store.reader.live_agent_claims_within on a real (migrated SQLite) store: the
    session's hints-API Pins and Retains pending or holding with a TTL not over,
    oldest first; not an end's release (trigger ``end:agent_release``), a planner's
    action, a rejected or expired one, another session's or another tenant's, nor a
    Prefetch (its retain is no session's claim on the worker: a release leaves it, so one
    naming it made its replica's ledger drop a retain the worker kept)."""
    engine = create_store_engine(f"sqlite:///{tmp_path / 'store.db'}")
    try:
        migrate(engine)

        def row(action_id: str, **fields: object) -> dict[str, object]:
            base: dict[str, object] = {
                "action_id": action_id, "message_id": "m", "tenant": "t", "session_id": "s",
                "worker_id": "w0", "action_type": "kv.pin", "source": "api",
                "trigger": "api", "payload": {}, "status": "accepted", "created_at": 1.0,
                "updated_at": 1.0, "scope": "t/s#agent", "expires_at": 100.0}
            return {**base, **fields}

        rows = [row("kva-b", created_at=2.0, status="pending", action_type="kv.retain"),
                row("kva-a"),
                row("kva-prefetch", action_type="kv.prefetch", status="clipped",
                    created_at=3.0),
                row("kve-x-a", trigger="end:agent_release", action_type="kv.retain"),
                row("kvh-p", source="planner", trigger="tool_gap_open"),
                row("kva-rejected", status="rejected"), row("kva-over", expires_at=50.0),
                row("kva-demote", action_type="kv.demote"),
                row("kva-other", session_id="s2"), row("kva-tenant", tenant="u")]
        with engine.begin() as conn:
            conn.execute(sa.insert(WorkerRow), [{"worker_id": "w0"}])
            conn.execute(sa.insert(HintActionRow), rows)
        found = live_agent_claims_within(engine, "t", "s", 60.0, 3.0)
        assert [r["action_id"] for r in found] == ["kva-a", "kva-b"]
        assert found[0] == {"action_id": "kva-a", "worker_id": "w0", "scope": "t/s#agent"}
    finally:
        engine.dispose()
