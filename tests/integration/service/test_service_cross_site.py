"""State-changing admin and session calls refuse what a page on another site can make the
operator's browser send (security review: in dev mode, open by design, an HTML form's
POST on any page the operator visited ended sessions, with no CORS preflight). What the
dashboard sends, and what curl and SDKs send with a bearer key, still goes through.
Browsers are played here by their request shapes (the headers a form POST or a no-cors
fetch carries); which headers the real page's script sends: test_service_dashboard_key."""

from __future__ import annotations

from pathlib import Path

import httpx

from conftest import StubWorker, router_settings, running_router, sample, scrape

FORM = "application/x-www-form-urlencoded"
EVIL = "https://evil.example"
# An HTML form on another site, in a browser that sends Sec-Fetch-Site and in one that
# does not; and a no-cors fetch of a JSON body as text/plain (no preflight either).
FORM_POST = {"content-type": FORM, "origin": EVIL, "sec-fetch-site": "cross-site"}
OLD_FORM_POST = {"content-type": FORM, "origin": EVIL}
TEXT_PLAIN = {"content-type": "text/plain;charset=UTF-8", "origin": EVIL}
HINTS_BODY = b'{"actions": [{"action_type": "kv.pin", "payload": {}}]}'


async def _turn(client: httpx.AsyncClient, url: str, session: str,
                headers: dict[str, str] | None = None) -> None:
    response = await client.post(f"{url}/v1/chat/completions", json={
        "model": "stub", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
        "session_id": session}, headers=headers)
    assert response.status_code == 200, response.text


async def test_dev_mode_refuses_cross_site_forms_and_takes_the_dashboards_requests(
        tmp_path: Path, stub_workers: list[StubWorker]) -> None:
    settings = router_settings(tmp_path, [("w0", stub_workers[0].url)])  # no key: dev mode
    async with running_router(settings) as router, httpx.AsyncClient() as client:
        url, runtime = router.url, router.runtime
        assert runtime.directory.dev_mode
        await _turn(client, url, "victim")
        end = f"{url}/admin/sessions/default/victim/end"
        for headers in (FORM_POST, OLD_FORM_POST):
            refused = await client.post(end, content=b"a=1", headers=headers)
            assert refused.status_code == 403, refused.text
            assert "X-Kvhint-Request" in refused.text or "cross-site" in refused.text
        # A no-cors fetch: no body, so no content type at all.
        bare = await client.post(end, headers={"origin": EVIL})
        assert bare.status_code == 403
        hinted = await client.post(f"{url}/v1/sessions/victim/hints", content=HINTS_BODY,
                                   headers=TEXT_PLAIN)
        assert hinted.status_code == 403 and "X-Kvhint-Request" in hinted.text
        # DELETE needs a preflight the router never grants; a browser's says where from.
        deleted = await client.delete(f"{url}/v1/sessions/victim",
                                      headers={"origin": EVIL, "sec-fetch-site": "cross-site"})
        assert deleted.status_code == 403
        preflight = await client.options(end, headers={
            "origin": EVIL, "access-control-request-method": "POST",
            "access-control-request-headers": "x-kvhint-request"})
        assert "access-control-allow-origin" not in preflight.headers
        # Nothing changed: the session is still active, no hint was sent.
        assert runtime.sessions.get("default", "victim").state == "active"
        assert not any(a.source == "api" for a in runtime.hints.recent)
        assert not any(a.source == "api" for a in runtime.hints.pending.values())
        samples = await scrape(client, url)

        def refusals(endpoint: str, reason: str) -> float | None:
            return sample(samples, "kvhint_router_cross_site_refusals_total",
                          endpoint=endpoint, reason=reason)
        assert refusals("admin", "cross_site") == 1
        assert refusals("admin", "no_marker") == 2
        assert refusals("session_hints", "no_marker") == 1
        assert refusals("session_end", "cross_site") == 1
        assert sample(samples, "kvhint_router_hint_api_rejections_total",
                      reason="cross_site") == 1
        assert sample(samples, "kvhint_router_session_end_rejections_total",
                      reason="cross_site") == 1
        # The dashboard's own request shape: same origin, X-Kvhint-Request (and its key,
        # where there is one); its reads go through as before.
        own = {"origin": url, "sec-fetch-site": "same-origin",
               "x-kvhint-request": "dashboard"}
        assert (await client.get(f"{url}/admin/overview", headers=own)).status_code == 200
        ended = await client.post(end, headers=own)
        assert ended.status_code == 200, ended.text
        assert runtime.sessions.get("default", "victim").state == "ended"
        # A dev-mode client without a key: the header, or JSON (the hints call).
        await _turn(client, url, "scripted")
        scripted = await client.post(f"{url}/admin/sessions/default/scripted/end",
                                     headers={"x-kvhint-request": "1"})
        assert scripted.status_code == 200, scripted.text
        as_json = await client.post(f"{url}/v1/sessions/scripted/hints", json={
            "actions": [{"action_type": "kv.pin", "payload": {}}]})
        assert as_json.status_code != 403, as_json.text  # past the check (no plugin: 503)


async def test_bearer_clients_pass_and_a_keyless_call_is_still_unauthorized(
        tmp_path: Path, stub_workers: list[StubWorker]) -> None:
    settings = router_settings(
        tmp_path, [("w0", stub_workers[0].url)], admin_keys=["root"],
        tenants=[{"name": "a", "api_keys": ["ka"], "admin_keys": ["aa"]}])
    async with running_router(settings) as router, httpx.AsyncClient() as client:
        url, runtime = router.url, router.runtime
        for session in ("s1", "s2", "s3"):
            await _turn(client, url, session, {"authorization": "Bearer ka"})
        # curl -X POST -H 'Authorization: Bearer ...' [-d ...]: no JSON type, no header.
        for key, session, body in (("root", "s1", None), ("aa", "s2", b"x=1")):
            ended = await client.post(f"{url}/admin/sessions/a/{session}/end", content=body,
                                      headers={"authorization": f"Bearer {key}",
                                               **({"content-type": FORM} if body else {})})
            assert ended.status_code == 200, ended.text
        gone = await client.delete(f"{url}/v1/sessions/s3",
                                   headers={"authorization": "Bearer ka"})
        assert gone.status_code == 200, gone.text
        # curl -d '{...}' sends a form content type: a key is enough.
        hinted = await client.post(
            f"{url}/v1/sessions/s1/hints", content=HINTS_BODY,
            headers={"authorization": "Bearer aa", "content-type": FORM})
        assert hinted.status_code != 403, hinted.text
        # A cross-site form carries no key: 401 as before (refused before this check).
        for headers in (FORM_POST, OLD_FORM_POST):
            refused = await client.post(f"{url}/admin/sessions/a/s1/end", headers=headers)
            assert refused.status_code == 401, refused.text
        samples = await scrape(client, url)
        assert not any(value for (name, _labels), value in samples.items()
                       if name == "kvhint_router_cross_site_refusals_total")
        assert [runtime.sessions.get("a", s).state for s in ("s1", "s2", "s3")] == [
            "ended", "ended", "ended"]
