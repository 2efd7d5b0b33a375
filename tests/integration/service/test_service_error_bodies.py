"""The router's own error answers, on every path, in one shape (OpenAI's: ``{"error":
{"message", "type", "param", "code"}}``) with one ``type`` per status: the gateway's,
the sessions API's, the admin API's, and Starlette's for an unknown route or method."""

from __future__ import annotations

from pathlib import Path

import httpx

from conftest import StubWorker, router_settings, running_router
from kvhint.router.service.inbound import error_type_of

TENANTS = [{"name": "a", "api_keys": ["ka"], "admin_keys": ["aa"]}]
CHAT = {"model": "stub", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def _error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, (response.request.url, response.text)
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert {"message", "type", "code"} <= set(error) and error["code"] == status, error
    assert isinstance(error["message"], str) and error["message"], error
    return error


async def test_the_sessions_api_answers_auth_errors_as_the_gateway_does(
        tmp_path: Path, stub_workers: list[StubWorker]) -> None:
    """401 and 403 from the sessions API have the gateway's type for the status
    (``authentication_error``); before, ``invalid_request_error``."""
    settings = router_settings(tmp_path, [("w0", stub_workers[0].url)], tenants=TENANTS)
    async with running_router(settings) as router, httpx.AsyncClient() as client:
        url = router.url
        gateway = _error(await client.post(f"{url}/v1/chat/completions", json=CHAT), 401)
        assert gateway["type"] == "authentication_error"
        unknown = {"authorization": "Bearer nope"}
        for response, status in (
                (await client.delete(f"{url}/v1/sessions/s"), 401),
                (await client.delete(f"{url}/v1/sessions/s", headers=unknown), 401),
                (await client.post(f"{url}/v1/sessions/s/hints", json={"actions": []}), 401),
                (await client.delete(f"{url}/v1/sessions/s", params={"tenant": "b"},
                                     headers={"authorization": "Bearer ka"}), 403),
                (await client.post(f"{url}/v1/sessions/s/hints", json={"actions": []},
                                   headers={"authorization": "Bearer ka"}), 403)):
            error = _error(response, status)
            assert error["type"] == error_type_of(status) == gateway["type"], error


async def test_unknown_routes_wrong_methods_and_admin_refusals_answer_in_the_error_shape(
        tmp_path: Path, stub_workers: list[StubWorker]) -> None:
    """An unknown route (404), a route without the method (405, its Allow header kept)
    and the admin API's refusals answer as every other error does; before, FastAPI's
    ``{"detail": ...}``. Statuses are unchanged, and the admin API still serves its
    admins."""
    settings = router_settings(tmp_path, [("w0", stub_workers[0].url)], tenants=TENANTS)
    admin = {"authorization": "Bearer aa"}
    async with running_router(settings) as router, httpx.AsyncClient() as client:
        url = router.url
        assert _error(await client.get(f"{url}/nope"), 404)["type"] == "invalid_request_error"
        assert _error(await client.get(f"{url}/v1/models/"), 404)["message"] == "Not Found"
        for method, path, allowed in (("GET", "/v1/chat/completions", "POST"),
                                      ("PUT", "/v1/sessions/s", "DELETE"),
                                      ("GET", "/v1/completions", "POST"),
                                      ("DELETE", "/health", "GET")):
            response = await client.request(method, f"{url}{path}", headers=admin)
            error = _error(response, 405)
            assert error["type"] == "invalid_request_error" and error["message"] == (
                "Method Not Allowed")
            assert allowed in response.headers["allow"], response.headers
        for path, headers, status in (("/admin/sessions", {}, 401),
                                      ("/admin/sessions", {"authorization": "Bearer ka"}, 403),
                                      ("/admin/workers/nope", admin, 404)):
            error = _error(await client.get(f"{url}{path}", headers=headers), status)
            assert error["type"] == error_type_of(status), error
        listed = await client.get(f"{url}/admin/workers", headers=admin)
        assert listed.status_code == 200 and "workers" in listed.json()


async def test_a_bad_admin_parameter_answers_422_in_the_error_shape_without_its_value(
        tmp_path: Path, stub_workers: list[StubWorker]) -> None:
    """A query or path parameter FastAPI refuses (out of bounds, not a number, a control
    character in a name, not one of the values) answered ``{"detail": [...]}`` with the
    value sent in each item's ``input``. Now 422 (as before) in the error shape: the
    message names the parameter and what was expected, ``param`` is its name, and the
    value sent never comes back."""
    settings = router_settings(tmp_path, [("w0", stub_workers[0].url)], tenants=TENANTS)
    admin = {"authorization": "Bearer aa"}
    secret = "s3cret-Value"
    async with running_router(settings) as router, httpx.AsyncClient() as client:
        url = router.url
        for path, params, name, says in (
                ("/admin/sessions", {"limit": "0"}, "limit", "greater than or equal to 1"),
                ("/admin/hints", {"limit": secret}, "limit", "valid integer"),
                ("/admin/hints", {"session_id": f"{secret}\x00"}, "session_id",
                 "control, bidi or other format character ('\\x00' at 12)"),
                ("/admin/sessions", {"source": secret}, "source", "'memory' or 'store'"),
                (f"/admin/workers/{secret}%01", {}, "worker_id",
                 "control, bidi or other format character ('\\x01' at 12)")):
            response = await client.get(f"{url}{path}", params=params, headers=admin)
            error = _error(response, 422)
            assert error["type"] == "invalid_request_error", error
            assert error["param"] == name, error
            place = "path" if name == "worker_id" else "query"
            assert error["message"].startswith(f"{place} parameter {name!r}: "), error
            assert says in error["message"], error
            assert secret not in response.text and "input" not in response.text, response.text
        # Two bad parameters: both named.
        both = _error(await client.get(f"{url}/admin/sessions", headers=admin,
                                       params={"limit": "0", "source": "x"}), 422)
        assert "'limit'" in both["message"] and "'source'" in both["message"], both
        # Authentication still comes first: no key, a 401 (not a 422 naming parameters).
        assert _error(await client.get(f"{url}/admin/sessions", params={"limit": "0"}),
                      401)["type"] == "authentication_error"
