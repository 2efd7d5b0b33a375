"""Names in the admin API's paths and queries follow the gateway's rule for session ids
(safe_text.py, one function): before, the admin API refused C0 controls and DEL only
(a pattern of its own), so a tenant, session or worker name holding a bidi override, a
C1 control, a zero-width or other format character or a line separator was taken, and
went on into the store's queries and the answer. Each is a 422 naming the parameter and
the character, escaped, counted as ``bad_request``; an emoji ZWJ sequence passes, as it
does at the gateway (test_service_session_id_emoji.py)."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import quote

import httpx
import pytest

from kvhint.router.safe_text import unsafe_char

from conftest import StubWorker, router_settings, running_router, sample, scrape

ROOT = {"authorization": "Bearer root"}
TENANTS = [{"name": "a", "api_keys": ["ka"]}]

# Each one passed the admin API's old pattern; the gateway refused each in a session id.
SPOOFING = {
    "rlo": "user\u202egnp",
    "c1_nel": "s\x851",
    "zwsp": "ad\u200bmin",
    "zwj_in_letters": "ad\u200dmin",
    "line_separator": "a\u2028b",
    "bom": "\ufeffa",
    "soft_hyphen": "a\u00adb",
}


def _calls(value: str) -> list[tuple[str, str, dict[str, str], str]]:
    """(method, path, query, the parameter refused) for each admin name."""
    quoted = quote(value)
    return [("GET", "/admin/sessions", {"tenant": value}, "tenant"),
            ("GET", f"/admin/sessions/{quoted}/s1", {}, "tenant"),
            ("GET", f"/admin/sessions/a/{quoted}", {}, "session_id"),
            ("POST", f"/admin/sessions/a/{quoted}/end", {}, "session_id"),
            ("GET", f"/admin/workers/{quoted}", {}, "worker_id"),
            ("GET", "/admin/hints", {"tenant": value}, "tenant"),
            ("GET", "/admin/hints", {"session_id": value}, "session_id"),
            ("GET", "/admin/hints", {"worker_id": value}, "worker_id")]


@pytest.mark.parametrize("value", SPOOFING.values(), ids=SPOOFING.keys())
async def test_admin_names_refuse_what_session_ids_refuse(
        value: str, tmp_path: Path, stub_workers: list[StubWorker]) -> None:
    settings = router_settings(tmp_path, [("w0", stub_workers[0].url)],
                               admin_keys=["root"], tenants=TENANTS)
    async with running_router(settings) as router, httpx.AsyncClient() as client:
        calls = _calls(value)
        for method, path, query, param in calls:
            response = await client.request(method, f"{router.url}{path}", params=query,
                                            headers=ROOT)
            assert response.status_code == 422, (path, query, response.text)
            assert response.headers["x-content-type-options"] == "nosniff"
            error = response.json()["error"]
            assert error["param"] == param, error
            assert "format character" in error["message"], error
            # Named escaped, never echoed raw.
            assert unsafe_char(error["message"]) is None, error
        samples = await scrape(client, router.url)
        assert sample(samples, "kvhint_router_admin_rejections_total",
                      reason="bad_request") == len(calls)


async def test_ordinary_and_emoji_names_still_pass(
        tmp_path: Path, stub_workers: list[StubWorker]) -> None:
    settings = router_settings(tmp_path, [("w0", stub_workers[0].url)],
                               admin_keys=["root"], tenants=TENANTS)
    async with running_router(settings) as router, httpx.AsyncClient() as client:
        for value in ("caf\u00e9", "agent-7/run:42",
                      "\U0001f468\u200d\U0001f469\u200d\U0001f467"):
            for method, path, query, _param in _calls(value):
                response = await client.request(method, f"{router.url}{path}",
                                                params=query, headers=ROOT)
                # Not refused for its name: unknown (404) or served (200).
                assert response.status_code in (200, 404), (path, query, response.text)
        samples = await scrape(client, router.url)
        assert sample(samples, "kvhint_router_admin_rejections_total",
                      reason="bad_request") == 0


async def test_names_are_still_bounded(tmp_path: Path,
                                       stub_workers: list[StubWorker]) -> None:
    """The bound the old pattern came with (512 characters) holds with the new check."""
    settings = router_settings(tmp_path, [("w0", stub_workers[0].url)],
                               admin_keys=["root"], tenants=TENANTS)
    async with running_router(settings) as router, httpx.AsyncClient() as client:
        for value, answers in (("w" * 512, (200, 404)), ("w" * 513, (422,))):
            for method, path, query, _param in _calls(value):
                response = await client.request(method, f"{router.url}{path}",
                                                params=query, headers=ROOT)
                assert response.status_code in answers, (path, len(value), response.text)
