"""A Prefetch whose wait its worker's prefetch budget clipped (its ``deferred`` answer's
outcome 1.1 ``waits_for``) is reserved at the blocks it waits for, not all it asked for,
after a router restart too: the store keeps ``waits_for_blocks`` (revision 0008), and the
restore holds the waiting Prefetch at it (SentAction.still_held).

Before, it was not stored: the restarted router reserved the Prefetch's whole ask again
until it settled or its deadline came, and the budgets (the worker's, the tenant's, its
worker share) could refuse room (a 429) the worker could never fill.

End to end, on SQLite and PostgreSQL: the real router app restarted on the same store and
NATS, and the real plugin's HintCore on vLLM's real Scheduler and block pool answering
w0's hints (its heartbeat is played, as in the other service tests)."""

from __future__ import annotations

from pathlib import Path

import httpx
import nats
import pytest

from conftest import StubWorker, router_settings, running_router
from feed_helpers import plugin_on_nats, plugin_registered, until
from kvhint.engine_plugin.headless import (
    HeadlessSchedulerSpec,
    build_scheduler,
    tokens_for_block_ids,
)
from kvhint.router.policy import Holdings
from kvhint.schemas import Subjects

pytestmark = pytest.mark.usefixtures("throwaway_streams")

BS = 32


async def test_a_restart_reserves_a_clipped_prefetch_at_what_it_waits_for(
        tmp_path: Path, database_url: str, nats_url: str, subject_prefix: str,
        stub_workers: list[StubWorker]) -> None:
    subjects = Subjects(subject_prefix)
    h = build_scheduler(HeadlessSchedulerSpec(
        block_size=BS, num_blocks=64, connector_module="kvhint.engine_plugin.connector",
        connector_extra_config={"worker_id": "w0",
                                "prefetch_budget_fraction": 0.05}))  # 3 blocks may wait
    core = h.connector.core
    assert core.executor.max_prefetch_blocks == 3
    h.run(h.make_request(tokens_for_block_ids(range(1, 7), BS) + [3] * 5,
                         session_id="engine"))
    r = core.index.session_blocks("engine")[:6]  # resident in G1, held by nothing
    nc = await nats.connect(nats_url)
    await plugin_on_nats(nc, subjects, core)
    settings = router_settings(
        tmp_path, [("w0", stub_workers[0].url)], nats_url=nats_url,
        subject_prefix=subject_prefix, database_url=database_url, hints={"enabled": False})
    try:
        async with running_router(settings) as router, \
                httpx.AsyncClient(timeout=30) as client:
            runtime = router.runtime
            await plugin_registered(runtime, nc, subjects, core.supported_actions())
            turn = await client.post(f"{router.url}/v1/chat/completions", json={
                "model": "stub", "session_id": "s1",
                "messages": [{"role": "user", "content": "s1: " + "x" * 400}]})
            assert turn.status_code == 200, turn.text
            # Past the budget: it waits for its first 3 blocks (in G1 already), not 4.
            sent = await client.post(f"{router.url}/v1/sessions/s1/hints", json={
                "actions": [{"action_type": "kv.prefetch", "action_id": "waited",
                             "payload": {"target": {"block_hashes": [*r[:3], 9001]},
                                         "deadline_s": 300}}], "wait_s": 1})
            assert sent.status_code == 202, sent.text
            (waited,) = sent.json()["actions"]
            assert waited["status"] == "deferred", waited
            ledger = runtime.hints.holdings
            assert ledger.worker("w0") == ledger.tenant("default") == Holdings(0, 3)

        # The router restarts (the Prefetch still waits on w0; nothing answered since).
        async with running_router(settings) as router:
            runtime = router.runtime
            assert waited["action_id"] in runtime.hints.pending
            record = runtime.hints.pending[waited["action_id"]]
            assert (record.status, record.waits_for_blocks) == ("deferred", 3), record
            ledger = runtime.hints.holdings
            # Before: Holdings(0, 4), the whole ask reserved until it settled.
            assert ledger.worker("w0") == ledger.tenant("default") == Holdings(0, 3)
            await plugin_registered(runtime, nc, subjects, core.supported_actions())
            await until(lambda: runtime.workers.get("w0").plugin_alive)
            assert ledger.worker("w0") == Holdings(0, 3)
    finally:
        await nc.drain()
        h.connector.shutdown()
