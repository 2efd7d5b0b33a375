"""One tenant's burst of session reads leaves a read slot to every other tenant's
(session_reads.MAX_READS_PER_TENANT; tenancy review).

A turn, an end (``DELETE /v1/sessions/{id}``) or a hints call of a session id the router
holds no record of first reads the session's stored row, through a few read slots every
tenant shares. Before, one tenant's client key sending a few hundred DELETEs of ids never
used queued that many reads ahead of every other tenant's: another tenant's turn of its
stored session (another replica's, or one forgotten here) read nothing within
``routing.session_read_timeout_s`` and started a blank record, whose first save wrote
over the stored row (its turns, gaps and planner state lost). Measured through the HTTP
API on the review's machine: 600 such DELETEs from tenant a, 10 turns of b's stored
sessions meanwhile: 7 and 9 of the 10 restarted at turn 1; none after."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx

from conftest import StubWorker, router_settings, running_router
from kvhint.router.service.session_reads import StoredSessions

# Far more reads than the slots can serve within the timeout below, on any machine.
BURST = 3000
TIMEOUT_S = 0.2


async def test_one_tenants_burst_of_reads_leaves_another_tenant_a_slot(
        tmp_path: Path, stub_workers: list[StubWorker], database_url: str) -> None:
    settings = router_settings(
        tmp_path, [("w0", stub_workers[0].url)], database_url=database_url,
        tenants=[{"name": "a", "api_keys": ["ka"]}, {"name": "b", "api_keys": ["kb"]}])
    async with running_router(settings) as router, httpx.AsyncClient(timeout=30) as client:
        answer = await client.post(f"{router.url}/v1/chat/completions", json={
            "model": "stub", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4, "session_id": "kept"}, headers={"authorization": "Bearer kb"})
        assert answer.status_code == 200, answer.text
        await router.runtime.writer.flush()
        # The router's own engine and metrics: the reads a turn, an end or a hints call
        # of an unseen id makes (lifecycle.recall).
        reads = StoredSessions(router.runtime.engine, router.runtime.metrics, TIMEOUT_S)
        burst = [asyncio.ensure_future(reads.row("a", f"never-{n}")) for n in range(BURST)]
        await asyncio.sleep(0)  # the burst's reads are all waiting for slots now
        row = await reads.row("b", "kept")
        assert row is not None and row["turns"] == 1, \
            "b's read waited behind a's burst and read nothing"
        await asyncio.gather(*burst)  # a's: most given up ("busy"), its own loss
        await asyncio.sleep(0.5)  # the reads given up on end in their threads
        assert reads._slots.tenants == 0  # each tenant's entry goes with its last read
