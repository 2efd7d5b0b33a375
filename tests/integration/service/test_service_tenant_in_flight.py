"""Each tenant's requests in flight, on /metrics: ``kvhint_router_tenant_in_flight{tenant}``
is the count its ``max_in_flight`` is checked against, kept for a tenant without one too.
Through the router's HTTP front (real tokenizer, a stub worker that answers late)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx

from conftest import StubWorker, router_settings, running_router, sample, scrape
from feed_helpers import until

CHAT = {"model": "stub", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
TENANTS = [{"name": "acme", "api_keys": ["ka"], "max_in_flight": 2},
           {"name": "beta", "api_keys": ["kb"]}]
ACME = {"Authorization": "Bearer ka"}
BETA = {"Authorization": "Bearer kb"}
GAUGE = "kvhint_router_tenant_in_flight"


async def test_each_tenants_requests_in_flight_are_a_gauge_with_or_without_a_cap(
        tmp_path: Path, stub_workers: list[StubWorker]) -> None:
    """Two of acme's requests (its cap) and one of beta's (no cap) held by the worker: the
    gauge says 2 and 1; a third of acme's is refused and does not count; all answered, 0.
    Before, only the refusals were counted (gateway_rejections_total): how close a tenant
    was to its cap showed nowhere, and a tenant without a cap was not counted at all."""
    stub = stub_workers[0]
    settings = router_settings(tmp_path, [("w0", stub.url)], tenants=TENANTS)
    async with running_router(settings) as router, httpx.AsyncClient(timeout=30) as client:
        slots = router.runtime.forwarder.slots
        url = f"{router.url}/v1/chat/completions"
        samples = await scrape(client, router.url)
        assert sample(samples, GAUGE, tenant="acme") == 0  # there before any request
        assert sample(samples, GAUGE, tenant="beta") == 0
        stub.answer_delay_s = 0.5
        held = [asyncio.create_task(client.post(url, json=CHAT, headers=headers))
                for headers in (ACME, ACME, BETA)]
        await until(lambda: (slots.held("acme"), slots.held("beta")) == (2, 1))
        refused = await client.post(url, json=CHAT, headers=ACME)
        assert refused.status_code == 429
        samples = await scrape(client, router.url)
        assert sample(samples, GAUGE, tenant="acme") == 2
        assert sample(samples, GAUGE, tenant="beta") == 1
        assert [r.status_code for r in await asyncio.gather(*held)] == [200, 200, 200]
        await until(lambda: (slots.held("acme"), slots.held("beta")) == (0, 0))
        samples = await scrape(client, router.url)
        assert sample(samples, GAUGE, tenant="acme") == 0
        assert sample(samples, GAUGE, tenant="beta") == 0


async def test_the_429_past_max_in_flight_is_the_routers_own_error_answer(
        tmp_path: Path, stub_workers: list[StubWorker]) -> None:
    """A request past its tenant's max_in_flight is answered as every other refusal of
    the router's own: JSON, ``nosniff`` (never read as anything else from the dashboard's
    origin), with ``Retry-After``. Before, this one answer lacked ``nosniff``."""
    stub = stub_workers[0]
    settings = router_settings(tmp_path, [("w0", stub.url)], tenants=TENANTS)
    async with running_router(settings) as router, httpx.AsyncClient(timeout=30) as client:
        slots = router.runtime.forwarder.slots
        url = f"{router.url}/v1/chat/completions"
        stub.answer_delay_s = 0.5
        held = [asyncio.create_task(client.post(url, json=CHAT, headers=ACME))
                for _ in range(2)]
        await until(lambda: slots.held("acme") == 2)
        refused = await client.post(url, json=CHAT, headers=ACME)
        assert refused.status_code == 429
        assert refused.headers["x-content-type-options"] == "nosniff"
        assert refused.headers["retry-after"] == "1"
        assert refused.headers["content-type"] == "application/json"
        error = refused.json()["error"]
        assert error["type"] == "rate_limit_error" and "max_in_flight" in error["message"]
        assert [r.status_code for r in await asyncio.gather(*held)] == [200, 200]
