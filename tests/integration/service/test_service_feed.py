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
from kvhint.router.policy import Holdings
from kvhint.schemas import (
    Amount,
    BlockStored,
    Budgets,
    EventBatchMeta,
    HintOutcome,
    HoldRelease,
    HoldsReleased,
    KVEventBatch,
    OutcomeStatus,
    ReleaseReason,
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
    encode_releases,
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


async def chat(client: httpx.AsyncClient, url: str, session: str, content: str) -> None:
    await client.post(f"{url}/v1/chat/completions", json={
        "model": "stub", "messages": [{"role": "user", "content": content}],
        "session_id": session})


async def publish_release(nc, subjects: Subjects, action_id: str,  # noqa: ANN001
                          action_type: str, session: str | None, released: int, left: int,
                          reason: ReleaseReason) -> None:
    """What w0's plugin sends when an accepted action loses ``released`` blocks unasked
    and keeps ``left`` (32-token blocks)."""
    await nc.publish(subjects.releases("w0"), encode_releases(HoldsReleased(
        worker_id="w0", at=time.time(), releases=[HoldRelease(
            action_id=action_id, action_type=action_type, session_id=session, reason=reason,
            released=Amount(released, 32 * released), held=Amount(left, 32 * left))])))


async def plugin_registered(runtime, nc, subjects: Subjects) -> None:  # noqa: ANN001
    """The router is connected to NATS and has heard w0's plugin (one heartbeat)."""
    assert await runtime.link.wait_connected(10)
    await asyncio.sleep(0.3)
    await nc.publish(subjects.status("w0"), status("w0", "e1", 0))
    await until(lambda: runtime.workers.get("w0").plugin_alive)


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
            await plugin_registered(runtime, nc, subjects)
            await chat(client, router.url, "agent", "x" * 400)
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
            # A Retain without ttl_s is held by the worker for its max_retain_ttl_s (3,600 s
            # here): the tenant's budget counts it that long, not until the next tick.
            retain = await client.post(url, json={"actions": [
                {"action_type": "kv.retain", "payload": {"priority": 40}}]})
            assert retain.json()["actions"][0]["applied_blocks"] == 2
            runtime.hints.expire(time.time() + 60)
            assert runtime.hints.holdings.tenant("default").retained_blocks == 2
    finally:
        await nc.drain()


async def test_blocks_a_worker_lets_go_unasked_leave_the_session_and_the_budgets(
        tmp_path: Path, nats_url: str, subject_prefix: str,
        stub_workers: list[StubWorker]) -> None:
    """A worker accepted the planner's Retain, then lost blocks of it (displaced by a
    higher-priority retain, relieved under memory pressure): the router must stop
    believing the session protected by them and stop counting them against the worker's
    and the tenant's budgets. A release that overtakes its action's outcome (two subjects)
    caps that outcome."""
    subjects = Subjects(subject_prefix)
    stub = stub_workers[0]
    nc = await nats.connect(nats_url)
    held: list[tuple[str, str, str, str | None]] = []

    async def plugin(msg) -> None:  # noqa: ANN001 - remembers, answers when told
        decoded = decode_hints(msg.data)
        held.extend((decoded.message_id, a.action_id, a.action_type.value,
                     a.payload.target.session_id) for a in decoded.actions)

    async def answer(message_id: str, action_id: str, action_type: str, blocks: int) -> None:
        await nc.publish(subjects.outcomes("w0"), encode_outcome(HintOutcome(
            message_id=message_id, action_id=action_id, action_type=action_type,
            worker_id="w0", status=OutcomeStatus.ACCEPTED, requested=Amount(blocks, 32 * blocks),
            applied=Amount(blocks, 32 * blocks), at=time.time())))

    await nc.subscribe(subjects.hints("w0"), cb=plugin)
    settings = router_settings(tmp_path, [("w0", stub.url)], nats_url=nats_url,
                               subject_prefix=subject_prefix,
                               hints={"api_outcome_timeout_s": 5.0})
    try:
        async with running_router(settings) as router, httpx.AsyncClient() as client:
            runtime = router.runtime
            await plugin_registered(runtime, nc, subjects)
            await chat(client, router.url, "agent", "x" * 400)
            await until(lambda: len(held) >= 1)
            message_id, action_id, action_type, session = held.pop()
            assert action_type == "kv.retain" and session is not None
            await answer(message_id, action_id, action_type, 4)
            await until(lambda: action_id not in runtime.hints.pending)

            async def views() -> tuple[object, dict[str, int]]:
                detail = (await client.get(f"{router.url}/admin/sessions/default/agent")).json()
                worker = (await client.get(f"{router.url}/admin/workers/w0")).json()
                return detail["planner"]["protection"], worker["held_by_hints"]

            protection, on_worker = await views()
            assert protection["action_id"] == action_id and protection["blocks"] == 4
            assert on_worker["retained_blocks"] == 4
            assert runtime.hints.holdings.tenant("default").retained_blocks == 4
            # Displaced: 3 of its 4 blocks went to a higher-priority retain.
            await publish_release(nc, subjects, action_id, action_type, session, 3, 1,
                                  ReleaseReason.DISPLACED)
            await until(lambda: runtime.hints.holdings.worker("w0").retained_blocks == 1)
            protection, on_worker = await views()
            assert protection["blocks"] == 1 and on_worker["retained_blocks"] == 1
            assert runtime.hints.holdings.tenant("default").retained_blocks == 1
            # Relieved: the last one went too. Nothing protects the session any more.
            await publish_release(nc, subjects, action_id, action_type, session, 1, 0,
                                  ReleaseReason.PRESSURE)
            await until(lambda: runtime.hints.holdings.worker("w0").retained_blocks == 0)
            protection, on_worker = await views()
            assert protection is None and on_worker == {"pinned_blocks": 0,
                                                        "retained_blocks": 0}
            (row,) = [h for h in (await client.get(f"{router.url}/admin/hints", params={
                "session_id": "agent"})).json()["hints"] if h["action_id"] == action_id]
            assert (row["status"], row["applied_blocks"], row["release_reason"],
                    row["held_after_release_blocks"]) == ("accepted", 4, "pressure", 0)
            # An API pin whose release comes before its outcome: the outcome is capped.
            response = asyncio.ensure_future(client.post(
                f"{router.url}/v1/sessions/agent/hints",
                json={"actions": [{"action_type": "kv.pin", "payload": {"ttl_s": 30}}]}))
            await until(lambda: any(a.startswith("kva-") for _m, a, _t, _s in held))
            (message_id, pin_id, pin_type, pin_session), = [
                h for h in held if h[1].startswith("kva-")]
            await publish_release(nc, subjects, pin_id, pin_type, pin_session, 2, 1,
                                  ReleaseReason.RESET)
            await until(lambda: runtime.metrics.hold_releases.labels(
                "kv.pin", "reset")._value.get() == 2)
            await answer(message_id, pin_id, pin_type, 3)
            action = (await response).json()["actions"][0]
            assert action["status"] == "accepted" and action["applied_blocks"] == 1
            assert runtime.hints.holdings.worker("w0").pinned_blocks == 1
            # A malformed report is counted and changes nothing.
            await nc.publish(subjects.releases("w0"), b'{"worker_id": "w0", "releases": [{}]}')
            await until(lambda: runtime.metrics.drops.labels("releases_malformed")
                        ._value.get() == 1)
            assert runtime.hints.holdings.worker("w0").pinned_blocks == 1
            metrics = (await client.get(f"{router.url}/metrics")).text
            assert 'kvhint_router_hold_released_blocks_total{action="kv.retain",' \
                   'reason="displaced"} 3.0' in metrics
    finally:
        await nc.drain()


async def test_a_restarted_router_counts_what_the_workers_still_hold(
        tmp_path: Path, nats_url: str, subject_prefix: str,
        stub_workers: list[StubWorker]) -> None:
    """The workers keep their Pins and Retains while the router restarts: the new router
    rebuilds its holdings from the store (answered, TTL not over, less what workers
    released, also while no router ran), so the worker's and the tenant's budgets are not
    believed empty."""
    subjects = Subjects(subject_prefix)
    stub = stub_workers[0]
    nc = await nats.connect(nats_url)
    retains: dict[str, str] = {}  # session (worker-side id) -> its latest retain
    seen: list[str] = []  # every action id, in order

    async def plugin(msg) -> None:  # noqa: ANN001 - accepts every action: 4 blocks
        decoded = decode_hints(msg.data)
        for action in decoded.actions:
            seen.append(action.action_id)
            if action.action_type.value == "kv.retain":
                retains[action.payload.target.session_id] = action.action_id
            await nc.publish(subjects.outcomes("w0"), encode_outcome(HintOutcome(
                message_id=decoded.message_id, action_id=action.action_id,
                action_type=action.action_type.value, worker_id="w0",
                status=OutcomeStatus.ACCEPTED, requested=Amount(4, 128),
                applied=Amount(4, 128), at=time.time())))

    await nc.subscribe(subjects.hints("w0"), cb=plugin)
    settings = router_settings(tmp_path, [("w0", stub.url)], nats_url=nats_url,
                               subject_prefix=subject_prefix)
    try:
        async with running_router(settings) as router, httpx.AsyncClient() as client:
            runtime = router.runtime
            await plugin_registered(runtime, nc, subjects)
            await chat(client, router.url, "agent", "x" * 400)
            await chat(client, router.url, "pinned", "y" * 400)
            await until(lambda: runtime.hints.holdings.worker("w0").retained_blocks == 8)
            # The API's pin of "pinned" supersedes that session's retain (as the plugin does).
            pin = (await client.post(f"{router.url}/v1/sessions/pinned/hints", json={
                "actions": [{"action_type": "kv.pin", "payload": {"ttl_s": 300}}]})).json()
            pin_id = pin["actions"][0]["action_id"]
            assert runtime.hints.holdings.worker("w0") == Holdings(4, 4)
            await publish_release(nc, subjects, pin_id, "kv.pin", None, 3, 1,
                                  ReleaseReason.RESET)
            await until(lambda: runtime.hints.holdings.worker("w0").pinned_blocks == 1)
        # No router now: the worker relieves 3 of "agent"'s 4 retained blocks.
        (agent,) = [s for s in retains if s.endswith("/agent")]
        await publish_release(nc, subjects, retains[agent], "kv.retain", agent, 3, 1,
                              ReleaseReason.PRESSURE)
        before = len(seen)
        async with running_router(settings) as router, httpx.AsyncClient() as client:
            holdings = router.runtime.hints.holdings
            # The engine epoch comes back from the store: a heartbeat from another epoch
            # will say the engine restarted meanwhile.
            assert router.runtime.workers.get("w0").epoch == "e1"
            await until(lambda: holdings.worker("w0").retained_blocks == 1)
            assert holdings.worker("w0") == Holdings(1, 1)
            assert holdings.tenant("default") == Holdings(1, 1)
            # New actions get new ids: a repeated one would get the old one's outcome from
            # the worker's idempotency memory, and its store row.
            await plugin_registered(router.runtime, nc, subjects)
            await chat(client, router.url, "later", "z" * 400)
            await until(lambda: len(seen) > before)
            assert not set(seen[before:]) & set(seen[:before])
            await until(lambda: holdings.worker("w0").retained_blocks == 5)
            # The engine restarts: it holds nothing, and neither do the budgets.
            await nc.publish(subjects.status("w0"), status("w0", "e2", 0))
            await until(lambda: holdings.worker("w0") == Holdings())
            assert holdings.tenant("default") == Holdings()
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
