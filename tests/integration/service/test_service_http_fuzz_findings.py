"""What a fuzzing review of the router's HTTP surface found (a real router, SQLite, a
stand-in worker; NATS left out, no route here needs it): refusals counted nowhere.

- ``GET /v1/models`` without a client key the router knows, and ``GET /metrics``
  without its ``metrics_token`` (a scraper with a wrong token, anyone probing): 401s,
  now ``route_refusals_total{reason="unauthorized"}``.
- A request the HTTP server cannot parse (a bad Content-Length, an unknown
  Transfer-Encoding, HTTP/1.1 without Host, a NUL in the target): uvicorn's plain 400
  and a close before any route, now ``route_refusals_total{reason="malformed_request"}``.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from conftest import StubWorker, router_settings, running_router
from kvhint.router.devstack.nats_server import free_port
from kvhint.router.server_cli import uvicorn_config
from kvhint.router.service.app import create_app

TENANTS = [{"name": "a", "api_keys": ["key-a"], "admin_keys": ["admin-a"]}]
TOKEN = "scrape-0123456789abcdef"
REFUSED = "kvhint_router_route_refusals_total"


async def _refusals(client: httpx.AsyncClient, url: str) -> dict[str, float]:
    text = (await client.get(f"{url}/metrics",
                             headers={"authorization": f"Bearer {TOKEN}"})).text
    return {s.labels["reason"]: s.value for family in text_string_to_metric_families(text)
            for s in family.samples if s.name == REFUSED}


async def test_a_refused_key_on_models_or_metrics_is_counted(
        tmp_path: Path, stub_workers: list[StubWorker]) -> None:
    settings = router_settings(tmp_path, [("w0", stub_workers[0].url)], tenants=TENANTS,
                               admin_keys=["root"], metrics_token=TOKEN)
    async with running_router(settings) as router, httpx.AsyncClient(timeout=30) as client:
        url = router.url
        assert (await _refusals(client, url))["unauthorized"] == 0
        no_key = ({}, {"authorization": "Bearer nope"}, {"authorization": "Basic abc"},
                  {"x-api-key": "nope"})
        for headers in no_key:
            answer = await client.get(f"{url}/v1/models", headers=headers)
            assert answer.status_code == 401, (headers, answer.text)
            assert answer.json()["error"]["message"]
        # A client key, an admin key and a global admin key: /metrics takes its token only.
        not_the_token = ({}, {"authorization": "Bearer key-a"},
                         {"authorization": "Bearer admin-a"}, {"authorization": "Bearer root"},
                         {"authorization": f"Bearer {TOKEN}x"})
        for headers in not_the_token:
            answer = await client.get(f"{url}/metrics", headers=headers)
            assert answer.status_code == 401, (headers, answer.text)
        counted = await _refusals(client, url)
        assert counted["unauthorized"] == len(no_key) + len(not_the_token), counted
        # Served as before: a known key lists the models, refusing nothing more.
        listed = await client.get(f"{url}/v1/models", headers={"authorization": "Bearer key-a"})
        assert listed.status_code == 200 and listed.json()["data"][0]["id"] == "stub"
        assert (await _refusals(client, url)) == counted


async def _exchange(port: int, raw: bytes) -> tuple[bytes, bool]:
    """``raw`` sent on a connection of its own: what came back, and whether the router
    closed the connection (else still open after 2 s)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(raw)
    await writer.drain()
    data, closed = b"", False
    try:
        while chunk := await asyncio.wait_for(reader.read(65536), 2):
            data += chunk
        closed = True
    except asyncio.TimeoutError:
        pass
    writer.close()
    return data, closed


async def test_a_request_the_http_server_cannot_parse_is_counted(
        tmp_path: Path, stub_workers: list[StubWorker]) -> None:
    port = free_port()
    settings = router_settings(tmp_path, [("w0", stub_workers[0].url)], host="127.0.0.1",
                               port=port, log_level="warning", tenants=TENANTS,
                               metrics_token=TOKEN)
    server = uvicorn.Server(uvicorn_config(create_app(settings), settings))  # as deployed
    task = asyncio.create_task(server.serve())
    while not server.started:
        assert not task.done(), "router exited during start-up"
        await asyncio.sleep(0.02)
    url = f"http://127.0.0.1:{port}"
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer key-a"
            b"\r\nContent-Type: application/json\r\n")
    malformed = [head + b"Content-Length: -1\r\n\r\n",
                 head + b"Content-Length: 2\r\nContent-Length: 3\r\n\r\n{} ",
                 head + b"Transfer-Encoding: identity\r\n\r\n{}",
                 b"GET /health HTTP/1.1\r\n\r\n",  # no Host
                 b"GET /admin/sessions/a/s\x00 HTTP/1.1\r\nHost: x\r\n\r\n"]
    try:
        async with httpx.AsyncClient(timeout=30) as client:
            assert (await _refusals(client, url))["malformed_request"] == 0
            for raw in malformed:
                answer, closed = await _exchange(port, raw)
                assert answer.startswith(b"HTTP/1.1 400 "), (raw, answer)
                assert closed, raw
            assert (await _refusals(client, url))["malformed_request"] == len(malformed)
            assert (await client.get(f"{url}/health")).status_code == 200
            served = await client.post(f"{url}/v1/chat/completions",
                                       headers={"authorization": "Bearer key-a"},
                                       json={"model": "stub",
                                             "messages": [{"role": "user", "content": "hi"}]})
            assert served.status_code == 200, served.text
            assert (await _refusals(client, url))["malformed_request"] == len(malformed)
    finally:
        server.should_exit = True
        await task
