"""A tenant's calls to the session and admin endpoints through the real router
(``tenants[].api_calls``, a token bucket): past it, an end, a hints call or an admin call
is a 429 with ``Retry-After`` naming the bound, refused before it reads the store (or
its body), counted per tenant; other tenants' calls, and a global admin's (charged to
``default``), go on. Before, a tenant's client could send ends (each a store read of an
id not in memory, and an end's sends to its worker) without any bound, and a tenant
admin's refused hints calls and admin reads were not bounded either."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx

from conftest import StubWorker, router_settings, running_router, sample, scrape

# 0.5 per second: the three calls a burst allows never earn a fourth token meanwhile.
TENANTS = [{"name": "acme", "api_keys": ["ka"], "admin_keys": ["aa"],
            "api_calls": {"per_s": 0.5, "burst": 3}},
           {"name": "beta", "api_keys": ["kb"]},
           {"name": "default", "api_calls": {"per_s": 0.5, "burst": 1}}]
ACME, ACME_ADMIN = {"Authorization": "Bearer ka"}, {"Authorization": "Bearer aa"}
BETA, ROOT = {"Authorization": "Bearer kb"}, {"Authorization": "Bearer root"}
HINTS = {"actions": [{"action_type": "kv.pin", "payload": {}}]}


async def test_a_tenants_session_and_admin_calls_past_its_rate_are_429_before_any_read(
        tmp_path: Path, stub_workers: list[StubWorker]) -> None:
    settings = router_settings(tmp_path, [("w0", stub_workers[0].url)], tenants=TENANTS,
                               admin_keys=["root"])
    async with running_router(settings) as router, httpx.AsyncClient(timeout=30) as client:
        url = router.url
        for n in range(3):  # the burst: each an end of an id not in memory, a store read
            answer = await client.delete(f"{url}/v1/sessions/gone{n}", headers=ACME)
            assert answer.status_code == 404, answer.text
        reads = sample(await scrape(client, url), "kvhint_router_session_reads_total",
                       outcome="missing")
        assert reads == 3

        refused = [await client.delete(f"{url}/v1/sessions/gone9", headers=ACME),
                   await client.post(f"{url}/v1/sessions/gone9/hints", json=HINTS,
                                     headers=ACME_ADMIN),
                   await client.get(f"{url}/admin/sessions?source=store",
                                    headers=ACME_ADMIN)]
        for answer in refused:
            assert answer.status_code == 429, answer.text
            assert answer.headers["retry-after"] in ("1", "2"), answer.headers
            assert "x-should-retry" not in answer.headers  # a retry later passes
            error = answer.json()["error"]
            assert error["type"] == "rate_limit_error"
            assert "'acme'" in error["message"] and "api_calls" in error["message"]

        # Other tenants' calls go on; a global admin's are default's, not acme's.
        assert (await client.delete(f"{url}/v1/sessions/x", headers=BETA)).status_code == 404
        answer = await client.delete(f"{url}/v1/sessions/x?tenant=acme", headers=ROOT)
        assert answer.status_code == 404, answer.text
        answer = await client.delete(f"{url}/v1/sessions/y?tenant=acme", headers=ROOT)
        assert answer.status_code == 429 and "'default'" in answer.json()["error"]["message"]

        samples = await scrape(client, url)
        # The refused calls read nothing (beta's and root's first end read one each).
        assert sample(samples, "kvhint_router_session_reads_total", outcome="missing") == 5
        assert sample(samples, "kvhint_router_gateway_rejections_total", tenant="acme",
                      reason="over_call_rate") == 3
        assert sample(samples, "kvhint_router_gateway_rejections_total", tenant="default",
                      reason="over_call_rate") == 1
        assert sample(samples, "kvhint_router_gateway_rejections_total", tenant="beta",
                      reason="over_call_rate") == 0
        assert sample(samples, "kvhint_router_session_end_rejections_total",
                      reason="over_call_rate") == 2
        assert sample(samples, "kvhint_router_hint_api_rejections_total",
                      reason="over_call_rate") == 1
        assert sample(samples, "kvhint_router_admin_rejections_total",
                      reason="over_call_rate") == 1

        await asyncio.sleep(2.1)  # a token back: the next call passes
        answer = await client.get(f"{url}/admin/sessions", headers=ACME_ADMIN)
        assert answer.status_code == 200, answer.text
