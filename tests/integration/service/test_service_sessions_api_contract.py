"""The sessions API as an agent runtime uses it, against a real NATS server and the real
store: what an end does to a session that has already ended, and to the hints that come
after an end.

The "plugin" is this test answering w0's hints as a plugin that keeps owners apart (1.2)
does, or an older one (1.0/1.1, where they are not): every claim accepted with 2 blocks, a
release (priority 0) holding none (feed_helpers.AcceptingPlugin); heartbeats keep coming,
so the worker stays live while the planner's idle review runs (tests/e2e/service runs the
real plugin).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from pathlib import Path

import httpx
import openai
import pytest

from conftest import StubWorker, scrape
from feed_helpers import ACTIONS, ACTIONS_WITH_OWNER, router_with_accepting_plugin, until
from kvhint.router.service.inbound import error_type_of
from kvhint.schemas import decode_hints

pytestmark = pytest.mark.usefixtures("throwaway_streams")

RETAIN = {"actions": [{"action_type": "kv.retain", "payload": {"priority": 100}}]}
# What a plugin of each wire version advertises: 1.1 adds evict_rest_first to kv.retain
# and kv.pin, 1.2 the owner (feed_helpers.ACTIONS_WITH_OWNER).
WIRE_ACTIONS = {
    "1.0": ACTIONS,
    "1.1": {**ACTIONS, "kv.pin": ["1.0", "1.1"], "kv.retain": ["1.0", "1.1"]},
    "1.2": ACTIONS_WITH_OWNER,
}


async def _turn(client: httpx.AsyncClient, url: str, session: str,
                key: str | None = None) -> None:
    response = await client.post(f"{url}/v1/chat/completions", json={
        "model": "stub", "session_id": session,
        "messages": [{"role": "user", "content": f"{session}: " + "x" * 400}]},
        headers={"authorization": f"Bearer {key}"} if key else None)
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("wire", sorted(WIRE_ACTIONS))
async def test_an_end_releases_what_an_agent_holds_for_a_session_already_ended(
        tmp_path: Path, nats_url: str, subject_prefix: str,
        stub_workers: list[StubWorker], wire: str) -> None:
    """The planner abandons a session idle in a tool gap (its state: ended) but leaves an
    agent's claims alone, and an agent may hint the session after that. The agent's DELETE
    then releases what it still holds there (before, an end of an ended session sent
    nothing: its top-priority Retain stayed on the worker for the worker's
    max_retain_ttl_s, an hour), in the form its claim went out in: the agent's own
    (``owner: agent``) on a 1.2 worker, the session's (no owner) on a 1.0/1.1 one, whose
    claims are the session's (before, a 1.0/1.1 worker's were never released by it). A
    DELETE with nothing held still sends nothing; after a DELETE, hints are refused."""
    stub = stub_workers[0]
    owned = wire == "1.2"
    held = "agent:default/gap" if owned else "default/gap"  # the agent's claim's scope
    async with router_with_accepting_plugin(
            tmp_path, nats_url, subject_prefix, stub, WIRE_ACTIONS[wire],
            hints={"tick_s": 0.1}) as (router, client, plugin):
        runtime, holdings = router.runtime, router.runtime.hints.holdings
        stub.finish_reason, stub.tool_names = "tool_calls", ["search"]
        await _turn(client, router.url, "gap")
        stub.finish_reason, stub.tool_names = "stop", []
        hinted = await client.post(f"{router.url}/v1/sessions/gap/hints", json=RETAIN)
        assert hinted.status_code == 200, hinted.text
        assert holdings.workers_holding(held) == ["w0"]
        # The planner's idle review gives the session up (abandon_after_s, an hour by
        # default, shortened here). Its release supersedes a 1.0/1.1 worker's claim of
        # the session (one owner there), never a 1.2 worker's agent claim.
        runtime.hints.planner_config = dataclasses.replace(runtime.hints.planner_config,
                                                           abandon_after_s=0.5)
        await until(lambda: runtime.sessions.get("default", "gap").state == "ended")
        if owned:
            assert holdings.workers_holding(held) == ["w0"]
        else:
            await until(lambda: not holdings.workers_holding(held))
        # Hinted once the planner gave it up: taken (only the client's own end refuses).
        hinted = await client.post(f"{router.url}/v1/sessions/gap/hints", json=RETAIN)
        assert hinted.status_code == 200, hinted.text
        assert holdings.api_holders(held) == ["w0"]

        ended = await client.delete(f"{router.url}/v1/sessions/gap")
        assert ended.status_code == 200, ended.text
        (release,) = ended.json()["hints"]
        assert release["trigger"] == "end:agent_release" and release["scope"] == held
        assert release["payload"].get("owner", "planner") == ("agent" if owned else "planner")
        assert release["payload"]["priority"] == 0
        await until(lambda: release["action_id"] in plugin.action_ids)
        await until(lambda: not holdings.workers_holding(held))

        # Ended by its client now: a hint is refused, sends nothing, and the end again
        # has nothing to release.
        refused = await client.post(f"{router.url}/v1/sessions/gap/hints", json=RETAIN)
        assert refused.status_code == 409, refused.text
        repeated = await client.delete(f"{router.url}/v1/sessions/gap")
        assert repeated.status_code == 200
        assert repeated.json()["hints"] == [] and repeated.json()["state"] == "ended"
        assert not holdings.workers_holding(held)


async def test_a_session_its_client_ended_takes_no_hints_until_its_next_turn(
        tmp_path: Path, nats_url: str, subject_prefix: str,
        stub_workers: list[StubWorker]) -> None:
    """Hints to a session its client ended, by DELETE or by X-Session-End, are refused:
    409 naming why, nothing sent, nothing held, counted as hint_api_rejections_total
    {reason="session_ended"} and in no other refusal counter. The session's next turn opens
    it again (a new turn of an ended session is a turn like any), and its hints are taken
    again. Before, every one of them was sent."""
    async with router_with_accepting_plugin(
            tmp_path, nats_url, subject_prefix, stub_workers[0],
            hints={"tick_s": 3600.0}) as (router, client, plugin):
        url, sessions = router.url, router.runtime.sessions
        holdings = router.runtime.hints.holdings
        for session in ("deleted", "header"):
            await _turn(client, url, session)
        assert (await client.delete(f"{url}/v1/sessions/deleted")).status_code == 200
        ended = await client.post(f"{url}/v1/chat/completions", json={
            "model": "stub", "session_id": "header",
            "messages": [{"role": "user", "content": "header: " + "x" * 400}]},
            headers={"x-session-end": "true"})
        assert ended.status_code == 200, ended.text
        assert {sessions.get("default", s).state for s in ("deleted", "header")} == {"ended"}
        await until(lambda: not holdings.workers_holding("default/deleted")
                    and not holdings.workers_holding("default/header"))
        before, sent = await scrape(client, url), len(plugin.received)
        for session in ("deleted", "header"):
            refused = await client.post(f"{url}/v1/sessions/{session}/hints", json=RETAIN)
            assert refused.status_code == 409, refused.text
            error = refused.json()["error"]
            assert error["code"] == 409 and "was ended" in error["message"]
        after = await scrape(client, url)
        moved = {(name, dict(labels).get("reason")): value - before.get((name, labels), 0)
                 for (name, labels), value in after.items()
                 if "rejections" in name and value != before.get((name, labels), 0)}
        assert moved == {("kvhint_router_hint_api_rejections_total", "session_ended"): 2}
        assert len(plugin.received) == sent
        assert not holdings.workers_holding("agent:default/deleted")
        assert not holdings.workers_holding("agent:default/header")
        # A new turn opens each again: its hints are taken.
        for session in ("deleted", "header"):
            await _turn(client, url, session)
            assert sessions.get("default", session).state == "active"
            hinted = await client.post(f"{url}/v1/sessions/{session}/hints", json=RETAIN)
            assert hinted.status_code == 200, hinted.text
            assert holdings.workers_holding(f"agent:default/{session}") == ["w0"]


async def test_a_retain_without_ttl_is_held_to_the_tenants_ttl_limit(
        tmp_path: Path, nats_url: str, subject_prefix: str,
        stub_workers: list[StubWorker]) -> None:
    """A tenant whose hints may last ``max_hint_ttl_s`` (120 s here) has a Retain that
    names no ``ttl_s`` sent with that TTL, and counted that long; one naming a longer TTL
    is refused, as before. Before, the untimed Retain went out without a TTL and the
    worker held it for its own max_retain_ttl_s (3,600 s here): thirty times what the
    tenant may ask for, at top priority."""
    tenants = [{"name": "a", "api_keys": ["ka"], "admin_keys": ["aa"],
                "budget": {"max_hint_ttl_s": 120}}]
    admin = {"authorization": "Bearer aa"}
    async with router_with_accepting_plugin(
            tmp_path, nats_url, subject_prefix, stub_workers[0], tenants=tenants,
            hints={"tick_s": 3600.0}) as (router, client, plugin):
        await _turn(client, router.url, "s", key="ka")
        url = f"{router.url}/v1/sessions/s/hints"
        too_long = await client.post(url, headers=admin, json={"actions": [
            {"action_type": "kv.retain", "payload": {"priority": 100, "ttl_s": 3600}}]})
        assert too_long.status_code == 422 and "limit of 120" in too_long.text
        hinted = await client.post(url, json=RETAIN, headers=admin)
        assert hinted.status_code == 200, hinted.text
        (action,) = hinted.json()["actions"]
        assert action["payload"]["ttl_s"] == 120
        assert action["expires_at"] - action["created_at"] == pytest.approx(120, abs=1)
        await until(lambda: action["action_id"] in plugin.action_ids)
        (sent,) = [payload for a, payload in plugin.received if a == action["action_id"]]
        assert sent.ttl_s == 120  # what the worker holds it for
        holdings = router.runtime.hints.holdings
        router.runtime.hints.expire(time.time() + 100)
        assert holdings.api_on_worker("a", "w0").retained_blocks == 2
        router.runtime.hints.expire(time.time() + 130)
        assert holdings.api_on_worker("a", "w0").retained_blocks == 0


async def test_every_refused_end_is_counted_and_ends_nothing(
        tmp_path: Path, nats_url: str, subject_prefix: str,
        stub_workers: list[StubWorker]) -> None:
    """A DELETE the router refuses (a bad id, no key or an unknown one, another tenant's
    key, a session the tenant does not have) ends nothing and counts in
    session_end_rejections_total by reason, and in no other refusal counter; before, no
    refused end was counted anywhere. One tenant's "b/s" is its own, never tenant b's
    session "s"."""
    tenants = [{"name": "a", "api_keys": ["ka"], "admin_keys": ["aa"]},
               {"name": "b", "api_keys": ["kb"], "admin_keys": ["bb"]}]
    async with router_with_accepting_plugin(
            tmp_path, nats_url, subject_prefix, stub_workers[0], tenants=tenants,
            admin_keys=["root"], hints={"tick_s": 3600.0}) as (router, client, _):
        sessions, url = router.runtime.sessions, router.url
        for session, key in (("b/s", "ka"), ("s", "kb")):
            response = await client.post(f"{url}/v1/chat/completions", json={
                "model": "stub", "session_id": session,
                "messages": [{"role": "user", "content": "x" * 400}]},
                headers={"authorization": f"Bearer {key}"})
            assert response.status_code == 200, response.text
        before = await scrape(client, url)
        refused = [("bad_request", 400, "x" * 300, "ka", None),
                   # A line break: it matched no route (404, counted nowhere) before.
                   ("bad_request", 400, "s%0As", "ka", None),
                   ("unauthorized", 401, "s", None, None),
                   ("unauthorized", 401, "s", "nope", None),
                   ("forbidden", 403, "s", "ka", "b"),
                   ("forbidden", 403, "s", "aa", "b"),
                   ("unknown_session", 404, "s", "ka", None),
                   ("unknown_session", 404, "b%2Fs", "kb", None)]
        for reason, code, session, key, tenant in refused:
            headers = {"authorization": f"Bearer {key}"} if key else {}
            response = await client.delete(f"{url}/v1/sessions/{session}", headers=headers,
                                           params={"tenant": tenant} if tenant else None)
            assert response.status_code == code, (reason, response.text)
            assert response.json()["error"]["code"] == code
        assert sessions.get("a", "s") is None and sessions.get("b", "b/s") is None
        assert {s.state for s in sessions} == {"active"}
        after = await scrape(client, url)
        moved = {(name, dict(labels).get("reason")): value - before.get((name, labels), 0)
                 for (name, labels), value in after.items()
                 if "rejections" in name and value != before.get((name, labels), 0)}
        expected: dict[tuple[str, str], float] = {}
        for reason, *_ in refused:
            key = ("kvhint_router_session_end_rejections_total", reason)
            expected[key] = expected.get(key, 0) + 1
        assert moved == expected
        # Tenant a ends its own "b/s"; tenant b's "s" is untouched.
        ended = await client.delete(f"{url}/v1/sessions/b/s",
                                    headers={"authorization": "Bearer ka"})
        assert ended.status_code == 200 and ended.json()["tenant"] == "a"
        assert sessions.get("a", "b/s").state == "ended"
        assert sessions.get("b", "s").state == "active"


async def test_a_hints_call_over_the_rate_is_a_rate_limit_error_as_on_the_gateway(
        tmp_path: Path, nats_url: str, subject_prefix: str,
        stub_workers: list[StubWorker]) -> None:
    """A 429 of the hints API has the type the gateway gives its 429 (over a tenant's
    max_in_flight): ``rate_limit_error``; before, ``invalid_request_error``."""
    tenants = [{"name": "a", "api_keys": ["ka"], "admin_keys": ["aa"],
                "budget": {"max_actions_per_minute": 1}}]
    admin = {"authorization": "Bearer aa"}
    async with router_with_accepting_plugin(
            tmp_path, nats_url, subject_prefix, stub_workers[0], tenants=tenants,
            hints={"tick_s": 3600.0}) as (router, client, _):
        await _turn(client, router.url, "s", key="ka")
        url = f"{router.url}/v1/sessions/s/hints"
        assert (await client.post(url, json=RETAIN, headers=admin)).status_code == 200
        over = await client.post(url, json=RETAIN, headers=admin)
        assert over.status_code == 429, over.text
        assert over.json()["error"]["type"] == "rate_limit_error" == error_type_of(429)


async def test_an_end_during_a_hints_send_still_releases_what_it_sent(
        tmp_path: Path, nats_url: str, subject_prefix: str,
        stub_workers: list[StubWorker]) -> None:
    """A DELETE that lands while a hints call awaits its publish finds the call's claim
    recorded (the router records an action before it publishes it) and releases it
    itself, after the claim: the worker gets the claim, then the release. Before, the end
    found nothing of it to release, and the agent's top-priority Retain stayed on the
    worker for its whole TTL (until the hints call was made to release it itself, once
    its send was done).

    The publish is held on an event (wrapping the dispatcher's NATS link) because the
    window is one await inside NATS's client: it cannot be hit on cue otherwise. It is
    held before the message is queued, so the end's release, were it not published after
    the claim (one worker's envelopes leave in the order recorded), would reach the
    worker first."""
    async with router_with_accepting_plugin(
            tmp_path, nats_url, subject_prefix, stub_workers[0],
            hints={"tick_s": 3600.0}) as (router, client, plugin):
        url, holdings = router.url, router.runtime.hints.holdings
        await _turn(client, url, "race")
        link = router.runtime.hints._link
        publish, reached, go_on = link.publish, asyncio.Event(), asyncio.Event()

        async def held_publish(subject: str, data: bytes) -> bool:
            if any(a.action_id.endswith(":race-claim") for a in decode_hints(data).actions):
                reached.set()
                await go_on.wait()
            return await publish(subject, data)

        link.publish = held_publish
        claim = {"actions": [{**RETAIN["actions"][0], "action_id": "race-claim"}],
                 "wait_s": 0}
        try:
            hinting = asyncio.create_task(client.post(f"{url}/v1/sessions/race/hints",
                                                      json=claim))
            await asyncio.wait_for(reached.wait(), 30)
            assert holdings.workers_holding("agent:default/race") == ["w0"]  # recorded
            # The end's release waits for the claim's publish (the worker's order).
            ending = asyncio.create_task(client.delete(f"{url}/v1/sessions/race"))
            await until(lambda: router.runtime.sessions.get("default", "race").state
                        == "ended", timeout_s=30)
        finally:
            go_on.set()  # never left held: the router could not stop
        hinted, ended = await hinting, await ending
        assert hinted.status_code in (200, 202), hinted.text
        assert ended.status_code == 200, ended.text
        (claim,) = hinted.json()["actions"]
        (release,) = [a for a in ended.json()["hints"] if a["trigger"] == "end:agent_release"]
        assert release["scope"] == "agent:default/race" and release["payload"]["priority"] == 0
        assert release["payload"]["owner"] == "agent"
        both = [claim["action_id"], release["action_id"]]
        await until(lambda: set(both) <= set(plugin.action_ids),
                    timeout_s=30)
        assert [action_id for action_id in plugin.action_ids if action_id in both] == both
        await until(lambda: not holdings.workers_holding("agent:default/race"), timeout_s=30)


async def test_openais_sdk_does_not_retry_a_refusal_a_retry_cannot_change(
        tmp_path: Path, nats_url: str, subject_prefix: str,
        stub_workers: list[StubWorker]) -> None:
    """OpenAI's SDK retries every 409 (twice by default) unless the answer says
    ``x-should-retry: false``. A hints call to an ended session is refused the same way
    every time: it is answered once, with that header. Before, the SDK sent it three
    times (three refusals counted for one call). A refusal that can pass later (a hint id
    still pending: 409 too) is left to the SDK's retries."""
    async with router_with_accepting_plugin(
            tmp_path, nats_url, subject_prefix, stub_workers[0],
            hints={"tick_s": 3600.0}) as (router, client, _):
        url = router.url
        await _turn(client, url, "done")
        assert (await client.delete(f"{url}/v1/sessions/done")).status_code == 200
        sdk = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=2)
        before = await scrape(client, url)
        with pytest.raises(openai.ConflictError) as refused:
            await sdk.post("/sessions/done/hints", body=RETAIN, cast_to=httpx.Response)
        assert refused.value.response.headers["x-should-retry"] == "false"
        after = await scrape(client, url)
        key = ("kvhint_router_hint_api_rejections_total",
               frozenset({("reason", "session_ended")}))
        assert after[key] - before.get(key, 0) == 1
        await sdk.close()


async def test_a_hints_call_during_an_ends_release_is_refused_as_ended(
        tmp_path: Path, nats_url: str, subject_prefix: str,
        stub_workers: list[StubWorker]) -> None:
    """A DELETE whose release of the agent's claim is being published has ended the
    session: a hints call checked meanwhile is refused (409 session_ended) at once. Before,
    the session was marked ended by its client only after that publish (the planner's
    end), so the call passed the check, and its claim, which the release under way did
    not cover, outlived the end on the worker.

    The release's publish is held on an event (wrapping the dispatcher's NATS link): the
    window is one await inside NATS's client, which cannot be hit on cue otherwise."""
    async with router_with_accepting_plugin(
            tmp_path, nats_url, subject_prefix, stub_workers[0],
            hints={"tick_s": 3600.0}) as (router, client, _):
        url = router.url
        await _turn(client, url, "late")
        first = {"actions": [{**RETAIN["actions"][0], "action_id": "first-claim"}],
                 "wait_s": 0}
        assert (await client.post(f"{url}/v1/sessions/late/hints", json=first)
                ).status_code in (200, 202)
        link = router.runtime.hints._link
        publish, reached, go_on = link.publish, asyncio.Event(), asyncio.Event()

        async def held_publish(subject: str, data: bytes) -> bool:
            if any(a.payload.priority == 0 for a in decode_hints(data).actions):
                reached.set()  # the end's release
                await go_on.wait()
            return await publish(subject, data)

        link.publish = held_publish
        try:
            ending = asyncio.create_task(client.delete(f"{url}/v1/sessions/late"))
            await asyncio.wait_for(reached.wait(), 30)
            late = {"actions": [{**RETAIN["actions"][0], "action_id": "late-claim"}],
                    "wait_s": 0}
            hinted = await asyncio.wait_for(
                client.post(f"{url}/v1/sessions/late/hints", json=late), 10)
        finally:
            go_on.set()  # never left held: the router could not stop
        assert hinted.status_code == 409, hinted.text
        assert "was ended" in hinted.json()["error"]["message"]
        assert (await ending).status_code == 200
