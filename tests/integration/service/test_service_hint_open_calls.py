"""A tenant's hints calls open at once (``hints.api_max_open_calls``) through the real
router, a real NATS server and the real store: calls whose actions wait for outcomes
(``wait_s``) hold a connection each; past the cap one more is a 429 with ``Retry-After``,
nothing read or sent, counted per tenant. Before, a tenant could hold as many open as
its actions per minute (600 by default), whatever its other bounds.

The plugin is this test answering on w0's subject (test_service_hints_api.py): it holds
its outcomes back, as a worker slow to apply them would."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from conftest import StubWorker, sample, scrape
from feed_helpers import status, until
from test_service_hints_api import RememberingPlugin, _chat, router_with_plugin

pytestmark = pytest.mark.usefixtures("throwaway_streams")

TENANTS = [{"name": "a", "api_keys": ["ka"], "admin_keys": ["aa"]},
           {"name": "b", "api_keys": ["kb"], "admin_keys": ["bb"]}]
A_ADMIN, B_ADMIN = {"authorization": "Bearer aa"}, {"authorization": "Bearer bb"}


def _api_actions(plugin: RememberingPlugin) -> list[str]:
    """The actions sent through the hints API (the planner's own go too)."""
    return [action_id for action_id, _ in plugin.received if action_id.startswith("kva-")]


async def _heartbeats(plugin: RememberingPlugin) -> None:
    """w0's plugin heartbeats on (its interval: 0.5 s), as a live one's do."""
    while True:
        await plugin.nc.publish(plugin.subjects.status("w0"), status("w0", "e1", 0))
        await asyncio.sleep(0.25)


def _retain(wait_s: float) -> dict[str, object]:
    return {"wait_s": wait_s, "actions": [{"action_type": "kv.retain", "payload": {}}]}


async def test_a_tenants_waiting_hints_calls_past_its_cap_are_429(
        tmp_path: Path, nats_url: str, subject_prefix: str,
        stub_workers: list[StubWorker]) -> None:
    async with router_with_plugin(tmp_path, nats_url, subject_prefix, stub_workers,
                                  tenants=TENANTS,
                                  hints={"api_max_open_calls": 2}) as (router, client, plugin):
        plugin.answer = False  # outcomes held back: each call waits its wait_s
        beating = asyncio.create_task(_heartbeats(plugin))  # w0 stays alive
        try:
            await _chat(client, router.url, "s", "ka")
            await _chat(client, router.url, "s", "kb")
            url = f"{router.url}/v1/sessions/s/hints"
            waiting = [asyncio.create_task(client.post(url, json=_retain(3),
                                                       headers=A_ADMIN)) for _ in range(2)]
            await until(lambda: len(_api_actions(plugin)) == 2)
            refused = await client.post(url, json=_retain(3), headers=A_ADMIN)
            assert refused.status_code == 429, refused.text
            assert refused.headers["retry-after"] == "1"
            error = refused.json()["error"]
            assert error["type"] == "rate_limit_error"
            assert "api_max_open_calls" in error["message"] and "'a'" in error["message"]
            await asyncio.sleep(0.2)
            assert len(_api_actions(plugin)) == 2  # nothing sent
            # Another tenant's calls go on.
            other = await client.post(url, json=_retain(0), headers=B_ADMIN)
            assert other.status_code == 202, other.text
            for answer in await asyncio.gather(*waiting):
                assert answer.status_code == 202, answer.text  # still pending at wait_s
            # Answered: the tenant's calls are open again.
            again = await client.post(url, json=_retain(0), headers=A_ADMIN)
            assert again.status_code == 202, again.text
        finally:
            beating.cancel()
        samples = await scrape(client, router.url)
        assert sample(samples, "kvhint_router_gateway_rejections_total", tenant="a",
                      reason="over_open_hints") == 1
        assert sample(samples, "kvhint_router_gateway_rejections_total", tenant="b",
                      reason="over_open_hints") == 0
        assert sample(samples, "kvhint_router_hint_api_rejections_total",
                      reason="over_open_hints") == 1
