"""What a second fuzzing review of the router's HTTP surface found (a real router, SQLite,
stand-in workers; NATS left out, no route here needs it).

- ``HEAD /v1/responses/{id}`` ran the GET's handler (its worker call, one of the tenant's
  ``api_calls``) and ``HEAD /v1/models`` asked every worker, for a body thrown away,
  where ``HEAD /admin/*`` is a counted 405: now a 405 counted as ``method_not_allowed``
  too; HEAD stays a 200 on ``/health`` and ``/metrics`` (probes).
- ``GET /v1/models`` answered 503 (no routable worker) and 502 (no worker listed its
  models) counted nowhere: now ``route_refusals_total{reason="no_worker"}`` and
  ``{reason="no_worker_answered"}``.
- uvicorn logged "Invalid HTTP request received." once per malformed request, a flood any
  client could cause: now the first, then at most one a minute saying how many it held
  back (server_cli.ClientWarningThrottle); each is still counted.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import httpx
import uvicorn
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from conftest import StubWorker, router_settings, running_router, serving_app
from kvhint.router.devstack.nats_server import free_port
from kvhint.router.server_cli import ClientWarningThrottle, uvicorn_config
from kvhint.router.service.app import create_app

TENANTS = [{"name": "a", "api_keys": ["key-a"], "admin_keys": ["admin-a"],
            "api_calls": {"per_s": 0.01, "burst": 1}}]
KEY_A = {"authorization": "Bearer key-a"}
TOKEN = "scrape-0123456789abcdef"
SCRAPE = {"authorization": f"Bearer {TOKEN}"}
REFUSED = "kvhint_router_route_refusals_total"
INVALID = "Invalid HTTP request received."


async def _counted(client: httpx.AsyncClient, url: str) -> dict[tuple[str, str], float]:
    """(sample name, its reason/op+code labels) -> value, for the counters read here."""
    text = (await client.get(f"{url}/metrics", headers=SCRAPE)).text
    out: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == REFUSED:
                out[(s.name, s.labels["reason"])] = s.value
            elif s.name == "kvhint_router_response_id_requests_total":
                out[(s.name, f"{s.labels['op']}:{s.labels['code']}")] = s.value
    return out


async def test_head_calls_no_worker_and_is_a_counted_405(
        tmp_path: Path, stub_workers: list[StubWorker]) -> None:
    settings = router_settings(tmp_path, [("w0", stub_workers[0].url)], tenants=TENANTS,
                               metrics_token=TOKEN)
    async with running_router(settings) as router, httpx.AsyncClient(timeout=30) as client:
        url = router.url
        before = await _counted(client, url)
        for path in ("/v1/responses/resp_0123456789abcdef", "/v1/models"):
            answer = await client.head(f"{url}{path}", headers=KEY_A)
            assert answer.status_code == 405, (path, answer.status_code)
            assert answer.headers["allow"] == "GET", path
        after = await _counted(client, url)
        assert after[(REFUSED, "method_not_allowed")] == before[(REFUSED, "method_not_allowed")] + 2
        # The GET's handler never ran: no stored-response lookup was counted, and the
        # tenant's one api_call (burst 1) is still there for a real GET.
        assert {k: v for k, v in after.items() if k[0] != REFUSED} == \
            {k: v for k, v in before.items() if k[0] != REFUSED}
        got = await client.get(f"{url}/v1/responses/resp_0123456789abcdef", headers=KEY_A)
        assert got.status_code == 404, got.text  # unknown id: not 429 (no call spent)
        # Probes keep their HEAD.
        assert (await client.head(f"{url}/health")).status_code == 200
        assert (await client.head(f"{url}/metrics", headers=SCRAPE)).status_code == 200


async def _models_with(tmp_path: Path, workers: list[tuple[str, str]]) -> tuple[int, dict]:
    settings = router_settings(tmp_path, workers, tenants=TENANTS, metrics_token=TOKEN)
    async with running_router(settings) as router, httpx.AsyncClient(timeout=30) as client:
        before = await _counted(client, router.url)
        answer = await client.get(f"{router.url}/v1/models", headers=KEY_A)
        after = await _counted(client, router.url)
    changed = {k[1]: after[k] - before[k] for k in after if after[k] != before[k]}
    return answer.status_code, changed


async def test_a_failed_model_listing_is_counted(tmp_path: Path) -> None:
    # No worker at all (workers are learnt from heartbeats, NATS left out): 503.
    status, changed = await _models_with(tmp_path / "none", [])
    assert (status, changed) == (503, {"no_worker": 1})

    async def broken_listing(_request: web.Request) -> web.Response:
        # A worker that answers, but no listing (a proxy's error in front of it).
        return web.Response(status=500, text="upstream error")

    app = web.Application()
    app.router.add_get("/v1/models", broken_listing)
    async with serving_app(app) as worker_url:
        status, changed = await _models_with(tmp_path / "broken", [("w0", worker_url)])
    assert (status, changed) == (502, {"no_worker_answered": 1})


async def test_invalid_requests_are_logged_once_a_minute(
        tmp_path: Path, stub_workers: list[StubWorker]) -> None:
    port = free_port()
    settings = router_settings(tmp_path, [("w0", stub_workers[0].url)], host="127.0.0.1",
                               port=port, log_level="warning", tenants=TENANTS,
                               metrics_token=TOKEN)
    server = uvicorn.Server(uvicorn_config(create_app(settings), settings))  # as deployed
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    uvicorn_log = logging.getLogger("uvicorn.error")  # where uvicorn logs them
    uvicorn_log.addHandler(handler)
    task = asyncio.create_task(server.serve())
    try:
        while not server.started:
            assert not task.done(), "router exited during start-up"
            await asyncio.sleep(0.02)
        url = f"http://127.0.0.1:{port}"
        sent = 6
        for _ in range(sent):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /health HTTP/1.1\r\nContent-Length: -1\r\nHost: x\r\n\r\n")
            assert (await asyncio.wait_for(reader.read(), 5)).startswith(b"HTTP/1.1 400 ")
            writer.close()
        for _ in range(3):  # an Upgrade uvicorn does not do (curl --http2's): served
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: Upgrade, close"
                         b"\r\nUpgrade: h2c\r\n\r\n")
            assert (await asyncio.wait_for(reader.read(), 5)).startswith(b"HTTP/1.1 200 ")
            writer.close()
        async with httpx.AsyncClient(timeout=30) as client:
            counted = await _counted(client, url)
        assert counted[(REFUSED, "malformed_request")] == sent
        logged = [r.getMessage() for r in records if r.getMessage().startswith(INVALID)]
        assert logged == [INVALID + " (at most one such line per 60 s; 0 more since the "
                          "last one; each a 400, counted in kvhint_router_route_refusals"
                          '_total{reason="malformed_request"})'], logged
        upgrades = [r for r in records if r.getMessage().startswith("Unsupported upgrade")]
        assert len(upgrades) == 1, [r.getMessage() for r in records]
    finally:
        uvicorn_log.removeHandler(handler)
        server.should_exit = True
        await task


def test_the_throttle_logs_a_minute_later_with_the_count_held_back() -> None:
    now = [0.0]
    throttle = ClientWarningThrottle(clock=lambda: now[0])

    def passes(message: str) -> str | None:
        record = logging.LogRecord("uvicorn.error", logging.WARNING, __file__, 0, message,
                                   None, None)
        return record.getMessage() if throttle.filter(record) else None

    assert passes(INVALID) is not None
    assert [passes(INVALID) for _ in range(4)] == [None] * 4
    assert passes("another warning") == "another warning"  # left alone, every time
    assert passes("another warning") == "another warning"
    assert passes("Unsupported upgrade request.") is not None  # its own count
    now[0] = 60.0
    again = passes(INVALID)
    assert again is not None and "4 more since the last one" in again, again
