"""A tenant configured as ``default`` may not have keys (settings: tenancy review).

``default`` is the tenant of a global admin's own traffic (its inference and hints
naming no ``?tenant=``; all traffic in dev mode: tenancy.py). Before, a configured tenant
``default`` with keys of its own was that very tenant: its admin listed and its client
keys ended the global admin's own sessions, and both shared one cache salt (shown on
the router before this check: its admin saw the global admin's session "ops", its
client's DELETE ended it). A ``default`` tenant without keys stays what tests and
operators configure it for: the budget and limits of that traffic."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from conftest import StubWorker, router_settings, running_router
from pydantic import ValidationError

ROOT, A_ADMIN, A_CLIENT = ({"authorization": f"Bearer {key}"} for key in ("root", "aa", "ka"))
A = {"name": "a", "api_keys": ["ka"], "admin_keys": ["aa"]}


async def _turn(client: httpx.AsyncClient, url: str, headers: dict[str, str],
                session: str) -> None:
    response = await client.post(f"{url}/v1/chat/completions", headers=headers, json={
        "model": "stub", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
        "session_id": session})
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("keys", [{"api_keys": ["kd"]}, {"admin_keys": ["ad"]}])
def test_a_default_tenant_with_keys_is_refused_naming_the_setting(
        tmp_path: Path, keys: dict[str, list[str]]) -> None:
    with pytest.raises(ValidationError) as refused:
        router_settings(tmp_path, [("w0", "http://127.0.0.1:9")], admin_keys=["root"],
                        tenants=[A, {"name": "default", **keys}])
    message = str(refused.value)
    assert "tenants[1].name 'default' with api_keys or admin_keys" in message
    assert "global admin" in message


async def test_a_keyless_default_tenant_configures_the_global_admins_own_traffic(
        tmp_path: Path, stub_workers: list[StubWorker]) -> None:
    """Beside keyed tenants: the global admin's turn is tenant ``default``'s, under its
    configured budget; tenant a's admin does not see it, a's client cannot end it."""
    settings = router_settings(
        tmp_path, [("w0", stub_workers[0].url)], admin_keys=["root"],
        tenants=[A, {"name": "default", "budget": {"max_pinned_blocks": 2}}])
    async with running_router(settings) as router, httpx.AsyncClient(timeout=30) as client:
        url, runtime = router.url, router.runtime
        assert runtime.directory.budget("default").max_pinned_blocks == 2
        await _turn(client, url, ROOT, "ops")
        assert runtime.sessions.get("default", "ops") is not None
        listed = await client.get(f"{url}/admin/sessions", headers=A_ADMIN)
        assert listed.status_code == 200, listed.text
        assert "ops" not in listed.text
        ended = await client.delete(f"{url}/v1/sessions/ops", headers=A_CLIENT)
        assert ended.status_code == 404, ended.text
        assert runtime.sessions.get("default", "ops").state != "ended"
