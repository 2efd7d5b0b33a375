"""The agent-facing sessions API against a real NATS server and the real store: action ids
a caller chooses, default TTLs counted against budgets, session ids with a slash, and a
tenant admin's overview.

The "plugin" here is this test answering hints on w0's subject with the real executor's
duplicate rule (a repeated action id gets its first outcome): these cases are about what
the router does with ids and budgets, which a real engine would answer the same way
(tests/e2e/service runs the real plugin).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import typing
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import nats
import pytest

from conftest import StubWorker, router_settings, running_router, scrape
from feed_helpers import plugin_registered, until
from kvhint.router.service.hint_records import HintStatus
from kvhint.router.service.metric_labels import HINT_API_REJECTIONS
from kvhint.schemas import (
    Amount,
    HintOutcome,
    OutcomeStatus,
    Subjects,
    decode_hints,
    encode_outcome,
)

pytestmark = pytest.mark.usefixtures("throwaway_streams")

TENANTS = [{"name": "a", "api_keys": ["ka"], "admin_keys": ["aa"]},
           {"name": "b", "api_keys": ["kb"], "admin_keys": ["bb"]}]


class RememberingPlugin:
    """w0's plugin as far as ids go: every action accepted whole (2 blocks) the first
    time; a repeated id answered with its first outcome, as the executor does."""

    def __init__(self, nc, subjects: Subjects, answer: bool = True) -> None:  # noqa: ANN001
        self.nc, self.subjects, self.answer = nc, subjects, answer
        self.first: dict[str, HintOutcome] = {}
        self.received: list[tuple[str, str]] = []  # (action id, action type)

    async def answer_hints(self, msg) -> None:  # noqa: ANN001
        decoded = decode_hints(msg.data)
        for action in decoded.actions:
            self.received.append((action.action_id, action.action_type.value))
            outcome = self.first.setdefault(action.action_id, HintOutcome(
                message_id=decoded.message_id, action_id=action.action_id,
                action_type=action.action_type.value, worker_id="w0",
                status=OutcomeStatus.ACCEPTED, requested=Amount(2, 64),
                applied=Amount(2, 64), at=time.time()))
            if self.answer:
                await self.nc.publish(self.subjects.outcomes("w0"), encode_outcome(outcome))


@asynccontextmanager
async def router_with_plugin(tmp_path: Path, nats_url: str, subject_prefix: str,
                             stub_workers: list[StubWorker], **settings: Any
                             ) -> AsyncIterator[tuple[Any, httpx.AsyncClient, RememberingPlugin]]:
    """A router over w0 (the first stub worker) whose plugin this test plays, heard once."""
    subjects = Subjects(subject_prefix)
    nc = await nats.connect(nats_url)
    plugin = RememberingPlugin(nc, subjects)
    await nc.subscribe(subjects.hints("w0"), cb=plugin.answer_hints)
    config = router_settings(tmp_path, [("w0", stub_workers[0].url)], nats_url=nats_url,
                             subject_prefix=subject_prefix, **settings)
    try:
        async with running_router(config) as router, \
                httpx.AsyncClient(timeout=30) as client:
            await plugin_registered(router.runtime, nc, subjects)
            yield router, client, plugin
    finally:
        await nc.drain()


async def _chat(client: httpx.AsyncClient, url: str, session: str, key: str | None = None
                ) -> None:
    """One turn whose prompt is the session's own (no blocks shared with another's)."""
    headers = {"authorization": f"Bearer {key}"} if key else {}
    response = await client.post(f"{url}/v1/chat/completions", headers=headers, json={
        "model": "stub", "session_id": session,
        "messages": [{"role": "user", "content": f"{session}: " + "x" * 400}]})
    assert response.status_code == 200, response.text


async def test_a_callers_action_id_is_its_tenants_own(
        tmp_path: Path, nats_url: str, subject_prefix: str,
        stub_workers: list[StubWorker]) -> None:
    """Two tenants choosing the same action_id each get their own action applied (before,
    the second got the first's remembered outcome and its pin was never applied, and the
    first tenant's ledger lost its pin); an id twice in one call, a malformed id, and an
    id still pending are refused with nothing sent."""
    pin = {"actions": [{"action_type": "kv.pin", "action_id": "pin-1",
                        "payload": {"ttl_s": 300}}]}
    async with router_with_plugin(tmp_path, nats_url, subject_prefix, stub_workers,
                                  tenants=TENANTS) as (router, client, plugin):
        runtime = router.runtime
        await _chat(client, router.url, "s", "ka")
        await _chat(client, router.url, "s", "kb")
        url = f"{router.url}/v1/sessions/s/hints"
        answers = {}
        for tenant, key in (("a", "aa"), ("b", "bb")):
            response = await client.post(url, json=pin,
                                         headers={"authorization": f"Bearer {key}"})
            assert response.status_code == 200, response.text
            (answers[tenant],) = response.json()["actions"]
        assert answers["a"]["action_id"] == "kva-a:pin-1"
        assert answers["b"]["action_id"] == "kva-b:pin-1"
        assert {a["status"] for a in answers.values()} == {"accepted"}
        assert answers["b"]["message_id"] != answers["a"]["message_id"]
        assert runtime.hints.holdings.tenant("a").pinned_blocks == 2
        assert runtime.hints.holdings.tenant("b").pinned_blocks == 2
        history = (await client.get(f"{router.url}/admin/hints",
                                    headers={"authorization": "Bearer aa"})).json()
        assert "kva-a:pin-1" in [h["action_id"] for h in history["hints"]]
        # The same id again from the same tenant is the same action: its outcome.
        again = await client.post(url, json=pin, headers={"authorization": "Bearer aa"})
        assert again.json()["actions"][0]["status"] == "accepted"

        sent_before = len(plugin.received)
        refused = {
            "twice": [{"action_type": "kv.retain", "action_id": "r-1", "payload": {}},
                      {"action_type": "kv.retain", "action_id": "r-1", "payload": {}}],
            "too long": [{"action_type": "kv.retain", "action_id": "x" * 200}],
            "characters": [{"action_type": "kv.retain", "action_id": "a b\u0000"}],
        }
        for case, actions in refused.items():
            response = await client.post(url, json={"actions": actions},
                                         headers={"authorization": "Bearer aa"})
            assert response.status_code == 422, (case, response.text)
            assert "nothing was sent" in response.json()["error"]["message"]
            if case == "twice":  # the second copy named, with why
                assert response.json()["error"]["actions"] == [{
                    "index": "1", "action_id": "r-1",
                    "reason": "action_id is given twice in this call"}], response.text
        # A pending action's id: 409 until its outcome comes (the plugin stays silent).
        plugin.answer = False
        slow = {"wait_s": 0, "actions": [{"action_type": "kv.retain", "action_id": "r-2",
                                          "payload": {}}]}
        first = await client.post(url, json=slow, headers={"authorization": "Bearer aa"})
        assert first.status_code == 202
        second = await client.post(url, json=slow, headers={"authorization": "Bearer aa"})
        assert second.status_code == 409 and "still pending" in second.text
        await until(lambda: len(plugin.received) == sent_before + 1)
        await asyncio.sleep(0.3)
        assert plugin.received[sent_before:] == [("kva-a:r-2", "kv.retain")]


async def test_a_pin_without_ttl_counts_against_the_budget_for_its_default_ttl(
        tmp_path: Path, nats_url: str, subject_prefix: str,
        stub_workers: list[StubWorker]) -> None:
    """A Pin that leaves ``ttl_s`` out is held by the worker for the wire default (60 s):
    the tenant's pin budget counts it that long. Before, the router counted it as ending
    at once, and a second pin over the cap went through."""
    pin = {"actions": [{"action_type": "kv.pin", "payload": {"target": {"prefix_tokens": 64}}}]}
    cap = [{"name": "default", "budget": {"max_pinned_blocks": 2}}]
    async with router_with_plugin(tmp_path, nats_url, subject_prefix, stub_workers,
                                  tenants=cap) as (router, client, _):
        runtime = router.runtime
        await _chat(client, router.url, "s1")
        await _chat(client, router.url, "s2")
        first = await client.post(f"{router.url}/v1/sessions/s1/hints", json=pin)
        assert first.status_code == 200, first.text
        (action,) = first.json()["actions"]
        assert action["expires_at"] - action["created_at"] == pytest.approx(60.0, abs=1)
        runtime.hints.expire(time.time() + 30)
        assert runtime.hints.holdings.tenant("default").pinned_blocks == 2
        second = await client.post(f"{router.url}/v1/sessions/s2/hints", json=pin)
        assert second.status_code == 429, second.text


async def test_a_session_id_with_a_slash_can_be_hinted_viewed_and_ended(
        tmp_path: Path, nats_url: str, subject_prefix: str,
        stub_workers: list[StubWorker]) -> None:
    """The gateway takes ``user/42`` as a session id; every sessions and admin route takes
    it too (plain or %2F-encoded). Before, they all answered 404 and the session could
    not be ended."""
    async with router_with_plugin(tmp_path, nats_url, subject_prefix,
                                  stub_workers) as (router, client, _):
        await _chat(client, router.url, "user/42")
        await _chat(client, router.url, "team/7")
        hinted = await client.post(f"{router.url}/v1/sessions/user/42/hints", json={
            "actions": [{"action_type": "kv.retain", "payload": {"priority": 50}}]})
        assert hinted.status_code == 200, hinted.text
        assert hinted.json()["session_id"] == "user/42"
        view = await client.get(f"{router.url}/admin/sessions/default/user%2F42")
        assert view.status_code == 200 and view.json()["session_id"] == "user/42"
        ended = await client.delete(f"{router.url}/v1/sessions/user/42")
        assert ended.status_code == 200 and ended.json()["state"] == "ended"
        # Dev mode, no key: the header a cross-site form cannot send (cross_site.py).
        by_admin = await client.post(f"{router.url}/admin/sessions/default/team/7/end",
                                     headers={"x-kvhint-request": "1"})
        assert by_admin.status_code == 200, by_admin.text
        assert router.runtime.sessions.get("default", "team/7").state == "ended"


async def test_a_tenant_admins_overview_holds_its_own_tenant_only(
        tmp_path: Path, nats_url: str, subject_prefix: str,
        stub_workers: list[StubWorker]) -> None:
    retain = {"actions": [{"action_type": "kv.retain", "payload": {"priority": 50}}]}
    async with router_with_plugin(tmp_path, nats_url, subject_prefix, stub_workers,
                                  tenants=TENANTS, admin_keys=["root"]) as (router, client, _):
        for session in ("s1", "s2"):
            await _chat(client, router.url, session, "kb")
        await _chat(client, router.url, "s1", "ka")
        for key in ("aa", "bb", "bb"):
            response = await client.post(f"{router.url}/v1/sessions/s1/hints", json=retain,
                                         headers={"authorization": f"Bearer {key}"})
            assert response.status_code == 200, response.text

        async def overview(key: str) -> dict:
            return (await client.get(f"{router.url}/admin/overview",
                                     headers={"authorization": f"Bearer {key}"})).json()

        mine, fleet = await overview("aa"), await overview("root")
        assert {s["tenant"] for s in mine["sessions"]} == {"a"}
        assert sum(mine["sessions_by_state"].values()) == 1
        assert sum(fleet["sessions_by_state"].values()) == 3
        assert mine["totals"] is None and mine["timeline"] == []
        assert fleet["totals"]["requests"] == 3
        api = [h for h in mine["hints"] if h["source"] == "api"]
        assert {h["tenant"] for h in mine["hints"]} == {"a"} and len(api) == 1
        # Hint outcomes: a's own, against everyone's for the global admin.
        assert mine["hint_status_counts"]["accepted"] < \
            fleet["hint_status_counts"]["accepted"]
        assert (await overview("bb"))["hint_status_counts"]["accepted"] >= 2
        # The fleet's traffic is every tenant's: a tenant admin sees the workers' health,
        # not their request counts or the index's totals (before, it saw b's requests).
        assert [w["requests"] for w in fleet["workers"]] == [3]
        assert [(w["requests"], w["inflight"]) for w in mine["workers"]] == [(None, None)]
        (worker,) = mine["workers"]
        assert (worker["status"]["usage"], worker["index_blocks"], worker["held_by_hints"],
                worker["stream"]["counters"]) == (None, None, None, None)
        assert worker["status"]["supported_actions"] and worker["http_up"]
        (everyone,) = fleet["workers"]
        assert everyone["status"]["usage"] and everyone["held_by_hints"] is not None
        assert mine["index"] is None and "distinct_blocks" in fleet["index"]
        # The tenant's own latest hints, even when the fleet's last 50 are b's (before,
        # a's overview listed none of them).
        a_hint = [a for a in router.runtime.hints.recent if a.tenant == "a"][-1]
        b_hint = next(a for a in router.runtime.hints.recent if a.tenant == "b")
        router.runtime.hints.recent.extend(
            dataclasses.replace(b_hint, action_id=f"kva-b-{n}") for n in range(60))
        listed = [h["action_id"] for h in (await overview("aa"))["hints"]]
        assert a_hint.action_id in listed


async def test_admin_parameters_are_checked_before_any_store_read(
        tmp_path: Path, nats_url: str, subject_prefix: str,
        stub_workers: list[StubWorker]) -> None:
    """A NUL in a name reached PostgreSQL, which refused it: a 500 counted as an
    internal error. Now every name in an admin path or query is checked: a 422 that
    names the parameter. An unknown ``source`` was served from memory; now a 422."""
    async with router_with_plugin(tmp_path, nats_url, subject_prefix, stub_workers,
                                  tenants=TENANTS, admin_keys=["root"]) as (router, client, _):
        root = {"authorization": "Bearer root"}
        for path, params, name in (
                ("/admin/hints", {"session_id": "a\x00b"}, "session_id"),
                ("/admin/hints", {"worker_id": "w\x00"}, "worker_id"),
                ("/admin/sessions", {"state": "\x00", "source": "store"}, "state"),
                ("/admin/sessions", {"source": "bogus"}, "source"),
                # Not a session state: before, an empty list (a typo looked like "none").
                ("/admin/sessions", {"state": "bogus"}, "state"),
                ("/admin/sessions", {"state": "Active", "source": "store"}, "state"),
                ("/admin/hints", {"status": "acepted"}, "status"),
                ("/admin/sessions/a/x%00y", {}, "session_id"),
                ("/admin/sessions/a/x%0Ay", {}, "session_id"),  # no route matched: 404
                ("/admin/workers/w%01", {}, "worker_id")):
            response = await client.get(f"{router.url}{path}", params=params, headers=root)
            assert response.status_code == 422, (path, params, response.text)
            assert name in response.text
        assert "internal_error" not in router.runtime.metrics.render().decode()
        for status in typing.get_args(HintStatus):
            listed = await client.get(f"{router.url}/admin/hints", headers=root,
                                      params={"status": status})
            assert listed.status_code == 200, (status, listed.text)
        for state in ("active", "tool_gap", "ended"):
            for source in ("memory", "store"):
                listed = await client.get(f"{router.url}/admin/sessions", headers=root,
                                          params={"state": state, "source": source})
                assert listed.status_code == 200, (state, source, listed.text)



async def test_a_call_over_the_tenants_rate_says_when_to_retry(
        tmp_path: Path, nats_url: str, subject_prefix: str,
        stub_workers: list[StubWorker]) -> None:
    """Over ``max_actions_per_minute``: a 429 with Retry-After, the seconds until the
    call fits (before, none: a client could only guess or hammer)."""
    tenants = [{"name": "a", "api_keys": ["ka"], "admin_keys": ["aa"],
                "budget": {"max_actions_per_minute": 2}}]
    retain = {"actions": [{"action_type": "kv.retain", "payload": {"priority": 50}}]}
    async with router_with_plugin(tmp_path, nats_url, subject_prefix, stub_workers,
                                  tenants=tenants) as (router, client, _):
        await _chat(client, router.url, "s1", "ka")
        key = {"authorization": "Bearer aa"}  # hints need an admin key
        for _ in range(2):
            ok = await client.post(f"{router.url}/v1/sessions/s1/hints", json=retain,
                                   headers=key)
            assert ok.status_code == 200, ok.text
        over = await client.post(f"{router.url}/v1/sessions/s1/hints", json=retain,
                                 headers=key)
        assert over.status_code == 429 and "per minute" in over.text
        assert 1 <= int(over.headers["retry-after"]) <= 60


async def test_a_tenants_agents_may_hold_only_its_share_of_a_workers_pin_budget(
        tmp_path: Path, nats_url: str, subject_prefix: str,
        stub_workers: list[StubWorker]) -> None:
    """w0 may pin 100 blocks; tenant a's share is 0.02 (2 blocks), b's the equal share of
    two tenants (50). a's second pin is refused (429) while b's goes through, and a's
    agent holding still counts as a's after a restart of the router (restored from the
    store). Before, a's agents could pin all 100 blocks, leaving none for b."""
    pin = {"actions": [{"action_type": "kv.pin", "payload": {"ttl_s": 300}}]}
    tenants = [{**TENANTS[0], "budget": {"max_worker_share": 0.02}}, TENANTS[1]]
    async with router_with_plugin(tmp_path, nats_url, subject_prefix, stub_workers,
                                  tenants=tenants) as (router, client, _):
        for session in ("s1", "s2"):
            await _chat(client, router.url, session, "ka")
        await _chat(client, router.url, "s1", "kb")
        a, b = {"authorization": "Bearer aa"}, {"authorization": "Bearer bb"}
        first = await client.post(f"{router.url}/v1/sessions/s1/hints", json=pin, headers=a)
        assert first.status_code == 200, first.text
        second = await client.post(f"{router.url}/v1/sessions/s2/hints", json=pin, headers=a)
        assert second.status_code == 429, second.text
        message = second.json()["error"]["message"]
        assert "tenant 'a' on worker w0 (share 0.02) would hold" in message
        assert "pinned blocks (limit 2)" in message
        other = await client.post(f"{router.url}/v1/sessions/s1/hints", json=pin, headers=b)
        assert other.status_code == 200, other.text
        assert router.runtime.hints.holdings.api_on_worker("a", "w0").pinned_blocks == 2
    async with router_with_plugin(tmp_path, nats_url, subject_prefix, stub_workers,
                                  tenants=tenants) as (router, _client, _):
        holdings = router.runtime.hints.holdings
        assert holdings.api_on_worker("a", "w0").pinned_blocks == 2
        assert holdings.api_on_worker("b", "w0").pinned_blocks == 2


async def test_every_refused_hints_call_is_counted_by_reason(
        tmp_path: Path, nats_url: str, subject_prefix: str,
        stub_workers: list[StubWorker]) -> None:
    """A hints call refused (nothing sent) counts in hint_api_rejections_total under one
    of a fixed set of reasons; before, none was counted anywhere."""
    tenants = [{"name": "a", "api_keys": ["ka"], "admin_keys": ["aa"],
                "budget": {"max_actions_per_minute": 3, "max_pinned_blocks": 2}}]
    pin = {"actions": [{"action_type": "kv.pin", "payload": {"ttl_s": 300}}]}
    retain_r = {"wait_s": 0, "actions": [{"action_type": "kv.retain", "action_id": "r",
                                          "payload": {}}]}
    retain = {"wait_s": 0, "actions": [{"action_type": "kv.retain", "payload": {}}]}
    admin = {"authorization": "Bearer aa"}
    async with router_with_plugin(tmp_path, nats_url, subject_prefix, stub_workers,
                                  tenants=tenants, hints={"api_heartbeat_wait_s": 0},
                                  max_body_bytes=4096) as (router, client, plugin):
        for session in ("s1", "s2"):
            await _chat(client, router.url, session, "ka")
        router.runtime.workers.ensure("w-silent", stub_workers[1].url)  # no plugin
        expected: dict[str, int] = {}

        async def call(reason: str | None, code: int, session: str = "s1",
                       **request: Any) -> None:
            response = await client.post(f"{router.url}/v1/sessions/{session}/hints",
                                         **request)
            assert response.status_code == code, (reason, response.text)
            # OpenAI's SDKs retry a 409 or 429 unless told not to: only those a retry
            # can pass (a pending id, a rate) are left to them.
            no_retry = reason in ("over_budget", "session_ended")
            assert (response.headers.get("x-should-retry") == "false") == no_retry, reason
            if reason is not None:
                expected[reason] = expected.get(reason, 0) + 1

        await call("bad_request", 400, content=b"{not json", headers=admin)
        # A line break in the id: it matched no route (404, counted nowhere) before.
        await call("bad_request", 400, "s%0A1", json=pin, headers=admin)
        deep = b"[" * 1500 + b"1" + b"]" * 1500  # msgspec's RecursionError: was a 500
        await call("bad_request", 400, content=b'{"actions": [{"action_type": "kv.pin", '
                   b'"payload": {"x": ' + deep + b"}}]}", headers=admin)
        await call("too_large", 413, content=b" " * 5000, headers=admin)
        await call("unauthorized", 401, json=pin)
        await call("forbidden", 403, json=pin, headers={"authorization": "Bearer ka"})
        await call("unknown_session", 404, "nope", json=pin, headers=admin)
        await call("unknown_worker", 404, json={**pin, "worker_id": "w-none"}, headers=admin)
        await call("invalid_action", 422, json={"actions": []}, headers=admin)
        await call("no_plugin", 503, json={**pin, "worker_id": "w-silent"}, headers=admin)
        await call(None, 200, json=pin, headers=admin)  # 2 blocks pinned: the cap
        await call("over_budget", 429, "s2", json=pin, headers=admin)
        plugin.answer = False  # actions stay pending
        await call(None, 202, json=retain_r, headers=admin)
        await call("conflict", 409, json=retain_r, headers=admin)
        await call(None, 202, json=retain, headers=admin)  # the third this minute
        await call("over_rate", 429, json=retain, headers=admin)
        samples = await scrape(client, router.url)
        counted = {dict(labels)["reason"]: value for (name, labels), value in samples.items()
                   if name == "kvhint_router_hint_api_rejections_total"}
        assert {reason: value for reason, value in counted.items() if value} == expected
        assert set(counted) == set(HINT_API_REJECTIONS)  # every reason, at 0 if unused
