"""An agent runtime's Retain through the hints API against the planner's Retains on the
worker, end to end: the real router and NATS, and the real plugin's HintCore on vLLM's
real Scheduler and block pool answering w0's hints (the test carries w0's hints to it
and its outcomes back; w0's heartbeat is played, as in the other service tests). The
worker ranks an agent's Retain above every planner Retain: the CI case (the planner's
top-priority Retains filled the retain budget; an agent's at 90 was clipped to 0) is
applied whole. A Retain of another tenant's agent clipped by agents' claims says what
holds the room, and its tenant reads that, not the figures nor whose claims they are."""

from __future__ import annotations

from pathlib import Path

import httpx
import nats
import pytest

from conftest import StubWorker, router_settings, running_router
from feed_helpers import ACTIONS_WITH_OWNER, plugin_on_nats, plugin_registered
from kvhint.engine_plugin.headless import (
    HeadlessScheduler,
    HeadlessSchedulerSpec,
    build_scheduler,
    tokens_for_block_ids,
)
from kvhint.schemas import (
    HintOwner,
    KvHintsEnvelope,
    RetainPayload,
    Subjects,
    Target,
    encode_hints,
    make_action,
)

pytestmark = pytest.mark.usefixtures("throwaway_streams")

BS = 32
TENANTS = [{"name": "a", "api_keys": ["ka"], "admin_keys": ["aa"]},
           {"name": "b", "api_keys": ["kb"], "admin_keys": ["bb"]}]


def _turn(h: HeadlessScheduler, session: str, block_ids: list[int]) -> None:
    h.run(h.make_request(tokens_for_block_ids(block_ids, BS) + [3] * 5, session_id=session))


async def _chat(client: httpx.AsyncClient, url: str, session: str, key: str) -> None:
    turn = await client.post(f"{url}/v1/chat/completions", headers={
        "authorization": f"Bearer {key}"}, json={
        "model": "stub", "session_id": session,
        "messages": [{"role": "user", "content": f"{session}: " + "x" * 400}]})
    assert turn.status_code == 200, turn.text


async def test_an_agents_retain_outranks_the_planners_and_a_clipped_one_says_why(
        tmp_path: Path, nats_url: str, subject_prefix: str,
        stub_workers: list[StubWorker]) -> None:
    subjects = Subjects(subject_prefix)
    h = build_scheduler(HeadlessSchedulerSpec(
        block_size=BS, num_blocks=64, connector_module="kvhint.engine_plugin.connector",
        connector_extra_config={"worker_id": "w0", "retain_budget_fraction": 0.1}))  # 6
    core = h.connector.core
    nc = await nats.connect(nats_url)

    await plugin_on_nats(nc, subjects, core)
    # The planner's Retains are applied here as the planner sends them (owner planner,
    # top priority), so that they fill w0's retain budget whatever the router plans.
    settings = router_settings(
        tmp_path, [("w0", stub_workers[0].url)], nats_url=nats_url,
        subject_prefix=subject_prefix, admin_keys=["root"], hints={"enabled": False},
        tenants=TENANTS)
    try:
        async with running_router(settings) as router, \
                httpx.AsyncClient(timeout=30) as client:
            await plugin_registered(router.runtime, nc, subjects, ACTIONS_WITH_OWNER)
            url = router.url
            await _chat(client, url, "s1", "ka")
            await _chat(client, url, "s2", "kb")
            sessions = router.runtime.sessions
            a_sid = sessions.get("a", "s1").worker_session_id
            b_sid = sessions.get("b", "s2").worker_session_id
            _turn(h, "planner-1", [1, 2, 3, 4])
            _turn(h, "planner-2", [5, 6])
            _turn(h, a_sid, [11, 12, 13, 14, 15, 16])
            _turn(h, b_sid, [21, 22])
            for i, session in enumerate(("planner-1", "planner-2")):
                envelope = KvHintsEnvelope(protocol_version="1", message_id=f"m-p{i}",
                                           actions=[make_action(f"p{i}", RetainPayload(
                                               target=Target(session_id=session),
                                               priority=100, ttl_s=600))])
                (outcome,) = core.apply_hints(encode_hints(envelope))
                assert outcome.status.value == "accepted", outcome
            assert core.executor.retained_blocks == 6

            async def retain(session: str, admin: str, priority: int) -> dict:
                answer = await client.post(f"{url}/v1/sessions/{session}/hints", headers={
                    "authorization": f"Bearer {admin}"}, json={"actions": [{
                        "action_type": "kv.retain", "payload": {"priority": priority}}]})
                assert answer.status_code == 200, answer.text
                (action,) = answer.json()["actions"]
                assert action["payload"]["owner"] == HintOwner.AGENT.value
                return action

            # a's agent at 90 against the planner's 100s: applied whole (before: 0 of 6).
            first = await retain("s1", "aa", 90)
            assert (first["status"], first["requested_blocks"], first["applied_blocks"]) == (
                "accepted", 6, 6), first
            # b's agent at 50: a's claims hold the whole budget; clipped, and b reads why
            # (agents' claims of 50 or more), not the figures nor that they are a's.
            second = await retain("s2", "bb", 50)
            assert (second["status"], second["applied_blocks"]) == ("clipped", 0), second
            words = "the room is held by agent runtimes' Retains of priority 50 or more"
            assert words in second["reason"], second
            assert "max_retained_blocks" not in second["reason"], second
            assert "0 of 2" not in second["reason"] and "'a'" not in second["reason"]
            rows = (await client.get(f"{url}/admin/hints", headers={
                "authorization": "Bearer root"})).json()["hints"]
            fleet = [r["reason"] for r in rows if r["action_id"] == second["action_id"]]
            assert fleet and "max_retained_blocks=6" in fleet[0] and words in fleet[0]
    finally:
        await nc.drain()
        h.connector.shutdown()


async def test_an_agents_prefetch_goes_out_as_the_agents_and_outranks_the_planners(
        tmp_path: Path, nats_url: str, subject_prefix: str,
        stub_workers: list[StubWorker]) -> None:
    """The hints API sends an agent's Prefetch as 1.2 with ``owner: agent`` to a worker
    that advertises it (the plugin does), and the worker retains its blocks in G1 above
    the planner's top-priority Retains that fill the retain budget. Before, a Prefetch
    had no owner: it ranked at prefetch_retain_priority among the planner's claims and
    got 0 of the 6 blocks."""
    subjects = Subjects(subject_prefix)
    h = build_scheduler(HeadlessSchedulerSpec(
        block_size=BS, num_blocks=64, connector_module="kvhint.engine_plugin.connector",
        connector_extra_config={"worker_id": "w0", "retain_budget_fraction": 0.1}))  # 6
    core = h.connector.core
    nc = await nats.connect(nats_url)

    await plugin_on_nats(nc, subjects, core)
    settings = router_settings(
        tmp_path, [("w0", stub_workers[0].url)], nats_url=nats_url,
        subject_prefix=subject_prefix, hints={"enabled": False}, tenants=TENANTS)
    try:
        async with running_router(settings) as router, \
                httpx.AsyncClient(timeout=30) as client:
            await plugin_registered(router.runtime, nc, subjects, core.supported_actions())
            await _chat(client, router.url, "s1", "ka")
            a_sid = router.runtime.sessions.get("a", "s1").worker_session_id
            _turn(h, "planner-1", [1, 2, 3, 4, 5, 6])
            _turn(h, a_sid, [11, 12, 13, 14, 15, 16])
            envelope = KvHintsEnvelope(protocol_version="1", message_id="m-p", actions=[
                make_action("p", RetainPayload(target=Target(session_id="planner-1"),
                                               priority=100, ttl_s=600))])
            (outcome,) = core.apply_hints(encode_hints(envelope))
            assert outcome.status.value == "accepted" and core.executor.retained_blocks == 6
            answer = await client.post(
                f"{router.url}/v1/sessions/s1/hints", headers={"authorization": "Bearer aa"},
                json={"actions": [{"action_type": "kv.prefetch",
                                   "payload": {"deadline_s": 30}}]})
            assert answer.status_code == 200, answer.text
            (action,) = answer.json()["actions"]
            assert action["payload"]["owner"] == HintOwner.AGENT.value, action
            assert action["status"] == "accepted", action
            assert "6 of 6 blocks retained" in action["reason"], action
            holds = core.executor.holds.keys()["retained"]
            assert set(core.index.session_blocks(a_sid)) <= set(holds)
    finally:
        await nc.drain()
        h.connector.shutdown()
