"""A turn's refresh read of a session held in memory never queues behind the tenant's
other store reads (session_reads.StoredSessions.latest).

At 32 concurrent session streams of one tenant (tests/benchmarks/service/
bench_service_overhead.py), each turn's refresh waited for one of the tenant's 2 read
slots: the read itself took 0.8 ms in its thread, but the turns waited 230 ms on
average for a slot (up to ``routing.session_read_timeout_s``, to come to ``busy``
anyway), halving kvhint's req/s against direct vLLM. Now a refresh takes a slot only if
one is free at once, else it is ``busy`` at once (counted) and the turn goes on with the
record in memory, whose save still merges."""

from __future__ import annotations

import time
from pathlib import Path

from kvhint.router.service.metrics import RouterMetrics
from kvhint.router.service.session_reads import MAX_READS_PER_TENANT, StoredSessions
from kvhint.router.store.database import create_store_engine, migrate

# Far longer than a read of a local SQLite file takes, on any machine.
TIMEOUT_S = 3.0


async def test_refresh_read_does_not_wait_for_a_slot(tmp_path: Path) -> None:
    engine = create_store_engine(f"sqlite:///{tmp_path / 'store.db'}")
    try:
        migrate(engine)
        reads = StoredSessions(engine, RouterMetrics(), TIMEOUT_S)
        # The tenant's slots, all held by its other reads under way (a first-sight read
        # waits for one, as before: row()).
        for _ in range(MAX_READS_PER_TENANT):
            await reads._slots.acquire("t")
        started = time.monotonic()
        outcome, row = await reads.latest("t", "s")
        waited = time.monotonic() - started
        assert (outcome, row) == ("busy", None)
        assert waited < TIMEOUT_S / 3, f"the refresh queued {waited:.2f}s for a slot"
        for _ in range(MAX_READS_PER_TENANT):
            reads._slots.release("t")
        # A slot free: the refresh reads (no row stored: missing).
        assert await reads.latest("t", "s") == ("missing", None)
        assert reads._slots.held == 0
    finally:
        engine.dispose()


async def test_busy_refresh_answers_without_a_trip_through_the_loop(tmp_path: Path) -> None:
    """No slot free and no read of the session under way: ``busy`` at once, the turn not
    suspended. Before, each such refresh started a task and awaited it through a shield:
    two trips through the event loop, 10-25 ms a turn at 32 session streams on the
    loaded bench machine (BENCHMARKS.md, 2026-12-05), for an answer known up front."""
    engine = create_store_engine(f"sqlite:///{tmp_path / 'store.db'}")
    try:
        migrate(engine)
        reads = StoredSessions(engine, RouterMetrics(), TIMEOUT_S)
        for _ in range(MAX_READS_PER_TENANT):
            await reads._slots.acquire("t")
        turn = reads.latest("t", "s")
        try:
            turn.send(None)  # runs the coroutine up to its first suspension, if any
        except StopIteration as done:
            assert done.value == ("busy", None)
        else:
            raise AssertionError("a refresh with no slot free waited on the event loop")
        finally:
            turn.close()
        for _ in range(MAX_READS_PER_TENANT):
            reads._slots.release("t")
        assert reads._slots.held == 0 and not reads._refreshing
    finally:
        engine.dispose()
