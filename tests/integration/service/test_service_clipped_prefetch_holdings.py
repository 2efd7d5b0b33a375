"""The router's holdings ledger counts what a clipped Prefetch retains on its worker until
its deadline, as the worker does (engine_plugin/prefetch.py): what was in G1 already when
the prefetch budget left no room to wait, and the blocks a budget-clipped one waited for
once they came. Before, a clipped Prefetch counted as holding nothing, and the budgets
(per worker, per tenant, max_worker_share) believed that room free until the deadline.
One clipped at its deadline retains nothing, and holds nothing here either. One whose
wait the budget clipped is reserved, while it waits, at the blocks it waits for only.

End to end: the real router app and NATS, and the real plugin's HintCore on vLLM's real
Scheduler and block pool answering w0's hints (the test carries w0's hints to it and its
outcomes back; w0's heartbeat is played, as in the other service tests)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import nats
import pytest

from conftest import StubWorker, router_settings, running_router
from feed_helpers import plugin_on_nats, plugin_registered, status, until
from kvhint.engine_plugin.headless import (
    HeadlessSchedulerSpec,
    build_scheduler,
    tokens_for_block_ids,
)
from kvhint.router.policy import Holdings
from kvhint.schemas import Subjects

pytestmark = pytest.mark.usefixtures("throwaway_streams")

BS = 32


async def test_a_clipped_prefetch_holds_what_the_worker_retains(
        tmp_path: Path, nats_url: str, subject_prefix: str,
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

    answer = await plugin_on_nats(nc, subjects, core)
    settings = router_settings(
        tmp_path, [("w0", stub_workers[0].url)], nats_url=nats_url,
        subject_prefix=subject_prefix, hints={"enabled": False})
    try:
        async with running_router(settings) as router, \
                httpx.AsyncClient(timeout=30) as client:
            runtime = router.runtime
            ledger = runtime.hints.holdings
            await plugin_registered(runtime, nc, subjects, core.supported_actions())
            # One session each: the ledger keeps one Prefetch holding per session and
            # worker (the plugin keeps each Prefetch's retain apart).
            for session in ("s1", "s2", "s3"):
                turn = await client.post(f"{router.url}/v1/chat/completions", json={
                    "model": "stub", "session_id": session,
                    "messages": [{"role": "user", "content": f"{session}: " + "x" * 400}]})
                assert turn.status_code == 200, turn.text

            beats = iter(range(1, 100))

            async def prefetch(session: str, name: str, hashes: list[int],
                               deadline_s: float) -> dict:
                # w0's heartbeat again (a deferred answer is waited for wait_s).
                await nc.publish(subjects.status("w0"), status(
                    "w0", "e1", next(beats), actions=core.supported_actions()))
                await until(lambda: runtime.workers.get("w0").plugin_alive)
                sent = await client.post(f"{router.url}/v1/sessions/{session}/hints", json={
                    "actions": [{"action_type": "kv.prefetch", "action_id": name,
                                 "payload": {"target": {"block_hashes": hashes},
                                             "deadline_s": deadline_s}}], "wait_s": 1})
                assert sent.status_code in (200, 202), sent.text  # answered / waiting
                (action,) = sent.json()["actions"]
                return action

            # Past the budget: waits for its first 3 blocks (all in G1 already).
            waited = await prefetch("s1", "waited", [*r[:3], 9001], 300)
            assert waited["status"] == "deferred", waited
            # Its deferred says so (outcome 1.1 waits_for): it is reserved at the 3 it can
            # hold, not the 4 it asked for (before: Holdings(0, 4) until it settled).
            assert ledger.worker("w0") == ledger.tenant("default") == Holdings(0, 3)
            # No room left to wait: the 2 of its blocks in G1 are retained at once.
            no_room = await prefetch("s2", "no-room", [r[3], r[4], 9002], 300)
            assert (no_room["status"], no_room["applied_blocks"]) == ("clipped", 2), no_room
            assert core.executor.retained_blocks == 2
            # Before: 0 here, the clipped one's 2 retained blocks believed free.
            assert no_room["action_id"] in ledger
            await answer(core.advance())  # the waited-for blocks are in G1: settled
            await until(lambda: waited["action_id"] not in runtime.hints.pending)
            (record,) = [a for a in runtime.hints.recent
                         if a.action_id == waited["action_id"]]
            assert (record.status, record.applied_blocks) == ("clipped", 3), record
            assert core.executor.retained_blocks == 5
            # Before: Holdings() (both clipped ones dropped from the ledger).
            assert ledger.worker("w0") == ledger.tenant("default") == Holdings(0, 5)

            # One clipped at its deadline (1 of its 2 blocks in G1) retains nothing.
            late = await prefetch("s3", "late", [r[5], 9003], 0.3)
            assert late["status"] == "deferred", late
            await asyncio.sleep(0.5)
            await answer(core.advance())
            await until(lambda: late["action_id"] not in runtime.hints.pending)
            (record,) = [a for a in runtime.hints.recent if a.action_id == late["action_id"]]
            assert (record.status, record.applied_blocks) == ("clipped", 1), record
            assert late["action_id"] not in ledger
            assert core.executor.retained_blocks == 5
            assert ledger.worker("w0") == Holdings(0, 5)
    finally:
        await nc.drain()
        h.connector.shutdown()
