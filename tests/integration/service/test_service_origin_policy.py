"""The router's browser policy on the real app (origin_policy.py): CORS, off by default and
then only for the OpenAI-compatible endpoints, and dev mode's Host check against DNS
rebinding (a page whose name its owner re-points at 127.0.0.1 is same-origin to the
browser: Sec-Fetch-Site says same-origin, and cross_site.py let it end sessions)."""

from __future__ import annotations

from pathlib import Path

import httpx

from conftest import StubWorker, router_settings, running_router, sample, scrape

APP = "https://chat.example"
EVIL = "https://evil.example"
CHAT = {"model": "stub", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def _preflight(origin: str, method: str = "POST",
               headers: str = "content-type, authorization, x-stainless-os"
               ) -> dict[str, str]:
    return {"origin": origin, "access-control-request-method": method,
            "access-control-request-headers": headers}


def _cors_headers(response: httpx.Response) -> dict[str, str]:
    return {k: v for k, v in response.headers.items() if k.startswith("access-control-")}


async def test_no_cors_header_anywhere_by_default(
        tmp_path: Path, stub_workers: list[StubWorker]) -> None:
    settings = router_settings(tmp_path, [("w0", stub_workers[0].url)])
    async with running_router(settings) as router, httpx.AsyncClient() as client:
        url = router.url
        answers = [
            await client.options(f"{url}/v1/chat/completions", headers=_preflight(APP)),
            await client.post(f"{url}/v1/chat/completions", json=CHAT,
                              headers={"origin": APP}),
            await client.get(f"{url}/v1/models", headers={"origin": APP}),
            await client.get(f"{url}/admin/overview", headers={"origin": APP}),
            await client.get(f"{url}/metrics", headers={"origin": APP}),
        ]
        assert answers[1].status_code == 200 and answers[2].status_code == 200
        for answer in answers:
            assert not _cors_headers(answer), answer.request.url


async def test_cors_for_an_allowed_origin_on_the_inference_endpoints_only(
        tmp_path: Path, stub_workers: list[StubWorker]) -> None:
    settings = router_settings(tmp_path, [("w0", stub_workers[0].url)],
                               cors_allowed_origins=[APP])  # dev mode: no key
    async with running_router(settings) as router, httpx.AsyncClient() as client:
        url, runtime = router.url, router.runtime
        granted = await client.options(f"{url}/v1/chat/completions", headers=_preflight(APP))
        assert granted.status_code == 204, granted.text
        assert granted.headers["access-control-allow-origin"] == APP
        assert granted.headers["access-control-allow-methods"] == "POST"
        assert granted.headers["access-control-allow-headers"] == (
            "content-type, authorization, x-stainless-os")
        assert "origin" in granted.headers["vary"].lower()
        assert "access-control-allow-credentials" not in granted.headers
        models = await client.options(f"{url}/v1/models", headers=_preflight(APP, "GET"))
        assert models.status_code == 204
        # Another origin, another method, a malformed header name: 403, counted.
        refused = [
            await client.options(f"{url}/v1/chat/completions", headers=_preflight(EVIL)),
            await client.options(f"{url}/v1/completions", headers=_preflight(APP, "PUT")),
            await client.options(f"{url}/v1/completions",
                                 headers=_preflight(APP, headers="x-ok, bad header")),
        ]
        for answer in refused:
            assert answer.status_code == 403 and not _cors_headers(answer), answer.text
        assert "cors_allowed_origins" in refused[0].text and "evil" not in refused[0].text
        # The admin and sessions APIs, the metrics and the dashboard never get one.
        await client.post(f"{url}/v1/chat/completions", json={**CHAT, "session_id": "s1"})
        for path in ("/admin/sessions/default/s1/end", "/v1/sessions/s1/hints",
                     "/v1/sessions/s1", "/metrics", "/dashboard", "/admin/overview"):
            for method in ("POST", "DELETE", "GET"):
                answer = await client.options(f"{url}{path}", headers=_preflight(APP, method))
                assert not _cors_headers(answer), (path, method)
            answer = await client.get(f"{url}{path}", headers={"origin": APP})
            assert not _cors_headers(answer), path
        # The actual requests: streamed or not, and the models list, readable by APP.
        answer = await client.post(f"{url}/v1/chat/completions", json=CHAT,
                                   headers={"origin": APP})
        assert answer.status_code == 200
        assert answer.headers["access-control-allow-origin"] == APP
        assert "x-kvhint-worker" in answer.headers["access-control-expose-headers"].lower()
        async with client.stream("POST", f"{url}/v1/chat/completions",
                                 json={**CHAT, "stream": True},
                                 headers={"origin": APP}) as streamed:
            assert streamed.status_code == 200
            assert streamed.headers["access-control-allow-origin"] == APP
            await streamed.aread()
        listed = await client.get(f"{url}/v1/models", headers={"origin": APP})
        assert listed.status_code == 200
        assert listed.headers["access-control-allow-origin"] == APP
        # An error answer too (the client reads why), but no header for another origin.
        bad = await client.post(f"{url}/v1/chat/completions", content=b"{",
                                headers={"origin": APP})
        assert bad.status_code == 400 and bad.headers["access-control-allow-origin"] == APP
        other = await client.post(f"{url}/v1/chat/completions", json=CHAT,
                                  headers={"origin": EVIL})
        assert other.status_code == 200 and not _cors_headers(other)
        # An allowed origin's page still cannot change state there (cross_site.py).
        ended = await client.post(f"{url}/admin/sessions/default/s1/end", headers={
            "origin": APP, "sec-fetch-site": "cross-site", "x-kvhint-request": "1"})
        assert ended.status_code == 403 and not _cors_headers(ended)
        assert runtime.sessions.get("default", "s1").state == "active"
        samples = await scrape(client, url)
        for reason in ("origin", "method", "headers"):
            assert sample(samples, "kvhint_router_cors_refusals_total", reason=reason) == 1
        assert sample(samples, "kvhint_router_cross_site_refusals_total",
                      endpoint="admin", reason="cross_site") == 1


async def test_any_origin_and_credentials_for_listed_origins(
        tmp_path: Path, stub_workers: list[StubWorker]) -> None:
    workers = [("w0", stub_workers[0].url)]
    keyed = {"tenants": [{"name": "a", "api_keys": ["ka"]}]}
    anyone = router_settings(tmp_path, workers, cors_allowed_origins=["*"], **keyed)
    async with running_router(anyone) as router, httpx.AsyncClient() as client:
        granted = await client.options(f"{router.url}/v1/completions",
                                       headers=_preflight(EVIL))
        assert granted.headers["access-control-allow-origin"] == "*"
        # Authorization is never covered by a "*": the requested names come back.
        assert "authorization" in granted.headers["access-control-allow-headers"]
        answer = await client.get(f"{router.url}/v1/models", headers={
            "origin": EVIL, "authorization": "Bearer ka"})
        assert answer.status_code == 200
        assert answer.headers["access-control-allow-origin"] == "*"
        # The key is checked as before.
        keyless = await client.get(f"{router.url}/v1/models", headers={"origin": EVIL})
        assert keyless.status_code == 401
    credentialed = router_settings(tmp_path, workers, cors_allowed_origins=[APP],
                                   cors_allow_credentials=True, **keyed)
    async with running_router(credentialed) as router, httpx.AsyncClient() as client:
        granted = await client.options(f"{router.url}/v1/chat/completions",
                                       headers=_preflight(APP))
        assert granted.headers["access-control-allow-origin"] == APP
        assert granted.headers["access-control-allow-credentials"] == "true"
        answer = await client.post(f"{router.url}/v1/chat/completions", json=CHAT,
                                   headers={"origin": APP, "authorization": "Bearer ka"})
        assert answer.status_code == 200
        assert answer.headers["access-control-allow-credentials"] == "true"


async def test_dev_mode_serves_only_loopback_addresses_and_allowed_hosts(
        tmp_path: Path, stub_workers: list[StubWorker]) -> None:
    settings = router_settings(tmp_path, [("w0", stub_workers[0].url)],
                               allowed_hosts=["gpu.lan"])
    async with running_router(settings) as router, httpx.AsyncClient() as client:
        url, runtime = router.url, router.runtime
        port = url.rsplit(":", 1)[1]
        await client.post(f"{url}/v1/chat/completions", json={**CHAT, "session_id": "v"})
        # A rebound page: same-origin to the browser, its own name in Host.
        rebound = {"host": f"evil.example:{port}", "origin": f"http://evil.example:{port}",
                   "sec-fetch-site": "same-origin", "x-kvhint-request": "1"}
        refused = [
            await client.post(f"{url}/admin/sessions/default/v/end", headers=rebound),
            await client.get(f"{url}/admin/overview", headers=rebound),
            await client.post(f"{url}/v1/chat/completions", json=CHAT, headers=rebound),
            await client.get(f"{url}/dashboard", headers={"host": "evil.example"}),
            await client.get(f"{url}/health", headers={"host": "router."}),
        ]
        for answer in refused:
            assert answer.status_code == 403, (answer.request.url, answer.text)
            assert "allowed_hosts" in answer.text and "evil" not in answer.text
        assert runtime.sessions.get("default", "v").state == "active"
        for host in ("localhost", f"localhost:{port}", "app.localhost", f"127.0.0.1:{port}",
                     "[::1]", "10.1.2.3:8080", "router:8080", "gpu.lan", f"GPU.lan:{port}"):
            answer = await client.get(f"{url}/health", headers={"host": host})
            assert answer.status_code == 200, host
        samples = await scrape(client, url)
        assert sample(samples, "kvhint_router_host_refusals_total") == len(refused)


async def test_keyed_mode_checks_no_host(tmp_path: Path,
                                         stub_workers: list[StubWorker]) -> None:
    settings = router_settings(tmp_path, [("w0", stub_workers[0].url)],
                               tenants=[{"name": "a", "api_keys": ["ka"]}])
    async with running_router(settings) as router, httpx.AsyncClient() as client:
        forged = {"host": "router.example.com", "authorization": "Bearer ka"}
        answer = await client.post(f"{router.url}/v1/chat/completions", json=CHAT,
                                   headers=forged)
        assert answer.status_code == 200, answer.text
        assert (await client.get(f"{router.url}/health", headers=forged)).status_code == 200
        samples = await scrape(client, router.url)
        assert sample(samples, "kvhint_router_host_refusals_total") == 0
