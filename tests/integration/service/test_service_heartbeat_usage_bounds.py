"""A heartbeat's ``usage`` out of its bounds (schemas.status ``UsageCount``/``UsageShare``):
a negative or absurd count, a ``kv_usage`` outside [0, 1]. Before, it was taken: shown on
the dashboard and the admin API, stored with the worker's row, and a negative (or absurd)
``gpu_blocks_total`` turned off the hints API's refusal of a ``prefix_tokens`` past the
worker's GPU cache (the agent's Retain of 10**30 tokens was sent). Now such a heartbeat is
malformed, as one with budgets out of bounds: dropped, counted
(``kvhint_router_index_ingest_total{what="malformed_messages"}``), the worker not heard
from it. A usage above its budget is taken (the router plans from its own ledger; refusing
the beat would have a live worker taken for dead).

Real router, real NATS (the session's server); the "plugins" are this test publishing."""

from __future__ import annotations

from pathlib import Path

import httpx
import msgspec
import nats
import pytest

from conftest import StubWorker, router_settings, running_router
from feed_helpers import plugin_registered, router_hearing_nats, status, until
from kvhint.schemas import Subjects, WireDecodeError, decode_status
from kvhint.schemas.status import MAX_BUDGET_BLOCKS

pytestmark = pytest.mark.usefixtures("throwaway_streams")

# (usage field, a value out of its bounds)
OUT_OF_BOUNDS = [("pinned_blocks", -1), ("retained_blocks", 2**60),
                 ("gpu_blocks_total", -512), ("gpu_blocks_free", MAX_BUDGET_BLOCKS + 1),
                 ("host_blocks_used", -3), ("active_requests", -1), ("pending_hints", 2**63),
                 ("indexed_blocks", 2**62), ("sessions", -7),
                 ("kv_usage", -0.5), ("kv_usage", 1.5), ("kv_usage", 1e300)]


def _beat(worker: str, url: str | None = None, **usage: object) -> bytes:
    """``worker``'s heartbeat (feed_helpers.status: budgets 100 pinned / 400 retained,
    512 GPU blocks of 32 tokens) with ``usage`` fields set as given, on the wire as is."""
    beat = msgspec.json.decode(status(worker, "e1", 0, url))
    beat["usage"].update(usage)
    return msgspec.json.encode(beat)


def test_the_usage_bounds_hold_what_a_plugin_sends() -> None:
    """What the plugin computes (engine_plugin.core_status: ``kv_usage`` is
    ``round(1 - free / total, 6)``, counts of its own pool) is inside the bounds; each
    value above is outside, named in the error."""
    for total, free in ((1, 0), (1, 1), (7, 3), (2**20, 1), (MAX_BUDGET_BLOCKS, 0)):
        usage = {"gpu_blocks_total": total, "gpu_blocks_free": free,
                 "kv_usage": round(1.0 - free / total, 6), "pinned_blocks": total}
        assert decode_status(_beat("w0", **usage)).usage.kv_usage == usage["kv_usage"]
    for field, value in OUT_OF_BOUNDS:
        with pytest.raises(WireDecodeError, match=rf"worker status.*usage\.{field}"):
            decode_status(_beat("w0", **{field: value}))


async def test_a_heartbeat_with_usage_out_of_bounds_is_malformed_and_counted(
        tmp_path: Path, nats_url: str, subject_prefix: str) -> None:
    subjects = Subjects(subject_prefix)
    async with router_hearing_nats(tmp_path, nats_url, subject_prefix) as (router, client, nc):
        runtime = router.runtime
        for i, (field, value) in enumerate(OUT_OF_BOUNDS):
            await nc.publish(subjects.status(f"w{i}"), _beat(f"w{i}", **{field: value}))
        await until(lambda: runtime.ingestor.stats().malformed_messages == len(OUT_OF_BOUNDS))
        # Above its budget (100 pinned, 400 retained) is not out of bounds: taken.
        await nc.publish(subjects.status("ok"), _beat("ok", pinned_blocks=150,
                                                       retained_blocks=900))
        await until(lambda: runtime.workers.get("ok") is not None)
        assert [w.worker_id for w in runtime.workers.all()] == ["ok"]  # no other heard
        assert runtime.ingestor.stats().malformed_messages == len(OUT_OF_BOUNDS)
        text = (await client.get(f"{router.url}/metrics")).text
        assert ('kvhint_router_index_ingest_total{what="malformed_messages"} '
                f'{float(len(OUT_OF_BOUNDS))}') in text


async def test_a_negative_pool_no_longer_turns_off_the_prefix_tokens_check(
        tmp_path: Path, nats_url: str, subject_prefix: str,
        stub_workers: list[StubWorker]) -> None:
    """w0 heard with its 512 blocks of 32 tokens, then a heartbeat saying -1 GPU blocks:
    before, it became w0's status, and an agent's Retain of 10**30 prefix tokens passed
    the hints API's check (a pool of no size is not checked) and was sent. Now that beat
    is malformed, w0 keeps its last status, and the Retain is refused (422)."""
    subjects = Subjects(subject_prefix)
    nc = await nats.connect(nats_url)
    config = router_settings(tmp_path, [("w0", stub_workers[0].url)], nats_url=nats_url,
                             subject_prefix=subject_prefix)
    try:
        async with running_router(config) as router, httpx.AsyncClient(timeout=30) as client:
            runtime = router.runtime
            await plugin_registered(runtime, nc, subjects)
            response = await client.post(f"{router.url}/v1/chat/completions", json={
                "model": "stub", "session_id": "s",
                "messages": [{"role": "user", "content": "s: " + "x" * 400}]})
            assert response.status_code == 200, response.text
            await nc.publish(subjects.status("w0"), _beat("w0", gpu_blocks_total=-1))
            await until(lambda: runtime.ingestor.stats().malformed_messages == 1)
            assert runtime.workers.get("w0").status.usage.gpu_blocks_total == 512
            refused = await client.post(f"{router.url}/v1/sessions/s/hints", json={
                "actions": [{"action_type": "kv.retain",
                             "payload": {"target": {"prefix_tokens": 10**30}}}]})
            assert refused.status_code == 422, refused.text
            assert "is more than the 16384 tokens" in refused.text
    finally:
        await nc.drain()
