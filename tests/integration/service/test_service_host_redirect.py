"""No answer of the router sends a client to the origin a request's Host header names
(security review: Starlette's trailing-slash redirect built its absolute Location from
the Host header, so ``GET /dashboard/`` with a forged Host redirected to another site)."""

from __future__ import annotations

from pathlib import Path

import httpx

from conftest import StubWorker, router_settings, running_router


async def test_a_trailing_slash_with_a_forged_host_is_no_redirect_to_it(
        tmp_path: Path, stub_workers: list[StubWorker]) -> None:
    # Dev mode refuses a Host it does not know (DNS rebinding: origin_policy.py); listed,
    # the forged name reaches the routes, where the redirect was built from it.
    settings = router_settings(tmp_path, [("w0", stub_workers[0].url)],
                               allowed_hosts=["evil.example"])
    forged = {"host": "evil.example"}
    async with running_router(settings) as router, httpx.AsyncClient() as client:
        answers = [await client.get(f"{router.url}{path}", headers=forged)
                   for path in ("/dashboard/", "/admin/overview/", "/v1/models/", "/health/")]
        answers.append(await client.post(f"{router.url}/v1/chat/completions/",
                                         headers=forged, json={"model": "stub"}))
        # The paths themselves still answer, whatever the Host.
        assert (await client.get(f"{router.url}/dashboard", headers=forged)).status_code == 200
        assert (await client.get(f"{router.url}/health", headers=forged)).status_code == 200
    for answer in answers:
        assert answer.status_code == 404, (answer.request.url, answer.status_code)
        assert "location" not in answer.headers
        assert "evil.example" not in answer.text
