"""A tenant admin's key reads its own tenant's sessions only, through every admin
endpoint the dashboard and operators use, however the other tenant's name and session id
are spelt in the path (``/``, ``%2F``, ``..``, percent-encoded letters) or the query
(repeated parameters, the store as source) (security review)."""

from __future__ import annotations

from pathlib import Path

import httpx

from conftest import StubWorker, router_settings, running_router

A_ADMIN = {"authorization": "Bearer aa"}


async def _turn(client: httpx.AsyncClient, url: str, key: str, session: str) -> None:
    response = await client.post(f"{url}/v1/chat/completions", json={
        "model": "stub", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
        "session_id": session}, headers={"authorization": f"Bearer {key}"})
    assert response.status_code == 200, response.text


async def test_a_tenant_admin_reads_no_other_tenants_sessions(
        tmp_path: Path, stub_workers: list[StubWorker]) -> None:
    settings = router_settings(
        tmp_path, [("w0", stub_workers[0].url)], admin_keys=["root"],
        tenants=[{"name": "a", "api_keys": ["ka"], "admin_keys": ["aa"]},
                 {"name": "b", "api_keys": ["kb"], "admin_keys": ["ab"]}])
    async with running_router(settings) as router, httpx.AsyncClient() as client:
        await _turn(client, router.url, "ka", "mine")
        for session in ("s1", "x/y", "a/s1"):
            await _turn(client, router.url, "kb", session)
        url = router.url

        async def get(path: str, **params: str | list[str]) -> httpx.Response:
            # A raw path: httpx would otherwise resolve "..".
            return await client.get(httpx.URL(url + path, params=params), headers=A_ADMIN)

        # The other tenant named in the path, plainly or encoded: refused.
        for path in ("/admin/sessions/b/s1", "/admin/sessions/b%2Fs1",
                     "/admin/sessions/%62/s1", "/admin/sessions/b/x%2Fy",
                     "/admin/sessions/b/x/y"):
            response = await get(path)
            assert response.status_code == 403, (path, response.status_code)
        # Its own tenant with the other's name inside the session id: its own (none).
        for path in ("/admin/sessions/a/..%2Fb%2Fs1", "/admin/sessions/a/%2E%2E/b/s1",
                     "/admin/sessions/a/b/s1"):
            response = await get(path)
            assert response.status_code == 404, (path, response.status_code)
        # b's session "a/s1" is b's, not a's session "s1".
        assert (await get("/admin/sessions/a/s1")).status_code == 404
        ended = await client.post(f"{url}/admin/sessions/b/s1/end", headers=A_ADMIN)
        assert ended.status_code == 403
        # Queries.
        for params in ({"tenant": "b"}, {"tenant": ["a", "b"]},
                       {"tenant": "b", "source": "store"}):
            response = await get("/admin/sessions", **params)
            assert response.status_code == 403, (params, response.status_code)
        for params in ({}, {"source": "store"}, {"tenant": "a"}, {"tenant": ["b", "a"]}):
            response = await get("/admin/sessions", **params)
            assert response.status_code == 200, params
            assert {s["tenant"] for s in response.json()["sessions"]} == {"a"}, params
        assert (await get("/admin/hints", tenant="b")).status_code == 403
        hints = (await get("/admin/hints", session_id="s1")).json()
        assert hints["hints"] == []
        overview = (await get("/admin/overview")).json()
        assert [(s["tenant"], s["session_id"])
                for s in overview["sessions"]] == [("a", "mine")]
        assert set(overview["learned"]) == {"a"}
        for worker in (await get("/admin/workers")).json()["workers"]:
            assert worker["requests"] is None and worker["inflight"] is None
        # b's session is still there and active (the refused end did nothing).
        still = await client.get(f"{url}/admin/sessions/b/s1",
                                 headers={"authorization": "Bearer ab"})
        assert still.status_code == 200 and still.json()["state"] == "active"
