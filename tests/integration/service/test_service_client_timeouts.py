"""Slow clients at the router's HTTP edge (security review: denial of service). The
router's server as ``kvhint router`` runs it (``server_cli.uvicorn_config``), on a real
port, spoken to over raw sockets: a client that sends part of its headers (slowloris) is
closed within ``http_header_timeout_s``; one that sends part of its body gets a 408
within ``http_body_timeout_s`` and its connection closes; so does one that goes on
trickling a body the router answered without reading. Normal keep-alive and large bodies
are untouched."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import uvicorn

from kvhint.router.devstack.ports import reserved_socket
from kvhint.router.server_cli import uvicorn_config
from kvhint.router.service.app import RouterApp, create_app
from kvhint.router.service.hash_queue import FairHashQueue

from conftest import StubWorker, router_settings, sample, scrape

HEADER_TIMEOUT_S = 0.6
BODY_TIMEOUT_S = 0.8
# Far past either timeout, far short of uvicorn's keep-alive (60 s): a server without the
# deadlines is still holding the connection when this runs out.
PATIENCE_S = 6.0


@asynccontextmanager
async def _served(tmp_path: Path, worker: StubWorker, **extra: Any
                  ) -> AsyncIterator[tuple[str, RouterApp]]:
    listener = reserved_socket()  # bound now: a port found free may be taken before a bind
    port = listener.getsockname()[1]
    settings = router_settings(tmp_path, [("w0", worker.url)], host="127.0.0.1", port=port,
                               log_level="warning", http_header_timeout_s=HEADER_TIMEOUT_S,
                               http_body_timeout_s=BODY_TIMEOUT_S, **extra)
    app = create_app(settings)
    server = uvicorn.Server(uvicorn_config(app, settings))
    task = asyncio.create_task(server.serve(sockets=[listener]))
    while not server.started:
        assert not task.done(), "router exited during start-up"
        await asyncio.sleep(0.02)
    try:
        yield f"127.0.0.1:{port}", app
    finally:
        server.should_exit = True
        await task


async def _until_closed(reader: asyncio.StreamReader) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection, and how long that
    took; fails the test if it is still open after PATIENCE_S."""
    started = time.monotonic()
    try:
        data = await asyncio.wait_for(reader.read(), PATIENCE_S)
    except TimeoutError:
        raise AssertionError(f"the server still holds the connection after {PATIENCE_S} s"
                             ) from None
    return data, time.monotonic() - started


async def _response(reader: asyncio.StreamReader) -> bytes:
    """One whole response with a Content-Length (the server keeps the connection)."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    return head + await asyncio.wait_for(reader.readexactly(length), 5)


async def test_a_client_that_never_finishes_its_headers_is_closed(
        tmp_path: Path, stub_workers: list[StubWorker]) -> None:
    async with _served(tmp_path, stub_workers[0]) as (address, _app):
        host, port = address.split(":")
        # Part of the headers, then nothing (slowloris).
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        await writer.drain()
        data, took = await _until_closed(reader)
        writer.close()
        assert data == b"" and took < HEADER_TIMEOUT_S + 2.0, (data, took)

        # A keep-alive connection: a first request answered, then part of the next one's
        # headers. Idle longer than the header timeout between them is fine (keep-alive).
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await _response(reader)).startswith(b"HTTP/1.1 200")
        await asyncio.sleep(HEADER_TIMEOUT_S * 2)
        writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await _response(reader)).startswith(b"HTTP/1.1 200")
        writer.write(b"GET /health HTTP/1.1\r\nHo")
        await writer.drain()
        data, took = await _until_closed(reader)
        writer.close()
        assert data == b"" and took < HEADER_TIMEOUT_S + 2.0, (data, took)

        async with httpx.AsyncClient() as client:
            samples = await scrape(client, f"http://{address}")
        assert sample(samples, "kvhint_router_client_timeouts_total", phase="headers") == 2
        assert sample(samples, "kvhint_router_client_timeouts_total", phase="body") == 0


async def test_a_client_that_never_finishes_its_body_gets_408_and_is_closed(
        tmp_path: Path, stub_workers: list[StubWorker]) -> None:
    async with _served(tmp_path, stub_workers[0]) as (address, _app):
        host, port = address.split(":")
        # The gateway, and the hints API (dev mode: open), both read a body.
        for path in (b"/v1/chat/completions", b"/v1/sessions/s/hints"):
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(b"POST " + path + b" HTTP/1.1\r\nHost: x\r\n"
                         b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
                         b'{"messages": [')
            await writer.drain()
            data, took = await _until_closed(reader)
            writer.close()
            assert data.startswith(b"HTTP/1.1 408"), data
            assert b"request body not received within" in data, data
            assert took < BODY_TIMEOUT_S + 2.0, took

        async with httpx.AsyncClient() as client:
            samples = await scrape(client, f"http://{address}")
        assert sample(samples, "kvhint_router_client_timeouts_total", phase="body") == 2
        assert sample(samples, "kvhint_router_hint_api_rejections_total",
                      reason="body_timeout") == 1
        assert sample(samples, "kvhint_router_requests_total", endpoint="chat", worker="none",
                      code="408") == 1


async def test_a_body_trickled_after_the_answer_is_cut_off(
        tmp_path: Path, stub_workers: list[StubWorker]) -> None:
    """Refused before its body is read (no API key: 401), a client that goes on sending
    the body a byte at a time, too slowly to finish (uvicorn reads and discards it, and
    each byte restarted its keep-alive clock), is closed after the body timeout."""
    async with _served(tmp_path, stub_workers[0],
                       tenants=[{"name": "a", "api_keys": ["ka"]}]) as (address, _app):
        host, port = address.split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Length: 100000\r\n\r\n{")
        assert (await _response(reader)).startswith(b"HTTP/1.1 401")
        started = time.monotonic()
        closed = False
        while time.monotonic() - started < PATIENCE_S:
            try:
                writer.write(b" ")
                await writer.drain()
                closed = await asyncio.wait_for(reader.read(1), 0.1) == b""
            except TimeoutError:
                continue
            except ConnectionError:
                closed = True
            if closed:
                break
        writer.close()
        assert closed, f"the server still takes the body after {PATIENCE_S} s"
        assert time.monotonic() - started < BODY_TIMEOUT_S + 2.0


async def test_keep_alive_and_a_large_body_still_work(
        tmp_path: Path, stub_workers: list[StubWorker]) -> None:
    # Prompts over 4,096 tokens are not hashed: the big one is forwarded unhashed.
    async with _served(tmp_path, stub_workers[0], routing={"max_prompt_tokens": 4096}
                       ) as (address, app), httpx.AsyncClient(timeout=30) as client:
        # The runtime hashes on the tenant-fair queue (test_service_hash_fairness.py).
        assert isinstance(app.state.runtime.routing.hash_executor, FairHashQueue)
        url = f"http://{address}/v1/chat/completions"
        # ~1 MB (the stub worker, aiohttp, takes no more): arrives well within the body
        # timeout on loopback.
        big = {"model": "stub", "messages": [{"role": "user", "content": "word " * 200_000}]}
        for body in (big, {"model": "stub", "messages": [{"role": "user", "content": "hi"}]}):
            answer = await client.post(url, json=body)
            assert answer.status_code == 200, answer.text
            await asyncio.sleep(HEADER_TIMEOUT_S * 1.5)  # idle, kept alive
        assert len(stub_workers[0].received) == 2
        samples = await scrape(client, f"http://{address}")
        assert sample(samples, "kvhint_router_client_timeouts_total", phase="headers") == 0
        assert sample(samples, "kvhint_router_client_timeouts_total", phase="body") == 0
