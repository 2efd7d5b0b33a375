"""The router's NATS side against a real NATS server: events (JetStream) feed the index,
heartbeats register workers, a sequence gap resyncs from a snapshot, an engine restart
purges, and hint outcomes come back into the store and the hints API.

The "plugin" here is this test publishing wire messages with the schemas: the gap,
epoch and snapshot paths need exact control over sequence numbers that a real engine does
not give on demand (tests/e2e/service runs the real plugin).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import nats
import pytest

from conftest import StubWorker, router_settings, running_router
from kvhint.schemas import (
    Amount,
    BlockStored,
    Budgets,
    EventBatchMeta,
    HintOutcome,
    KVEventBatch,
    OutcomeStatus,
    SnapshotBlock,
    SnapshotSession,
    Subjects,
    Usage,
    WorkerSnapshot,
    WorkerStatus,
    decode_hints,
    decode_snapshot_request,
    encode_event_batch,
    encode_outcome,
    encode_snapshot,
    encode_status,
)

ACTIONS = {"kv.pin": ["1.0"], "kv.retain": ["1.0"], "kv.demote": ["1.0"],
           "kv.share": ["1.0"], "kv.prefetch": ["1.0"]}


pytestmark = pytest.mark.usefixtures("throwaway_streams")


def status(worker: str, epoch: str, seq: int, url: str | None = None) -> bytes:
    return encode_status(WorkerStatus(
        worker_id=worker, epoch=epoch, model="tiny", cache_namespace="ns", block_size=32,
        hash_algo="sha256", none_hash_seed="vllm-none-hash", supported_actions=ACTIONS,
        budgets=Budgets(max_pinned_blocks=100, max_pin_ttl_s=600, max_retained_blocks=400,
                        max_retain_ttl_s=3600),
        usage=Usage(gpu_blocks_total=512, gpu_blocks_free=400, kv_usage=0.2),
        last_event_seq=seq, interval_s=0.5, at=time.time(), http_url=url))


def stored(hashes: list[int], parent: int | None, session: str | None) -> bytes:
    return encode_event_batch(KVEventBatch(ts=time.time(), events=[BlockStored(
        block_hashes=hashes, parent_block_hash=parent, token_ids=[1] * 32 * len(hashes),
        block_size=32, lora_id=None, medium="GPU", lora_name=None, session_id=session)]))


async def until(predicate, timeout_s: float = 10.0) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.05)


async def test_events_gap_snapshot_and_restart(tmp_path: Path, nats_url: str,
                                               subject_prefix: str,
                                               stub_workers: list[StubWorker]) -> None:
    subjects = Subjects(subject_prefix)
    stub = stub_workers[0]
    nc = await nats.connect(nats_url)
    snapshot_requests: list[int] = []
    # What the worker holds, per epoch, as its snapshot reports it.
    resident = {"e1": (5, [100, 101, 102]), "e2": (2, [50])}
    current = {"epoch": "e1"}

    async def answer_snapshot(msg) -> None:  # noqa: ANN001
        request = decode_snapshot_request(msg.data)
        snapshot_requests.append(request.cursor)
        seq, hashes = resident[current["epoch"]]
        page = WorkerSnapshot(
            worker_id="w7", epoch=current["epoch"], seq=seq, block_size=32,
            blocks=[SnapshotBlock(h, prev, "GPU") for prev, h in zip([None, *hashes], hashes)],
            sessions=[SnapshotSession("default/s", [hashes[-1]])])
        await msg.respond(encode_snapshot(page))

    await nc.subscribe(subjects.snapshot("w7"), cb=answer_snapshot)
    settings = router_settings(tmp_path, [], nats_url=nats_url, subject_prefix=subject_prefix)
    try:
        async with running_router(settings) as router:
            runtime = router.runtime
            assert await runtime.link.wait_connected(10)
            await until(lambda: runtime.link.connected and runtime.feed is not None)
            await asyncio.sleep(0.3)  # subscriptions in place
            # A worker known only from its heartbeat, with its URL: routable.
            await nc.publish(subjects.status("w7"), status("w7", "e1", 0, stub.url))
            await until(lambda: runtime.workers.get("w7") is not None
                        and runtime.workers.get("w7").plugin_alive)
            assert runtime.workers.get("w7").routable
            # In-order batches are applied.
            for seq, (hashes, parent) in enumerate([([1, 2], None), ([3], 2)], start=1):
                await nc.publish(subjects.events("w7"), stored(hashes, parent, "default/s"),
                                 headers=EventBatchMeta("w7", "e1", seq).to_headers())
            await until(lambda: runtime.index.match_prefix([1, 2, 3]).of("w7").gpu_blocks == 3)
            # A gap (seq 3 missing): resync from the snapshot, whose blocks replace the index.
            await nc.publish(subjects.events("w7"), stored([9], None, None),
                             headers=EventBatchMeta("w7", "e1", 4).to_headers())
            await until(lambda: runtime.index.match_prefix([100, 101, 102]).of("w7")
                        .gpu_blocks == 3)
            assert snapshot_requests == [0]
            assert runtime.index.match_prefix([1, 2, 3]).of("w7").gpu_blocks == 0
            # A new epoch (engine restart) purges the worker; its seq 1 starts afresh.
            current["epoch"] = "e2"
            await nc.publish(subjects.events("w7"), stored([50], None, None),
                             headers=EventBatchMeta("w7", "e2", 1).to_headers())
            await until(lambda: runtime.index.match_prefix([50]).of("w7").gpu_blocks == 1)
            assert runtime.index.match_prefix([100]).of("w7").gpu_blocks == 0
            # Malformed messages are counted, not fatal; a lost batch resyncs the worker.
            await nc.publish(subjects.events("w7"), b"\x00garbage",
                             headers=EventBatchMeta("w7", "e2", 2).to_headers())
            await nc.publish(subjects.status("w7"), b"{not json")
            await until(lambda: len(snapshot_requests) == 2)
            await asyncio.sleep(0.3)
            assert runtime.index.match_prefix([50]).of("w7").gpu_blocks == 1
            async with httpx.AsyncClient() as client:
                text = (await client.get(f"{router.url}/metrics")).text
            assert 'kvhint_router_index_ingest_total{what="malformed_messages"} 1.0' in text
            assert 'kvhint_router_index_blocks{tier="GPU",worker="w7"} 1.0' in text
            assert "kvhint_router_resyncs_total" in text
    finally:
        await nc.drain()


async def test_hints_api_forwards_and_returns_the_outcome(
        tmp_path: Path, nats_url: str, subject_prefix: str,
        stub_workers: list[StubWorker]) -> None:
    subjects = Subjects(subject_prefix)
    stub = stub_workers[0]
    nc = await nats.connect(nats_url)
    seen: list[str] = []

    async def plugin(msg) -> None:  # noqa: ANN001 - answers every action: clipped
        decoded = decode_hints(msg.data)
        for action in decoded.actions:
            seen.append(action.action_id)
            # The API's pin gets 2 blocks, the planner's own (kvh-) retain none.
            applied = Amount(2, 64) if action.action_id.startswith("kva-") else Amount(0, 0)
            await nc.publish(subjects.outcomes("w0"), encode_outcome(HintOutcome(
                message_id=decoded.message_id, action_id=action.action_id,
                action_type=action.action_type.value, worker_id="w0",
                status=OutcomeStatus.CLIPPED, reason="budget",
                requested=Amount(4, 128), applied=applied, at=time.time())))

    await nc.subscribe(subjects.hints("w0"), cb=plugin)
    settings = router_settings(tmp_path, [("w0", stub.url)], nats_url=nats_url,
                               subject_prefix=subject_prefix)
    try:
        async with running_router(settings) as router, httpx.AsyncClient() as client:
            runtime = router.runtime
            assert await runtime.link.wait_connected(10)
            await asyncio.sleep(0.3)
            await nc.publish(subjects.status("w0"), status("w0", "e1", 0))
            await until(lambda: runtime.workers.get("w0").plugin_alive)
            await client.post(f"{router.url}/v1/chat/completions", json={
                "model": "stub", "messages": [{"role": "user", "content": "x" * 400}],
                "session_id": "agent"})
            url = f"{router.url}/v1/sessions/agent/hints"
            bad = await client.post(url, json={"actions": [
                {"action_type": "kv.pin", "payload": {"ttl_s": 10}},
                {"action_type": "kv.pin", "payload": {"ttl_s": 5000}},
                {"action_type": "kv.explode", "payload": {}},
                {"action_type": "kv.pin", "payload": {"target": {"session_id": "other"}}}]})
            assert bad.status_code == 422
            reasons = [a["reason"] for a in bad.json()["error"]["actions"]]
            assert "exceeds this tenant" in reasons[0]
            assert "unsupported action_type" in reasons[1]
            assert "this session" in reasons[2]
            # The planner sends its own hint after the turn (kvh-..., published off the
            # request path, so it may land after the rejected call); the API sent nothing.
            await until(lambda: any(a.startswith("kvh-") for a in seen))
            assert [a for a in seen if a.startswith("kva-")] == []
            good = await client.post(url, json={"actions": [
                {"action_type": "kv.pin", "payload": {"ttl_s": 30}}]})
            assert good.status_code == 200, good.text
            action = good.json()["actions"][0]
            assert action["status"] == "clipped" and action["applied_blocks"] == 2
            assert action["source"] == "api" and action["action_id"] in seen
            history = (await client.get(f"{router.url}/admin/hints",
                                        params={"status": "clipped"})).json()
            assert action["action_id"] in [h["action_id"] for h in history["hints"]]
            assert {h["source"] for h in history["hints"]} == {"api", "planner"}
            detail = (await client.get(f"{router.url}/admin/sessions/default/agent")).json()
            assert {h["status"] for h in detail["hints"]} == {"clipped"}
            # The worker applied none of the planner's retain: the session is not
            # remembered as protected (its next review asks again).
            (planned,) = [h for h in detail["hints"] if h["source"] == "planner"]
            assert planned["action_type"] == "kv.retain" and planned["applied_blocks"] == 0
            assert detail["planner"]["protection"] is None
    finally:
        await nc.drain()


async def test_pending_hint_outcome_published_during_a_restart_lands(
        tmp_path: Path, nats_url: str, subject_prefix: str,
        stub_workers: list[StubWorker]) -> None:
    """A hint is pending when the router stops; the worker answers while no router runs;
    the next router (same store) recovers the pending action and reads the outcome from the
    JetStream outcomes stream."""
    subjects = Subjects(subject_prefix)
    stub = stub_workers[0]
    nc = await nats.connect(nats_url)
    held: list[tuple[str, str, str]] = []

    async def slow_plugin(msg) -> None:  # noqa: ANN001 - remembers, answers later
        decoded = decode_hints(msg.data)
        held.extend((decoded.message_id, a.action_id, a.action_type.value)
                    for a in decoded.actions)

    await nc.subscribe(subjects.hints("w0"), cb=slow_plugin)
    settings = router_settings(tmp_path, [("w0", stub.url)], nats_url=nats_url,
                               subject_prefix=subject_prefix,
                               hints={"api_outcome_timeout_s": 0.2})
    try:
        async with running_router(settings) as router, httpx.AsyncClient() as client:
            runtime = router.runtime
            assert await runtime.link.wait_connected(10)
            await asyncio.sleep(0.3)
            await nc.publish(subjects.status("w0"), status("w0", "e1", 0))
            await until(lambda: runtime.workers.get("w0").plugin_alive)
            # A first outcome, so the store holds a stream cursor to resume from.
            await client.post(f"{router.url}/v1/chat/completions", json={
                "model": "stub", "messages": [{"role": "user", "content": "y" * 300}],
                "session_id": "warm"})
            await until(lambda: len(held) >= 1)
            message_id, action_id, action_type = held.pop()
            await nc.publish(subjects.outcomes("w0"), encode_outcome(HintOutcome(
                message_id=message_id, action_id=action_id, action_type=action_type,
                worker_id="w0", status=OutcomeStatus.ACCEPTED, at=time.time())))
            await until(lambda: action_id not in runtime.hints.pending)
            await client.post(f"{router.url}/v1/chat/completions", json={
                "model": "stub", "messages": [{"role": "user", "content": "x" * 300}],
                "session_id": "agent"})
            response = await client.post(f"{router.url}/v1/sessions/agent/hints", json={
                "actions": [{"action_type": "kv.pin", "payload": {"ttl_s": 30}}]})
            assert response.status_code == 202  # no outcome within 0.2 s
            pending_id = response.json()["actions"][0]["action_id"]
            assert response.json()["actions"][0]["status"] == "pending"
        # No router now. The worker answers every action it holds.
        await until(lambda: any(a == pending_id for _m, a, _t in held))
        for message_id, action_id, action_type in held:
            await nc.publish(subjects.outcomes("w0"), encode_outcome(HintOutcome(
                message_id=message_id, action_id=action_id, action_type=action_type,
                worker_id="w0", status=OutcomeStatus.ACCEPTED, applied=Amount(3, 96),
                at=time.time())))
        async with running_router(settings) as router, httpx.AsyncClient() as client:
            runtime = router.runtime
            await until(lambda: pending_id not in runtime.hints.pending, timeout_s=15)
            rows = (await client.get(f"{router.url}/admin/hints",
                                     params={"session_id": "agent"})).json()["hints"]
            mine = next(r for r in rows if r["action_id"] == pending_id)
            assert mine["status"] == "accepted" and mine["applied_blocks"] == 3
    finally:
        await nc.drain()
