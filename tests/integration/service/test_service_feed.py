"""The router's NATS side against a real NATS server: events (JetStream) feed the index,
heartbeats register workers, a sequence gap resyncs from a snapshot, an engine restart
purges, and hint outcomes come back into the store and the hints API (what the router
believes its hints hold: test_service_holdings.py).

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
from feed_helpers import chat, plugin_registered, router_hearing_nats, status, stored, until
from kvhint.schemas import (
    Amount,
    EventBatchMeta,
    HintOutcome,
    OutcomeStatus,
    SnapshotBlock,
    SnapshotSession,
    Subjects,
    WorkerSnapshot,
    decode_hints,
    decode_snapshot_request,
    encode_outcome,
    encode_snapshot,
)

pytestmark = pytest.mark.usefixtures("throwaway_streams")


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
            # Set up: wait_connected comes before the subscriptions and streams.
            assert await runtime.link.wait_set_up(10)
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


async def test_a_snapshot_reply_naming_another_worker_is_dropped_and_counted(
        tmp_path: Path, nats_url: str, subject_prefix: str) -> None:
    """w7's snapshot subject answered by a plugin that calls itself w8: the page would
    have overwritten w8's resync and index; it is dropped, counted, and w7's asked again."""
    subjects = Subjects(subject_prefix)
    nc = await nats.connect(nats_url)
    asked: list[int] = []

    async def impostor(msg) -> None:  # noqa: ANN001
        asked.append(decode_snapshot_request(msg.data).cursor)
        await msg.respond(encode_snapshot(WorkerSnapshot(
            worker_id="w8", epoch="e1", seq=2, block_size=32,
            blocks=[SnapshotBlock(5, None, "GPU")], sessions=[])))

    await nc.subscribe(subjects.snapshot("w7"), cb=impostor)
    settings = router_settings(tmp_path, [], nats_url=nats_url, subject_prefix=subject_prefix)
    try:
        async with running_router(settings) as router, httpx.AsyncClient() as client:
            runtime = router.runtime
            # Set up: wait_connected comes before the subscriptions and streams.
            assert await runtime.link.wait_set_up(10)
            deadline = time.monotonic() + 10
            while len(asked) < 2 and time.monotonic() < deadline:  # heartbeats kept up
                await nc.publish(subjects.status("w7"), status("w7", "e1", 2))
                await asyncio.sleep(0.3)
            assert len(asked) >= 2  # the first reply dropped, then w7 asked again
            assert runtime.index.stats().entries == 0 and "w8" not in runtime.index.worker_ids()
            text = (await client.get(f"{router.url}/metrics")).text
            assert 'kvhint_router_drops_total{what="snapshot_wrong_worker"}' in text
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
            await plugin_registered(runtime, nc, subjects)
            await chat(client, router.url, "agent", "x" * 400)
            url = f"{router.url}/v1/sessions/agent/hints"
            bad = await client.post(url, json={"actions": [
                {"action_type": "kv.pin", "payload": {"ttl_s": 10}},
                {"action_type": "kv.pin", "payload": {"ttl_s": 5000}},
                {"action_type": "kv.explode", "payload": {}},
                {"action_type": "kv.pin", "payload": {"target": {"session_id": "other"}}},
                # Already expired: the worker would only reject it.
                {"action_type": "kv.pin", "payload": {"ttl_s": 10, "expires_at": 1.0}}]})
            assert bad.status_code == 422
            reasons = [a["reason"] for a in bad.json()["error"]["actions"]]
            assert "exceeds this tenant" in reasons[0]
            assert "unsupported action_type" in reasons[1]
            assert "this session" in reasons[2]
            assert "expires_at=1.0 has passed" in reasons[3]
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
            # A Retain without ttl_s is held by the worker for its max_retain_ttl_s (3,600 s
            # here): the tenant's budget counts it that long, not until the next tick.
            retain = await client.post(url, json={"actions": [
                {"action_type": "kv.retain", "payload": {"priority": 40}}]})
            assert retain.json()["actions"][0]["applied_blocks"] == 2
            runtime.hints.expire(time.time() + 60)
            assert runtime.hints.holdings.tenant("default").retained_blocks == 2
    finally:
        await nc.drain()


async def test_hints_api_waits_for_the_first_heartbeat_after_the_router_starts(
        tmp_path: Path, nats_url: str, subject_prefix: str,
        stub_workers: list[StubWorker]) -> None:
    """A router that just started has heard no plugin yet: an agent's hints call waits for
    the worker's first heartbeat (it answered 503 until then); a worker still unheard
    when the wait is over gets 503 with Retry-After; a worker the router does not know
    is a 404, not a wait."""
    subjects = Subjects(subject_prefix)
    nc = await nats.connect(nats_url)

    async def plugin(msg) -> None:  # noqa: ANN001 - accepts every action whole
        worker = msg.subject.rsplit(".", 1)[1]
        decoded = decode_hints(msg.data)
        for action in decoded.actions:
            await nc.publish(subjects.outcomes(worker), encode_outcome(HintOutcome(
                message_id=decoded.message_id, action_id=action.action_id,
                action_type=action.action_type.value, worker_id=worker,
                status=OutcomeStatus.ACCEPTED, requested=Amount(2, 64),
                applied=Amount(2, 64), at=time.time())))

    for worker in ("w0", "w1"):
        await nc.subscribe(subjects.hints(worker), cb=plugin)
    settings = router_settings(tmp_path, [(f"w{i}", stub.url) for i, stub in enumerate(
        stub_workers)], nats_url=nats_url, subject_prefix=subject_prefix,
        hints={"api_heartbeat_wait_s": 8.0})
    pin = {"actions": [{"action_type": "kv.pin", "payload": {"ttl_s": 30}}]}
    try:
        async with running_router(settings) as router, httpx.AsyncClient(timeout=30) as client:
            runtime = router.runtime
            # Set up: wait_connected comes before the subscriptions and streams.
            assert await runtime.link.wait_set_up(10)
            await chat(client, router.url, "agent", "x" * 400)
            await until(lambda: runtime.sessions.get("default", "agent") is not None
                        and runtime.sessions.get("default", "agent").worker_id is not None)
            worker_id = runtime.sessions.get("default", "agent").worker_id
            other = "w1" if worker_id == "w0" else "w0"
            url = f"{router.url}/v1/sessions/agent/hints"
            assert runtime.workers.get(worker_id).status is None

            async def first_heartbeat() -> None:
                await asyncio.sleep(0.5)
                await nc.publish(subjects.status(worker_id), status(worker_id, "e1", 0))

            waited, _ = await asyncio.gather(client.post(url, json=pin), first_heartbeat())
            assert waited.status_code == 200, waited.text
            assert waited.json()["actions"][0]["status"] == "accepted"
            # The other worker never heartbeats: once the start-up wait is over, 503 with
            # when to ask again (the plugin's default interval: none was heard).
            unheard = await client.post(url, json={**pin, "worker_id": other})
            assert unheard.status_code == 503
            assert "no heartbeat since the router started" in unheard.json()["error"]["message"]
            assert unheard.headers["retry-after"] == "2"
            assert time.time() >= runtime.started_at + 8.0
            unknown = await client.post(url, json={**pin, "worker_id": "w9"})
            assert unknown.status_code == 404
            assert "unknown worker 'w9'" in unknown.json()["error"]["message"]
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
            await plugin_registered(runtime, nc, subjects)
            # A first outcome, so the store holds a stream cursor to resume from.
            await chat(client, router.url, "warm", "y" * 300)
            await until(lambda: len(held) >= 1)
            message_id, action_id, action_type = held.pop()
            await nc.publish(subjects.outcomes("w0"), encode_outcome(HintOutcome(
                message_id=message_id, action_id=action_id, action_type=action_type,
                worker_id="w0", status=OutcomeStatus.ACCEPTED, at=time.time())))
            await until(lambda: action_id not in runtime.hints.pending)
            await chat(client, router.url, "agent", "x" * 300)
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


async def test_a_prediction_is_checked_only_while_the_index_view_of_its_worker_is_current(
        tmp_path: Path, nats_url: str, subject_prefix: str,
        stub_workers: list[StubWorker]) -> None:
    """The router compares a prediction with the worker's cached tokens (its accuracy
    metric) only while the cluster index's view of the worker is current: its plugin
    heard lately, its stream live. Before, a worker whose plugin was never heard (or was
    resyncing) had its always-empty view's predictions counted as exact."""
    subjects = Subjects(subject_prefix)
    nc = await nats.connect(nats_url)
    settings = router_settings(tmp_path, [("w0", stub_workers[0].url)], nats_url=nats_url,
                               subject_prefix=subject_prefix)
    metric = 'kvhint_router_cached_tokens_actual_total{predicted="%s",worker="w0"}'

    async def metrics_text(client: httpx.AsyncClient, url: str) -> str:
        return (await client.get(f"{url}/metrics")).text

    try:
        async with running_router(settings) as router, httpx.AsyncClient() as client:
            assert await router.runtime.link.wait_connected(10)
            await chat(client, router.url, "unheard", "x" * 300)
            text = await metrics_text(client, router.url)
            assert metric % "false" in text and metric % "true" not in text
            await plugin_registered(router.runtime, nc, subjects)
            for attempt in range(5):  # a chat within 1.5 heartbeats (0.75 s) of one
                await nc.publish(subjects.status("w0"), status("w0", "e1", 0))
                await nc.flush()
                await asyncio.sleep(0.05)
                await chat(client, router.url, f"heard{attempt}", "y" * 300)
                if metric % "true" in await metrics_text(client, router.url):
                    break
            assert metric % "true" in await metrics_text(client, router.url)
    finally:
        await nc.drain()


async def test_a_heartbeat_on_another_workers_subject_is_dropped_and_counted(
        tmp_path: Path, nats_url: str, subject_prefix: str) -> None:
    """A heartbeat speaks only for the worker of its subject, as an event batch does.
    Before, one published on w1's subject naming w0 registered w0 (its URL, epoch and
    liveness) from a publisher that is not w0's plugin."""
    subjects = Subjects(subject_prefix)
    async with router_hearing_nats(tmp_path, nats_url, subject_prefix) as (
            router, client, nc):
        runtime = router.runtime
        await nc.publish(subjects.status("w1"), status("w0", "e1", 0, url="http://x:1"))
        await until(lambda: runtime.ingestor.stats().subject_mismatches == 1)
        assert runtime.workers.get("w0") is None
        text = (await client.get(f"{router.url}/metrics")).text
        assert 'kvhint_router_index_ingest_total{what="subject_mismatches"} 1.0' in text
        await nc.publish(subjects.status("w0"), status("w0", "e1", 0, url="http://x:1"))
        await until(lambda: runtime.workers.get("w0") is not None)
