"""One tenant's burst of Responses follow-ups leaves a store-read slot to every other
tenant's (responses_sessions.MAX_READS_PER_TENANT; tenancy review).

A follow-up naming no session, of a stored response this replica does not hold (another
replica's, from before a restart, forgotten), reads the response's session from the
store through a few slots every tenant shares; with none free it is ``busy`` at once and
continues no session. Before, one tenant's burst of such follow-ups held all 4 slots and
every other tenant's follow-up meanwhile lost its session (its turns, tool gaps and
learning went with it). Real SQLite and PostgreSQL: the store reads are the router's."""

from __future__ import annotations

import asyncio
from pathlib import Path

from conftest import StubWorker, router_settings, running_router
from feed_helpers import until

from kvhint.router.service.responses_sessions import ResponseSessions

BURST = 50


async def test_one_tenants_burst_of_follow_ups_leaves_another_tenant_a_slot(
        tmp_path: Path, stub_workers: list[StubWorker], database_url: str) -> None:
    settings = router_settings(
        tmp_path, [("w0", stub_workers[0].url)], database_url=database_url,
        tenants=[{"name": "a", "api_keys": ["ka"]}, {"name": "b", "api_keys": ["kb"]}])
    async with running_router(settings) as router:
        runtime = router.runtime
        # The router's own engine, writer and metrics: the reads responses_api makes.
        reads = ResponseSessions(runtime.engine, runtime.writer, runtime.metrics, 5.0)
        reads.remember("resp_b", "b", "b-session")
        await runtime.writer.flush()
        burst = [asyncio.ensure_future(reads.session_of(f"resp_a{n}", "a"))
                 for n in range(BURST)]
        await asyncio.sleep(0)  # a's reads have taken every slot they may (4 before; 3 now)
        assert await reads.session_of("resp_b", "b") == "b-session", \
            "b's follow-up found every slot taken by a's burst and lost its session"
        assert await asyncio.gather(*burst) == [None] * BURST  # a's own loss: "busy"
        await until(lambda: reads.in_flight == 0)
        assert reads.tenants_reading == 0  # each tenant's entry goes with its last read
