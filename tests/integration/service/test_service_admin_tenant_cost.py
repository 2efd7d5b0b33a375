"""A tenant admin's in-memory views (``/admin/sessions``, ``/admin/overview``: its
dashboard polls the latter every 2 s) read its own tenant's sessions only, not every
tenant's walked and filtered (tenancy review). Before, each call walked every session the
router holds: with 200,000 of another tenant's and 10,000 of its own, a tenant admin's
overview held the event loop, every tenant's traffic with it, for ~75-300 ms on the
review's machine, ~5 ms after."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from conftest import StubWorker, router_settings, running_router
from kvhint.router.service.sessions import SessionRecord, SessionRegistry

A_ADMIN, ROOT = ({"authorization": f"Bearer {key}"} for key in ("aa", "root"))


async def _turn(client: httpx.AsyncClient, url: str, key: str, session: str) -> None:
    response = await client.post(f"{url}/v1/chat/completions", json={
        "model": "stub", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
        "session_id": session}, headers={"authorization": f"Bearer {key}"})
    assert response.status_code == 200, response.text


async def test_a_tenant_admins_views_walk_only_its_own_sessions(
        tmp_path: Path, stub_workers: list[StubWorker],
        monkeypatch: pytest.MonkeyPatch) -> None:
    settings = router_settings(
        tmp_path, [("w0", stub_workers[0].url)], admin_keys=["root"],
        tenants=[{"name": "a", "api_keys": ["ka"], "admin_keys": ["aa"]},
                 {"name": "b", "api_keys": ["kb"], "admin_keys": ["ab"]}])
    async with running_router(settings) as router, httpx.AsyncClient(timeout=30) as client:
        url = router.url
        for n in range(3):
            await _turn(client, url, "ka", f"a-{n}")
        for n in range(4):
            await _turn(client, url, "kb", f"b-{n}")
        ended = await client.delete(f"{url}/v1/sessions/a-0",
                                    headers={"authorization": "Bearer ka"})
        assert ended.status_code == 200, ended.text

        # A spy, not a fake: it counts the walks of every tenant's sessions (the cost
        # under test, which no answer shows) and walks them as before.
        walks: list[int] = []
        whole_walk = SessionRegistry.__iter__

        def counted(registry: SessionRegistry) -> Iterator[SessionRecord]:
            walks.append(len(registry))
            return whole_walk(registry)

        monkeypatch.setattr(SessionRegistry, "__iter__", counted)

        async def get(path: str, headers: dict[str, str]) -> dict:
            response = await client.get(f"{url}{path}", headers=headers)
            assert response.status_code == 200, (path, response.text)
            return response.json()

        listed = await get("/admin/sessions", A_ADMIN)
        assert [s["session_id"] for s in listed["sessions"]] == ["a-2", "a-1", "a-0"]
        assert listed["total"] == 3
        active = await get("/admin/sessions?state=active&limit=1", A_ADMIN)
        assert [s["session_id"] for s in active["sessions"]] == ["a-2"]
        assert active["total"] == 2
        overview = await get("/admin/overview", A_ADMIN)
        assert [s["session_id"] for s in overview["sessions"]] == ["a-2", "a-1", "a-0"]
        assert overview["sessions_by_state"] == {"active": 2, "tool_gap": 0, "ended": 1}
        assert walks == [], f"a tenant admin's views walked every tenant's sessions: {walks}"
        # The fleet admin's views still hold every tenant's.
        fleet = await get("/admin/sessions", ROOT)
        assert fleet["total"] == 7
        assert {s["tenant"] for s in (await get("/admin/overview", ROOT))["sessions"]} \
            == {"a", "b"}
