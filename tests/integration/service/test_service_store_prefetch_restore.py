"""A router restart rebuilds the Prefetches its workers still retain, on SQLite and
PostgreSQL: an answered Prefetch (accepted or clipped) retains what it applied until its
deadline (engine_plugin/prefetch.py), each as a claim of its own, and the restarted
router's ledger counts them as the router before the restart did, until the same ends.

Before, recovery read back only Pins and Retains (reader.HOLDING_TYPES): after a restart
the workers' and tenants' budgets (and ``max_worker_share``) believed free the blocks
every live Prefetch still held."""

from __future__ import annotations

import asyncio
from typing import Any

from kvhint.router.policy import Holdings, PlannerConfig
from kvhint.router.service.hint_dispatch import HintDispatcher, SentAction
from kvhint.router.service.metrics import RouterMetrics
from kvhint.router.service.workers import WorkerRegistry
from kvhint.router.store.database import create_store_engine, migrate
from kvhint.router.store.reader import load_recovery
from kvhint.schemas import Amount, HintOutcome, OutcomeStatus, Subjects

from store_helpers import insert_rows, recording_writer

NOW = 1_700_000_000.0


def _prefetch(action_id: str, target: dict[str, Any], deadline_s: float, sent_ago: float,
              blocks: int, source: str = "planner", session: str = "s1") -> dict[str, Any]:
    """A Prefetch's row as the router writes it when it sends one (hint_send: its scope,
    and its end at the deadline), waiting for the worker's answer."""
    sent = NOW - sent_ago
    return SentAction(
        action_id=action_id, message_id="m1", worker_id="w0", tenant="acme",
        session_id=session, action_type="kv.prefetch", source=source,
        trigger="moved:prefetch", payload={"target": target, "deadline_s": deadline_s},
        status="deferred", created_at=sent, updated_at=sent, requested_blocks=blocks,
        scope=f"acme/{session}", expires_at=sent + deadline_s).row()


def _answer(action_id: str, status: OutcomeStatus, requested: int, applied: int
            ) -> HintOutcome:
    return HintOutcome(message_id="m1", action_id=action_id, action_type="kv.prefetch",
                       worker_id="w0", status=status, reason="", requested=Amount(requested),
                       applied=Amount(applied), at=NOW)


# (at, retained on the worker): a Prefetch of acme/s1 applied 4 blocks until NOW + 20 and
# a second one of it 6 until NOW + 5 (the session's blocks, counted once: 6, then the
# first's 4); one by block hashes clipped to 2 until NOW + 50; one a router of the first
# schema sent (no scope, no expires_at) applied 3 until NOW + 30.
EXPECTED = [(NOW, 6 + 2 + 3), (NOW + 4.9, 6 + 2 + 3), (NOW + 5.0, 4 + 2 + 3),
            (NOW + 20.0, 2 + 3), (NOW + 30.0, 2), (NOW + 50.0, 0)]


def test_a_restart_restores_the_prefetches_still_retained(database_url: str) -> None:
    engine = create_store_engine(database_url)
    drops: list[tuple[str, int]] = []
    clock = [NOW - 1.0]
    try:
        migrate(engine)
        session = {"session_id": "acme/s1"}
        legacy = _prefetch("legacy", {"session_id": "acme/s4"}, 40.0, 10.0, 3,
                           session="s4") | {
            "scope": None, "expires_at": None, "status": "accepted", "applied_blocks": 3}
        insert_rows(engine, workers=[{"worker_id": "w0", "url": "http://w0",
                                      "from_config": True}],
                    hint_actions=[
                        _prefetch("p1", session, 30.0, 10.0, 4),
                        _prefetch("p2", session, 10.0, 5.0, 6),
                        _prefetch("hashes", {"block_hashes": [21, 22, 23]}, 60.0, 10.0, 3,
                                  source="api", session="s2"),
                        _prefetch("missing", {"session_id": "acme/s3"}, 30.0, 10.0, 5,
                                  session="s3"),
                        _prefetch("late", {"session_id": "acme/s5"}, 5.0, 10.0, 5,
                                  session="s5")])

        def dispatcher(writer: Any = None) -> HintDispatcher:
            return HintDispatcher(None, Subjects("t"), WorkerRegistry([("w0", "http://w0")]),
                                  writer, RouterMetrics(), PlannerConfig(), seed=1,
                                  tenants=("acme",), clock=lambda: clock[0])

        async def before_restart() -> None:
            """The router before the restart: its Prefetches answered, the rows saved."""
            writer = recording_writer(engine, drops)
            hints = dispatcher(writer)
            recovery = load_recovery(engine, 0.0, 10, now=clock[0])
            hints.restore([], recovery.pending_actions, recovery.held_actions)
            for answer in (_answer("p1", OutcomeStatus.ACCEPTED, 4, 4),
                           _answer("p2", OutcomeStatus.ACCEPTED, 6, 6),
                           _answer("hashes", OutcomeStatus.CLIPPED, 3, 2),
                           _answer("missing", OutcomeStatus.MISSING, 5, 0)):
                assert hints.on_outcome(answer) is not None
            # Past its deadline (NOW - 5): it retains nothing.
            hints.on_outcome(_answer("late", OutcomeStatus.CLIPPED, 5, 1))
            assert hints.holdings.worker("w0") == Holdings(0, 6 + 2)
            await writer.close()

        asyncio.run(before_restart())
        # A router of the first schema, sharing the store, answered one too.
        insert_rows(engine, hint_actions=[legacy])
        clock[0] = NOW
        recovery = load_recovery(engine, 0.0, 10, now=NOW)
        assert sorted((row["action_id"], row["scope"], row["expires_at"])
                      for row in recovery.held_actions) == [
            ("hashes", "acme/s2", NOW + 50.0), ("legacy", "acme/s4", NOW + 30.0),
            ("p1", "acme/s1", NOW + 20.0), ("p2", "acme/s1", NOW + 5.0)]
        assert recovery.pending_actions == []
        hints = dispatcher()
        hints.restore(recovery.learned, recovery.pending_actions, recovery.held_actions)
        holdings = hints.holdings
        for at, retained in EXPECTED:
            holdings.expire(at)
            assert holdings.worker("w0") == Holdings(0, retained), at - NOW
            assert holdings.tenant("acme") == Holdings(0, retained), at - NOW
        assert len(holdings) == 0 and drops == []
    finally:
        engine.dispose()
