"""The router's holdings against a real NATS server: what it believes the workers hold
for its Pins and Retains (budgets, ``held_by_hints``) follows their answers, the blocks
they let go unasked, a router restart, and blocks shared between sessions.

The "plugin" here is this test publishing wire messages with the schemas (see
test_service_feed.py; tests/e2e/service runs the real plugin)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import msgspec
import nats
import pytest

from conftest import StubWorker, router_settings, running_router
from feed_helpers import (
    ACTIONS_WITH_OWNER,
    chat,
    plugin_registered,
    publish_accepted,
    publish_release,
    status,
    until,
)
from kvhint.router.policy import Holdings
from kvhint.schemas import ReleaseReason, Subjects, decode_hints

pytestmark = pytest.mark.usefixtures("throwaway_streams")


async def remembering_plugin(nc, subjects: Subjects  # noqa: ANN001 - a NATS client
                             ) -> list[tuple[str, str, str, str | None]]:
    """w0's plugin, played: it remembers every action it is sent (message id, action id,
    type, target session) and answers only when the test publishes an answer."""
    held: list[tuple[str, str, str, str | None]] = []

    async def plugin(msg) -> None:  # noqa: ANN001
        decoded = decode_hints(msg.data)
        held.extend((decoded.message_id, a.action_id, a.action_type.value,
                     a.payload.target.session_id) for a in decoded.actions)

    await nc.subscribe(subjects.hints("w0"), cb=plugin)
    return held


def _settings_without_ticks(tmp_path: Path, stub: StubWorker, nats_url: str,
                            subject_prefix: str) -> object:
    """No planner tick in the test's time: a tick re-protects a session whose hold was
    released (its new Retain replaces the holding a test asserts on), which raced with
    the assertions on a loaded machine."""
    return router_settings(tmp_path, [("w0", stub.url)], nats_url=nats_url,
                           subject_prefix=subject_prefix,
                           hints={"api_outcome_timeout_s": 5.0, "tick_s": 3600.0})


async def test_blocks_a_worker_lets_go_unasked_leave_the_session_and_the_budgets(
        tmp_path: Path, nats_url: str, subject_prefix: str,
        stub_workers: list[StubWorker]) -> None:
    """A worker accepted the planner's Retain, then lost blocks of it (displaced by a
    higher-priority retain, relieved under memory pressure; an API pin also dropped by
    vLLM by another path): the router must stop believing the session protected by them
    and stop counting them against the worker's and the tenant's budgets. A release that
    overtakes its action's outcome (two subjects) caps that outcome."""
    subjects = Subjects(subject_prefix)
    stub = stub_workers[0]
    nc = await nats.connect(nats_url)
    held = await remembering_plugin(nc, subjects)
    settings = _settings_without_ticks(tmp_path, stub, nats_url, subject_prefix)
    try:
        async with running_router(settings) as router, httpx.AsyncClient() as client:
            runtime = router.runtime
            await plugin_registered(runtime, nc, subjects)
            await chat(client, router.url, "agent", "x" * 400)
            await until(lambda: len(held) >= 1)
            message_id, action_id, action_type, session = held.pop()
            assert action_type == "kv.retain" and session is not None
            await publish_accepted(nc, subjects, message_id, action_id, action_type, 4)
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
            # The dashboard's recent actions (memory, not the store) show it too.
            (recent,) = [h for h in (await client.get(f"{router.url}/admin/overview")).json()[
                "hints"] if h["action_id"] == action_id]
            assert (recent["release_reason"], recent["held_after_release_blocks"]) == (
                "pressure", 0)
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
            await publish_accepted(nc, subjects, message_id, pin_id, pin_type, 3)
            action = (await response).json()["actions"][0]
            assert action["status"] == "accepted" and action["applied_blocks"] == 1
            assert runtime.hints.holdings.worker("w0").pinned_blocks == 1
            # Another router replica's action (every replica hears every release): not
            # in this router's metrics, which must count each release once per fleet.
            await publish_release(nc, subjects, "kvh-another-replica", "kv.pin", None, 5, 0,
                                  ReleaseReason.RESET)
            await until(lambda: runtime.metrics.foreign_messages.labels("release")
                        ._value.get() == 1)
            assert runtime.metrics.hold_releases.labels("kv.pin", "reset")._value.get() == 2
            # A malformed report is counted and changes nothing.
            await nc.publish(subjects.releases("w0"), b'{"worker_id": "w0", "releases": [{}]}')
            await until(lambda: runtime.metrics.drops.labels("releases_malformed")
                        ._value.get() == 1)
            assert runtime.hints.holdings.worker("w0").pinned_blocks == 1
            metrics = (await client.get(f"{router.url}/metrics")).text
            assert 'kvhint_router_hold_released_blocks_total{action="kv.retain",' \
                   'reason="displaced"} 3.0' in metrics
            # vLLM dropped the pin's last block by another path (HoldsReleased 1.1 gone,
            # sent as reset before): applied like any release, counted and stored under
            # its own reason.
            await publish_release(nc, subjects, pin_id, pin_type, pin_session, 1, 0,
                                  ReleaseReason.GONE)
            await until(lambda: runtime.hints.holdings.worker("w0").pinned_blocks == 0)
            assert runtime.metrics.hold_releases.labels("kv.pin", "gone")._value.get() == 1
            assert runtime.metrics.hold_releases.labels("kv.pin", "reset")._value.get() == 2
            (row,) = [h for h in (await client.get(f"{router.url}/admin/hints", params={
                "session_id": "agent"})).json()["hints"] if h["action_id"] == pin_id]
            assert (row["release_reason"], row["held_after_release_blocks"]) == ("gone", 0)
            assert 'kvhint_router_hold_released_blocks_total{action="kv.pin",' \
                   'reason="gone"} 1.0' in (await client.get(f"{router.url}/metrics")).text
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
            await publish_accepted(nc, subjects, decoded.message_id, action.action_id,
                                   action.action_type.value, 4)

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


async def test_an_agents_pin_is_its_own_holding_until_the_session_ends(
        tmp_path: Path, nats_url: str, subject_prefix: str,
        stub_workers: list[StubWorker]) -> None:
    """Against a worker that keeps owners apart (1.2), a Pin an agent runtime sends
    through the API is the agent's (``owner: agent``): the planner's next protection of
    the session replaces only its own, at the worker and in the router's holdings. The
    session's end releases the agent's claims first, then the planner ends its own. An
    agent's Demote ends both, and the planner leaves the session demoted.
    (A 1.0 worker gets the old form; the restart test above covers that.)"""
    subjects = Subjects(subject_prefix)
    stub = stub_workers[0]
    nc = await nats.connect(nats_url)
    actions: list[tuple[str, str, dict]] = []  # (action id, version, payload) in order

    async def plugin(msg) -> None:  # noqa: ANN001 - accepts: 4 blocks held, a release none
        decoded = decode_hints(msg.data)
        for raw in msgspec.json.decode(msg.data)["actions"]:
            actions.append((raw["action_id"], raw["action_version"], raw["payload"]))
        for action in decoded.actions:
            releases = getattr(action.payload, "priority", None) == 0
            await publish_accepted(nc, subjects, decoded.message_id, action.action_id,
                                   action.action_type.value, 0 if releases else 4)

    await nc.subscribe(subjects.hints("w0"), cb=plugin)
    settings = _settings_without_ticks(tmp_path, stub, nats_url, subject_prefix)
    try:
        async with running_router(settings) as router, httpx.AsyncClient() as client:
            holdings = router.runtime.hints.holdings
            await plugin_registered(router.runtime, nc, subjects, ACTIONS_WITH_OWNER)
            await chat(client, router.url, "s", "y" * 400)
            await until(lambda: holdings.holds("w0", "default/s"))
            pin = (await client.post(f"{router.url}/v1/sessions/s/hints", json={
                "actions": [{"action_type": "kv.pin",
                             "payload": {"ttl_s": 300, "owner": "planner"}}]})).json()
            pin_id = pin["actions"][0]["action_id"]
            # The API decides the owner, whatever the caller wrote.
            assert (pin_id, "1.2", "agent") in [(a, v, p.get("owner")) for a, v, p in actions]
            assert pin["actions"][0]["payload"]["owner"] == "agent"
            assert holdings.holds("w0", "agent:default/s") and holdings.holds("w0", "default/s")
            view = (await client.get(f"{router.url}/admin/sessions/default/s")).json()
            assert view["agent_held_on"] == ["w0"] and view["planner"]["protection"]
            # The next turn's protection (the planner's) leaves the agent's pin alone.
            before = len(actions)
            await chat(client, router.url, "s", "y" * 400 + " and more " + "z" * 200)
            await until(lambda: len(actions) > before)
            assert all("owner" not in p for _, _, p in actions[before:])
            assert holdings.holds("w0", "agent:default/s")
            assert holdings.worker("w0").pinned_blocks == 4
            # The end: the agent's claims are released first, then the planner's.
            before = len(actions)
            ended = (await client.delete(f"{router.url}/v1/sessions/s")).json()
            first, *rest = ended["hints"]
            assert first["payload"]["owner"] == "agent" and first["payload"]["priority"] == 0
            assert rest and all("owner" not in h["payload"] for h in rest)
            await until(lambda: len(actions) >= before + 1 + len(rest))
            assert actions[before][0] == first["action_id"]
            await until(lambda: not holdings.holds("w0", "agent:default/s"))
            assert holdings.worker("w0").pinned_blocks == 0
            view = (await client.get(f"{router.url}/admin/sessions/default/s")).json()
            assert view["agent_held_on"] == []
            # An agent's Demote ends the planner's claims on the session too, on the
            # worker and so in the router's holdings.
            await chat(client, router.url, "t", "x" * 400)
            await until(lambda: holdings.holds("w0", "default/t"))
            demoted = (await client.post(f"{router.url}/v1/sessions/t/hints", json={
                "actions": [{"action_type": "kv.demote"}]})).json()
            assert demoted["actions"][0]["payload"]["owner"] == "agent"
            assert not holdings.holds("w0", "default/t")
            assert not holdings.holds("w0", "agent:default/t")
            # The planner leaves it demoted until its next turn (no re-protection).
            plan = router.runtime.sessions.get("default", "t").plan
            assert plan.agent_demoted and plan.protection is None
            view = (await client.get(f"{router.url}/admin/sessions/default/t")).json()
            assert view["planner"]["agent_demoted"] is True
    finally:
        await nc.drain()


async def test_sessions_sharing_a_system_prompt_hold_its_blocks_once(
        tmp_path: Path, nats_url: str, subject_prefix: str,
        stub_workers: list[StubWorker]) -> None:
    """Two sessions over one system prompt, each Retain accepted whole: the worker holds
    the prompt's blocks once under both, and so must the router's budgets. Before, each
    Retain counted them: ``held_by_hints`` and the tenant's retained budget overstated
    what the worker held by the shared blocks (at vLLM's block size 16, 128 blocks per
    session for a 2,000-token system prompt)."""
    subjects = Subjects(subject_prefix)
    stub = stub_workers[0]
    stub.prompt_tokens = 1000  # about what the router's tokenizer counts for each prompt
    nc = await nats.connect(nats_url)
    retains: dict[str, tuple[str, object]] = {}

    async def plugin(msg) -> None:  # noqa: ANN001 - remembers each session's retain
        decoded = decode_hints(msg.data)
        for action in decoded.actions:
            if action.action_type.value == "kv.retain":
                retains[action.payload.target.session_id] = (decoded.message_id, action)

    await nc.subscribe(subjects.hints("w0"), cb=plugin)
    settings = router_settings(tmp_path, [("w0", stub.url)], nats_url=nats_url,
                               subject_prefix=subject_prefix)
    system = "You are a careful agent that plans before it acts. " * 20
    try:
        async with running_router(settings) as router, httpx.AsyncClient() as client:
            runtime = router.runtime
            await plugin_registered(runtime, nc, subjects)
            named: dict[str, tuple[int, ...]] = {}
            asked: dict[str, int] = {}
            for name in ("a", "b"):
                await chat(client, router.url, name, f"task {name}: " + "y" * 300,
                           system=system)
                await until(lambda: f"default/{name}" in retains)
                message_id, action = retains[f"default/{name}"]
                blocks = action.payload.target.prefix_tokens // 32
                named[name] = runtime.sessions.get("default", name).last_block_hashes[:blocks]
                asked[name] = blocks
                await publish_accepted(nc, subjects, message_id, action.action_id,
                                       "kv.retain", blocks)
            await until(lambda: not runtime.hints.pending)
            shared = set(named["a"]) & set(named["b"])
            assert len(shared) >= 10  # the system prompt's blocks
            held = sum(asked.values()) - len(shared)
            worker = (await client.get(f"{router.url}/admin/workers/w0")).json()
            assert worker["held_by_hints"] == {"pinned_blocks": 0, "retained_blocks": held}
            assert runtime.hints.holdings.tenant("default") == Holdings(0, held)
            # One session ends its protection: the other still holds the shared blocks.
            a_id = retains["default/a"][1].action_id
            await publish_release(nc, subjects, a_id, "kv.retain", "default/a",
                                  asked["a"], 0, ReleaseReason.DISPLACED)
            await until(lambda: runtime.hints.holdings.worker("w0").retained_blocks
                        == asked["b"])
    finally:
        await nc.drain()


async def test_a_newer_plugins_releases_and_outcomes_are_read_as_far_as_they_can_be(
        tmp_path: Path, nats_url: str, subject_prefix: str,
        stub_workers: list[StubWorker]) -> None:
    """A rolling upgrade: a newer plugin sends a release reason and an outcome status
    this router does not know, next to an entry it cannot read at all. The known parts
    are applied (before, one unknown reason lost the whole message and the budgets stayed
    overcounted; an unknown status left its action pending for 120 s), and what could not
    be read is counted."""
    subjects = Subjects(subject_prefix)
    nc = await nats.connect(nats_url)
    held = await remembering_plugin(nc, subjects)
    settings = _settings_without_ticks(tmp_path, stub_workers[0], nats_url, subject_prefix)
    try:
        async with running_router(settings) as router, httpx.AsyncClient() as client:
            runtime = router.runtime
            await plugin_registered(runtime, nc, subjects)
            await chat(client, router.url, "agent", "x" * 400)
            await until(lambda: len(held) >= 1)
            message_id, action_id, action_type, session = held.pop()
            await publish_accepted(nc, subjects, message_id, action_id, action_type, 4)
            await until(lambda: runtime.hints.holdings.worker("w0").retained_blocks == 4)
            release = {"action_id": action_id, "action_type": action_type,
                       "session_id": session, "reason": "tier_moved",
                       "released": {"blocks": 3, "tokens": 96},
                       "held": {"blocks": 1, "tokens": 32}}
            await nc.publish(subjects.releases("w0"), msgspec.json.encode({
                "worker_id": "w0", "at": time.time(),
                "releases": [{"action_id": 7}, release]}))
            await until(lambda: runtime.hints.holdings.worker("w0").retained_blocks == 1)
            # A newer status for the API's pin: settled at once, holding nothing.
            response = asyncio.ensure_future(client.post(
                f"{router.url}/v1/sessions/agent/hints",
                json={"actions": [{"action_type": "kv.pin", "payload": {"ttl_s": 30}}]}))
            await until(lambda: any(a[2] == "kv.pin" for a in held))
            pin = next(a for a in held if a[2] == "kv.pin")
            await nc.publish(subjects.outcomes("w0"), msgspec.json.encode({
                "message_id": pin[0], "action_id": pin[1], "action_type": "kv.pin",
                "worker_id": "w0", "status": "superseded", "at": time.time()}))
            answer = (await response).json()["actions"][0]
            assert answer["status"] == "rejected"
            assert answer["reason"].startswith("unknown status 'superseded'")
            assert runtime.hints.holdings.worker("w0").pinned_blocks == 0
            text = (await client.get(f"{router.url}/metrics")).text
            assert 'kvhint_router_drops_total{what="release_unreadable"} 1.0' in text
            assert 'kvhint_router_drops_total{what="outcome_unknown_status"} 1.0' in text
            assert 'what="releases_malformed"' not in text
    finally:
        await nc.drain()
