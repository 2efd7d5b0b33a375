"""Every refused admin call is counted, by reason, in
``kvhint_router_admin_rejections_total`` (the router app with a stub worker and a SQLite
store): as the gateway's refusals are (requests_total by code), the hints API's and the
DELETE's (their rejection counters). Before, the admin API's were counted nowhere, and
then an /admin path no route serves (Starlette's own 404 and 405) still was not; nor was
any other path no route serves (``kvhint_router_route_refusals_total``)."""

from __future__ import annotations

from pathlib import Path

import httpx

from conftest import StubWorker, router_settings, running_router, sample, scrape
from kvhint.router.service.metric_labels import ADMIN_REJECTIONS, ROUTE_REFUSALS

REJECTIONS = "kvhint_router_admin_rejections_total"
ROUTES = "kvhint_router_route_refusals_total"
TENANTS = [{"name": "a", "api_keys": ["ka"], "admin_keys": ["aa"]},
           {"name": "b", "api_keys": ["kb"], "admin_keys": ["ab"]}]


async def test_every_refused_admin_call_is_counted_by_its_reason(
        tmp_path: Path, stub_workers: list[StubWorker]) -> None:
    settings = router_settings(tmp_path, [("w0", stub_workers[0].url)],
                               admin_keys=["root"], tenants=TENANTS)
    root, a_admin = {"authorization": "Bearer root"}, {"authorization": "Bearer aa"}
    async with running_router(settings) as router, httpx.AsyncClient() as client:
        url = router.url
        before = await _counts(client, url)
        assert before == dict.fromkeys(ADMIN_REJECTIONS, 0.0)  # every series from the start
        refusals = [
            ("GET", "/admin/sessions", {}, 401, "unauthorized"),
            ("GET", "/admin/sessions", {"authorization": "Bearer nope"}, 401, "unauthorized"),
            ("GET", "/admin/sessions", {"authorization": "Bearer ka"}, 403, "forbidden"),
            ("GET", "/admin/sessions?tenant=b", a_admin, 403, "forbidden"),
            ("GET", "/admin/sessions/b/s1", a_admin, 403, "forbidden"),
            ("POST", "/admin/sessions/a/s1/end", {**a_admin, "sec-fetch-site": "cross-site"},
             403, "cross_site"),
            ("GET", "/admin/sessions/a/nope", a_admin, 404, "unknown_session"),
            ("POST", "/admin/sessions/a/nope/end", root, 404, "unknown_session"),
            ("GET", "/admin/workers/nope", root, 404, "unknown_worker"),
            ("GET", "/admin/sessions?limit=0", root, 422, "bad_request"),
            ("GET", "/admin/hints?session_id=x%00", root, 422, "bad_request"),
            ("GET", "/admin/workers/w%01", root, 422, "bad_request"),
            # Paths no admin route serves: Starlette's refusals, by a bounded reason.
            ("GET", "/admin/nope", root, 404, "unknown_path"),
            ("GET", "/admin/secret-looking-name", {}, 404, "unknown_path"),
            ("GET", "/admin", root, 404, "unknown_path"),
            ("POST", "/admin/workers/w0/x", root, 404, "unknown_path"),
            ("DELETE", "/admin/workers", root, 405, "method_not_allowed"),
        ]
        expected = dict(before)
        for method, path, headers, status, reason in refusals:
            response = await client.request(method, f"{url}{path}", headers=headers)
            assert response.status_code == status, (path, response.text)
            expected[reason] += 1
            assert await _counts(client, url) == expected, (method, path)
        assert await _route_counts(client, url) == dict.fromkeys(ROUTE_REFUSALS, 0.0)
        # What is served is no refusal.
        for path in ("/admin/sessions", "/admin/workers/w0", "/admin/overview"):
            assert (await client.get(f"{url}{path}", headers=root)).status_code == 200
        assert await _counts(client, url) == expected


async def test_a_path_no_route_serves_is_counted_by_reason_never_by_its_path(
        tmp_path: Path, stub_workers: list[StubWorker]) -> None:
    """Outside /admin, Starlette's 404 (no route) and 405 (a route without the method)
    are counted in route_refusals (never in admin_rejections); a route's own 404 is not
    one of them, and no path becomes a label."""
    settings = router_settings(tmp_path, [("w0", stub_workers[0].url)],
                               admin_keys=["root"], tenants=TENANTS)
    async with running_router(settings) as router, httpx.AsyncClient() as client:
        url = router.url
        assert await _route_counts(client, url) == dict.fromkeys(ROUTE_REFUSALS, 0.0)
        for method, path, status in (("GET", "/nope-a-path", 404),
                                     ("POST", "/v1/embeddings", 404),
                                     ("GET", "/v1/models/", 404),
                                     ("GET", "/v1/chat/completions", 405),
                                     ("PUT", "/v1/sessions/s", 405)):
            response = await client.request(method, f"{url}{path}",
                                            headers={"authorization": "Bearer ka"})
            assert response.status_code == status, (path, response.text)
        # A route's own 404 (an unknown stored response): its API's, not a route refusal.
        missing = await client.get(f"{url}/v1/responses/resp_nope",
                                   headers={"authorization": "Bearer ka"})
        assert missing.status_code == 404, missing.text
        assert await _route_counts(client, url) == dict.fromkeys(ROUTE_REFUSALS, 0.0) | {
            "unknown_path": 3.0, "method_not_allowed": 2.0}
        assert await _counts(client, url) == dict.fromkeys(ADMIN_REJECTIONS, 0.0)
        text = (await client.get(f"{url}/metrics")).text
        assert "nope-a-path" not in text and "embeddings" not in text


async def _route_counts(client: httpx.AsyncClient, url: str) -> dict[str, float | None]:
    samples = await scrape(client, url)
    return {reason: sample(samples, ROUTES, reason=reason) for reason in ROUTE_REFUSALS}


async def _counts(client: httpx.AsyncClient, url: str) -> dict[str, float | None]:
    samples = await scrape(client, url)
    return {reason: sample(samples, REJECTIONS, reason=reason) for reason in ADMIN_REJECTIONS}
