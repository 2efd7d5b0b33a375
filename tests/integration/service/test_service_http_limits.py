"""The router's HTTP server as `kvhint router` (and so `kvhint up`) runs it bounds a
request's headers (security review: httptools buffered a 200 MB header): over
``max_header_bytes`` the request is refused or its connection closed, and the router
goes on answering."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from kvhint.router.devstack.ports import reserved_socket
from kvhint.router.server_cli import uvicorn_config
from kvhint.router.service.app import create_app

from conftest import StubWorker, router_settings, running_router


async def test_a_request_whose_headers_are_over_the_limit_is_refused(
        tmp_path: Path, stub_workers: list[StubWorker]) -> None:
    listener = reserved_socket()  # bound now: a port found free may be taken before a bind
    port = listener.getsockname()[1]
    settings = router_settings(tmp_path, [("w0", stub_workers[0].url)], host="127.0.0.1",
                               port=port, max_header_bytes=16 * 1024, log_level="warning")
    config = uvicorn_config(create_app(settings), settings)
    # h11 (with the slow-client deadlines: test_service_client_timeouts.py).
    assert isinstance(config.http, type) and issubclass(config.http, H11Protocol)
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve(sockets=[listener]))
    while not server.started:
        assert not task.done(), "router exited during start-up"
        await asyncio.sleep(0.02)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (1 << 20))
        answer = b""
        try:
            await writer.drain()
            answer = await asyncio.wait_for(reader.read(200), 10)
        except ConnectionError:
            pass  # closed while the client was still sending: refused too
        writer.close()
        assert answer == b"" or answer.split(b" ")[1].startswith(b"4"), answer
        async with httpx.AsyncClient() as client:
            assert (await client.get(f"http://127.0.0.1:{port}/health")).status_code == 200
    finally:
        server.should_exit = True
        await task


async def test_no_api_docs_by_default_and_the_dashboard_is_locked_down(
        tmp_path: Path, stub_workers: list[StubWorker]) -> None:
    """/docs loaded swagger-ui from a CDN on the origin where the dashboard keeps its
    admin key; the dashboard runs only its own inline script, unframed, sending no
    Referer (its URL may carry ?key=)."""
    import base64
    import hashlib
    import re

    settings = router_settings(tmp_path, [("w0", stub_workers[0].url)])
    async with running_router(settings) as router, httpx.AsyncClient() as client:
        for path in ("/docs", "/redoc", "/openapi.json"):
            assert (await client.get(f"{router.url}{path}")).status_code == 404, path
        page = await client.get(f"{router.url}/dashboard")
    assert page.status_code == 200
    assert page.headers["referrer-policy"] == "no-referrer"
    assert page.headers["x-frame-options"] == "DENY"
    policy = page.headers["content-security-policy"]
    assert policy.startswith("default-src 'self';") and "unsafe-eval" not in policy
    script = re.search(r"<script>(.*?)</script>", page.text, re.DOTALL)
    assert script is not None
    digest = base64.b64encode(hashlib.sha256(script.group(1).encode()).digest()).decode()
    assert f"script-src 'sha256-{digest}';" in policy
