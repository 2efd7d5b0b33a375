"""A worker's answer's ``waits_for`` and ``at`` reach the action's row (revision 0008) and
a restart reads them back, on SQLite and PostgreSQL: a deferred Prefetch whose wait was
clipped is restored at the blocks it waits for, and a worker's new epoch, heard after the
restart, keeps it when the new engine gave that answer (HintDispatcher.reset_worker).
Another replica's action's row gets both too (its router restores from it).

Before, neither was stored: the restored Prefetch held all it asked for, and the new
epoch let it go though its engine waited on it. The router app's restart path runs these
same calls (runtime.RouterRuntime.start: load_recovery, then restore); see
test_service_restart_engine_answers.py and test_service_restart_clipped_prefetch.py for
the whole router."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec

from kvhint.router.policy import Holdings, PlannerConfig
from kvhint.router.service.hint_dispatch import HintDispatcher, SentAction
from kvhint.router.service.hint_records import MAX_STORED_AMOUNT, clamped_amounts
from kvhint.router.service.metrics import RouterMetrics
from kvhint.router.service.workers import WorkerRegistry
from kvhint.router.store.database import create_store_engine, migrate
from kvhint.router.store.reader import load_recovery, query_hints
from kvhint.schemas import Amount, HintOutcome, OutcomeStatus, Subjects, new_epoch

from store_helpers import insert_rows, recording_writer

NOW = 1_700_000_000.0


def _prefetch_row(action_id: str, hashes: list[int]) -> dict[str, Any]:
    """An agent's Prefetch of 4 blocks (``hashes``) on w0, sent at NOW, not answered yet."""
    return SentAction(
        action_id=action_id, message_id="m1", worker_id="w0", tenant="acme",
        session_id="s1", action_type="kv.prefetch", source="api", trigger="api",
        payload={"target": {"block_hashes": hashes}, "deadline_s": 3600.0},
        status="pending", created_at=NOW, updated_at=NOW, requested_blocks=4,
        scope="agent:acme/s1", expires_at=NOW + 3600.0).row()


def _deferred(action_id: str, at: float) -> HintOutcome:
    """w0's engine waits for the first 2 of the Prefetch's 4 blocks (its budget clipped)."""
    return HintOutcome(message_id="m1", action_id=action_id, action_type="kv.prefetch",
                       worker_id="w0", status=OutcomeStatus.DEFERRED,
                       requested=Amount(4, 128), at=at, waits_for=Amount(2, 64))


def test_a_restart_reads_back_the_answers_wait_and_time(database_url: str) -> None:
    engine = create_store_engine(database_url)
    drops: list[tuple[str, int]] = []
    clock = [NOW + 1.0]
    engine_started = NOW + 0.5  # w0's new engine, which answers; unheard before restart
    try:
        migrate(engine)
        insert_rows(engine, workers=[{"worker_id": "w0", "url": "http://w0",
                                      "from_config": True}],
                    hint_actions=[_prefetch_row("pf", [1, 2, 3, 4])])

        def restarted(writer: Any = None) -> HintDispatcher:
            recovery = load_recovery(engine, 0.0, 10, now=clock[0])
            hints = HintDispatcher(None, Subjects("t"), WorkerRegistry([("w0", "http://w0")]),
                                   writer, RouterMetrics(), PlannerConfig(), seed=1,
                                   tenants=("acme",), clock=lambda: clock[0])
            hints.restore(recovery.learned, recovery.pending_actions, recovery.held_actions)
            return hints

        async def answered() -> None:
            writer = recording_writer(engine, drops)
            hints = restarted(writer)
            # Another replica's action (not this router's to restore or settle).
            insert_rows(engine, hint_actions=[_prefetch_row("other", [5, 6, 7, 8])])
            assert hints.holdings.worker("w0") == Holdings(0, 4)
            for action_id in ("pf", "other"):
                hints.on_outcome(hints.effective(_deferred(action_id, NOW + 1.0)))
            assert hints.holdings.worker("w0") == Holdings(0, 2)
            await writer.close()

        asyncio.run(answered())
        rows = {row["action_id"]: row for row in query_hints(engine)}
        for action_id in ("pf", "other"):
            assert (rows[action_id]["status"], rows[action_id]["waits_for_blocks"],
                    rows[action_id]["answered_at"]) == ("deferred", 2, NOW + 1.0)

        clock[0] = NOW + 20.0
        hints = restarted()
        # Before: Holdings(0, 8), each held at the 4 it asked for.
        assert hints.holdings.worker("w0") == hints.holdings.tenant("acme") == Holdings(0, 4)
        hints.reset_worker("w0", new_epoch(engine_started))
        # The new engine gave both answers: both stay. Before: Holdings().
        assert hints.holdings.worker("w0") == Holdings(0, 4)
        assert [r.release_reason for r in hints.pending.values()] == [None, None]
        # An older engine's answer (before this epoch started) is let go, as before.
        hints.reset_worker("w0", new_epoch(NOW + 5.0))
        assert hints.holdings.worker("w0") == Holdings()
        assert drops == []
    finally:
        engine.dispose()


def test_a_waits_for_past_the_stores_column_is_held_to_it(database_url: str) -> None:
    """``waits_for_blocks`` is a 32-bit column, as ``requested_blocks`` is: a deferred
    whose ``waits_for`` is past it (a plugin echoing an unbounded target) is held to
    MAX_STORED_AMOUNT with its other amounts (cluster_feed: counted as
    ``outcome_amount_clamped``), and its row is written. Unclamped, the store refused
    the row (``store_row_rejected``) and the action's history was lost."""
    engine = create_store_engine(database_url)
    drops: list[tuple[str, int]] = []
    huge = Amount(6 * 10**28, 10**30)
    try:
        migrate(engine)
        insert_rows(engine, workers=[{"worker_id": "w0", "url": "http://w0",
                                      "from_config": True}],
                    hint_actions=[_prefetch_row("pf", [1, 2, 3, 4])])
        outcome = msgspec.structs.replace(_deferred("pf", NOW + 1.0), requested=huge,
                                          waits_for=huge)
        clamped = clamped_amounts(outcome)
        assert clamped is not None
        assert clamped.waits_for == clamped.requested == Amount(MAX_STORED_AMOUNT,
                                                                MAX_STORED_AMOUNT)
        assert clamped_amounts(_deferred("pf", NOW + 1.0)) is None

        async def answered() -> None:
            writer = recording_writer(engine, drops)
            recovery = load_recovery(engine, 0.0, 10, now=NOW + 1.0)
            hints = HintDispatcher(None, Subjects("t"), WorkerRegistry([("w0", "http://w0")]),
                                   writer, RouterMetrics(), PlannerConfig(), seed=1,
                                   tenants=("acme",), clock=lambda: NOW + 1.0)
            hints.restore(recovery.learned, recovery.pending_actions, recovery.held_actions)
            hints.on_outcome(hints.effective(clamped))
            await writer.close()

        asyncio.run(answered())
        assert drops == []
        (row,) = query_hints(engine)
        assert (row["status"], row["waits_for_blocks"]) == ("deferred", MAX_STORED_AMOUNT)
    finally:
        engine.dispose()
