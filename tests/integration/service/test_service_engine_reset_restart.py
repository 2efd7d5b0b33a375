"""A worker's engine restart (a new epoch) lets go of what the old engine held and cuts
the wait for what it had waiting; a router restart after it, on SQLite and PostgreSQL,
keeps both: the stored rows say a ``reset`` released those actions, holding nothing
(HintDispatcher.reset_worker, SentAction.restored_waiting).

Before, neither was stored: the restarted router counted the old engine's Pin against
the worker's and tenant's budgets again until its TTL, held the Prefetch the old engine
had waiting at what it asked for, and waited for that Prefetch's answer until its own
deadline (an hour on), though the new engine never answers it."""

from __future__ import annotations

import asyncio
from typing import Any

from kvhint.router.policy import Holdings, PlannerConfig
from kvhint.router.service.hint_dispatch import OUTCOME_DEADLINE_S, HintDispatcher, SentAction
from kvhint.router.service.metrics import RouterMetrics
from kvhint.router.service.workers import WorkerRegistry
from kvhint.router.store.database import create_store_engine, migrate
from kvhint.router.store.reader import load_recovery
from kvhint.schemas import Subjects

from store_helpers import insert_rows, recording_writer

NOW = 1_700_000_000.0


def _row(action_id: str, action_type: str, payload: dict[str, Any], status: str,
         blocks: int, ttl_s: float) -> dict[str, Any]:
    """An agent's action of acme/s1 on w0 as the router stores it, sent at NOW."""
    applied = blocks if status == "accepted" else 0
    return SentAction(
        action_id=action_id, message_id="m1", worker_id="w0", tenant="acme",
        session_id="s1", action_type=action_type, source="api", trigger="api",
        payload=payload, status=status, created_at=NOW, updated_at=NOW,
        requested_blocks=blocks, applied_blocks=applied, scope="agent:acme/s1",
        expires_at=NOW + ttl_s).row()


def test_a_router_restart_keeps_what_an_engine_restart_let_go(database_url: str) -> None:
    engine = create_store_engine(database_url)
    drops: list[tuple[str, int]] = []
    clock = [NOW + 1.0]
    try:
        migrate(engine)
        insert_rows(engine, workers=[{"worker_id": "w0", "url": "http://w0",
                                      "from_config": True}],
                    hint_actions=[
                        _row("pin", "kv.pin", {"target": {"session_id": "acme/s1"},
                                               "ttl_s": 600.0}, "accepted", 4, 600.0),
                        _row("pf", "kv.prefetch", {"target": {"block_hashes": [7, 8, 9]},
                                                   "deadline_s": 3600.0},
                             "deferred", 3, 3600.0)])

        def dispatcher(writer: Any = None) -> HintDispatcher:
            return HintDispatcher(None, Subjects("t"), WorkerRegistry([("w0", "http://w0")]),
                                  writer, RouterMetrics(), PlannerConfig(), seed=1,
                                  tenants=("acme",), clock=lambda: clock[0])

        def restarted() -> HintDispatcher:
            recovery = load_recovery(engine, 0.0, 10, now=clock[0])
            hints = dispatcher()
            hints.restore(recovery.learned, recovery.pending_actions, recovery.held_actions)
            return hints

        # Unchanged, a restart holds both (the Pin's 4, the Prefetch's 3 asked for).
        hints = restarted()
        assert hints.holdings.worker("w0") == Holdings(4, 3)

        async def engine_restarts() -> None:
            writer = recording_writer(engine, drops)
            hints = dispatcher(writer)
            recovery = load_recovery(engine, 0.0, 10, now=clock[0])
            hints.restore(recovery.learned, recovery.pending_actions, recovery.held_actions)
            clock[0] = NOW + 10.0
            hints.reset_worker("w0")  # a heartbeat of a new epoch
            assert hints.holdings.worker("w0") == Holdings()
            assert hints.pending["pf"].outcome_due() == NOW + 10.0 + OUTCOME_DEADLINE_S
            await writer.close()

        asyncio.run(engine_restarts())
        clock[0] = NOW + 20.0
        hints = restarted()
        assert hints.holdings.worker("w0") == hints.holdings.tenant("acme") == Holdings()
        # Waited for OUTCOME_DEADLINE_S from the router's restart, not the deadline's end.
        assert hints.expire(NOW + 20.0 + OUTCOME_DEADLINE_S - 1) == 0
        assert hints.expire(NOW + 20.0 + OUTCOME_DEADLINE_S + 1) == 1
        (record,) = hints.recent
        assert record.status == "expired" and "engine restart" in record.reason, record
        assert drops == []
    finally:
        engine.dispose()
