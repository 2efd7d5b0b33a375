"""What a refused hints call tells its caller, against a real NATS server and the real
store (w0's plugin played by the test, as in test_service_hints_api): a call over the
tenant's pin budget is a 429 that OpenAI's SDKs do not retry (``x-should-retry:
false``), naming the bound and what brings room back, and that room does come back
when the tenant releases its holds; a call with more actions than the tenant may send
in a whole minute is a 422 (it can never pass), not a 429 that says "later"."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import StubWorker, sample, scrape
from test_service_hints_api import _chat, router_with_plugin

pytestmark = pytest.mark.usefixtures("throwaway_streams")

ADMIN = {"authorization": "Bearer aa"}
PIN = {"actions": [{"action_type": "kv.pin", "payload": {"ttl_s": 300}}]}


async def test_a_call_over_the_pin_budget_names_it_and_what_frees_room(
        tmp_path: Path, nats_url: str, subject_prefix: str,
        stub_workers: list[StubWorker]) -> None:
    tenants = [{"name": "a", "api_keys": ["ka"], "admin_keys": ["aa"],
                "budget": {"max_pinned_blocks": 2}}]
    async with router_with_plugin(tmp_path, nats_url, subject_prefix, stub_workers,
                                  tenants=tenants) as (router, client, _plugin):
        for session in ("s1", "s2"):
            await _chat(client, router.url, session, "ka")
        hints = f"{router.url}/v1/sessions/{{}}/hints".format
        assert (await client.post(hints("s1"), json=PIN, headers=ADMIN)).status_code == 200
        refused = await client.post(hints("s2"), json=PIN, headers=ADMIN)
        assert refused.status_code == 429, refused.text
        assert refused.headers["x-should-retry"] == "false"  # the same call would fail
        assert "retry-after" not in refused.headers  # no time the router knows
        message = refused.json()["error"]["message"]
        assert "would hold" in message and "pinned blocks (limit 2)" in message, message
        assert "priority 0" in message and "TTL" in message, message

        # What the answer says frees room does: s1's agent Pin released, s2's fits.
        release = {"actions": [{"action_type": "kv.retain", "payload": {"priority": 0}}]}
        answer = await client.post(hints("s1"), json=release, headers=ADMIN)
        assert answer.status_code == 200, answer.text
        answer = await client.post(hints("s2"), json=PIN, headers=ADMIN)
        assert answer.status_code == 200, answer.text


async def test_more_actions_in_one_call_than_a_minutes_rate_is_a_422(
        tmp_path: Path, nats_url: str, subject_prefix: str,
        stub_workers: list[StubWorker]) -> None:
    """Before, a 429 (``x-should-retry: false``, counted as over_rate): a limit reached,
    for a call that no wait lets through."""
    tenants = [{"name": "a", "api_keys": ["ka"], "admin_keys": ["aa"],
                "budget": {"max_actions_per_minute": 1}}]
    two = {"actions": PIN["actions"] * 2}
    async with router_with_plugin(tmp_path, nats_url, subject_prefix, stub_workers,
                                  tenants=tenants) as (router, client, plugin):
        await _chat(client, router.url, "s1", "ka")
        url = f"{router.url}/v1/sessions/s1/hints"
        refused = await client.post(url, json=two, headers=ADMIN)
        assert refused.status_code == 422, refused.text
        error = refused.json()["error"]
        assert error["type"] == "invalid_request_error"
        assert "budget.max_actions_per_minute is 1" in error["message"], error
        assert not [a for a, _ in plugin.received if a.startswith("kva-")]  # the API's
        # One fits; the next one in the minute is the rate's, a 429 with Retry-After.
        assert (await client.post(url, json=PIN, headers=ADMIN)).status_code == 200
        later = await client.post(url, json=PIN, headers=ADMIN)
        assert later.status_code == 429 and int(later.headers["retry-after"]) >= 1
        assert "x-should-retry" not in later.headers
        assert "max_actions_per_minute" in later.json()["error"]["message"]
        samples = await scrape(client, router.url)
        assert sample(samples, "kvhint_router_hint_api_rejections_total",
                      reason="invalid_action") == 1
        assert sample(samples, "kvhint_router_hint_api_rejections_total",
                      reason="over_rate") == 1
