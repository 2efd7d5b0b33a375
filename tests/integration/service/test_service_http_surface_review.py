"""The router's HTTP surface as a client with one tenant's key probes it (security
review): request framing a proxy in front could read another way, a worker's headers
that would speak for the router's origin, and worker addresses in a client's error."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
import httpx
import uvicorn
from aiohttp import web

from kvhint.router.devstack.nats_server import free_port
from kvhint.router.devstack.ports import reserved_socket
from kvhint.router.server_cli import uvicorn_config
from kvhint.router.service.app import create_app

from conftest import (StubWorker, router_settings, running_router, sample, scrape, serving,
                      usage)

CHAT = {"model": "stub", "messages": [{"role": "user", "content": "hi"}]}
TENANTS = [{"name": "a", "api_keys": ["key-a"]}]
KEY_A = {"authorization": "Bearer key-a"}


class HeaderWorker(StubWorker):
    """A stub worker whose answers, whole or streamed, carry ``answer_headers``: headers
    vLLM never sends, which a worker behind its own proxy, or one a forged heartbeat
    points at, could."""

    answer_headers: dict[str, str]

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        message = {"role": "assistant", "content": "hello"}
        if not body.get("stream"):
            return web.json_response({
                "id": "x", "object": "chat.completion", "model": "stub",
                "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
                "usage": usage(40, 32, 2)}, headers=self.answer_headers)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                               **self.answer_headers})
        await response.prepare(request)
        for event in ({"choices": [{"index": 0, "delta": message, "finish_reason": "stop"}]},
                      {"choices": [], "usage": usage(40, 32, 2)}):
            await response.write(b"data: " + json.dumps(event).encode() + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


async def _exchange(port: int, raw: bytes) -> tuple[bytes, bool]:
    """What the router answers ``raw`` on a new connection, and whether it closed it
    (else still open after 2 s)."""
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


async def test_content_length_with_transfer_encoding_is_refused_and_the_connection_closed(
        tmp_path: Path, stub_workers: list[StubWorker]) -> None:
    """h11 read such a body as chunked and kept the connection: behind a proxy going by
    Content-Length, the bytes after it (the next client's request on the proxy's
    connection) were read as this body's rest or as a request of the router's own."""
    worker = stub_workers[0]
    listener = reserved_socket()  # bound now: a port found free may be taken before a bind
    port = listener.getsockname()[1]
    settings = router_settings(tmp_path, [("w0", worker.url)], host="127.0.0.1", port=port,
                               log_level="warning", tenants=TENANTS)
    server = uvicorn.Server(uvicorn_config(create_app(settings), settings))  # as deployed
    task = asyncio.create_task(server.serve(sockets=[listener]))
    while not server.started:
        assert not task.done(), "router exited during start-up"
        await asyncio.sleep(0.02)
    try:
        body = json.dumps(CHAT).encode()
        head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                b"key-a\r\nContent-Type: application/json\r\n")
        chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
        answer, closed = await _exchange(port, head + b"Content-Length: %d\r\n"
                                         b"Transfer-Encoding: chunked\r\n\r\n%s"
                                         % (len(body), chunked))
        assert answer.startswith(b"HTTP/1.1 400 "), answer
        assert b"not both" in answer and closed
        assert worker.received == []
        # Either alone is served as before, on a connection kept open.
        for framing, payload in ((b"Content-Length: %d\r\n\r\n" % len(body), body),
                                 (b"Transfer-Encoding: chunked\r\n\r\n", chunked)):
            answer, closed = await _exchange(port, head + framing + payload)
            assert answer.startswith(b"HTTP/1.1 200 "), answer
            assert not closed
        assert len(worker.received) == 2
        async with httpx.AsyncClient() as client:
            samples = await scrape(client, f"http://127.0.0.1:{port}")
        assert sample(samples, "kvhint_router_route_refusals_total",
                      reason="ambiguous_length") == 1
    finally:
        server.should_exit = True
        await task


async def test_a_workers_origin_wide_and_hop_by_hop_headers_are_not_relayed(
        tmp_path: Path, tiny_model_dir: Path) -> None:
    """A worker's cookie, CORS grant (the router grants none but its own), HSTS,
    Alt-Svc, challenge, redirect and the headers its Connection names stayed on the
    answer the router served from its origin (the dashboard's, which keeps an admin
    key), and its own X-Kvhint-Worker went out beside the router's; the worker's other
    headers still come through."""
    worker = HeaderWorker(model_root=str(tiny_model_dir))
    worker.answer_headers = {
        "Set-Cookie": "session=worker; Path=/", "Access-Control-Allow-Origin": "*",
        "Access-Control-Allow-Credentials": "true", "Access-Control-Expose-Headers": "*",
        "Strict-Transport-Security": "max-age=0", "Alt-Svc": 'h3=":443"; ma=86400',
        "Clear-Site-Data": '"*"', "Content-Security-Policy": "default-src *",
        "WWW-Authenticate": "Basic realm=router", "Location": "http://elsewhere.example/",
        "Refresh": "0; url=http://elsewhere.example/", "Connection": "keep-alive, X-Hop",
        "X-Hop": "for the router's connection", "X-Request-Id": "worker-id",
        "X-Kvhint-Worker": "elsewhere"}
    async with serving([worker]):
        settings = router_settings(tmp_path, [("w0", worker.url)], tenants=TENANTS)
        async with running_router(settings) as router, httpx.AsyncClient() as client:
            for stream in (False, True):
                response = await client.post(f"{router.url}/v1/chat/completions",
                                             headers=KEY_A, json={**CHAT, "stream": stream})
                assert response.status_code == 200, response.text
                names = set(response.headers.keys())
                for dropped in ("set-cookie", "strict-transport-security", "alt-svc",
                                "clear-site-data", "content-security-policy",
                                "www-authenticate", "location", "refresh", "x-hop"):
                    assert dropped not in names, (stream, dropped, response.headers)
                assert not any(n.startswith("access-control-") for n in names), names
                assert response.headers["x-request-id"] == "worker-id"
                assert response.headers.get_list("x-kvhint-worker") == ["w0"]
                assert response.headers["x-content-type-options"] == "nosniff"


async def test_a_workers_address_is_not_in_a_clients_error(tmp_path: Path) -> None:
    """A worker that takes no connection: the client's 502 said aiohttp's "Cannot connect
    to host 127.0.0.1:<port>", a worker's address (the log and a fleet admin's
    last_http_error keep it: a tenant admin's worker view shows neither)."""
    port = free_port()  # nothing listens there
    settings = router_settings(tmp_path, [("w0", f"http://127.0.0.1:{port}")],
                               tenants=TENANTS, admin_keys=["root"])
    async with running_router(settings) as router, httpx.AsyncClient() as client:
        router.runtime.workers.get("w0").http_up = True  # not yet probed down
        response = await client.post(f"{router.url}/v1/chat/completions", headers=KEY_A,
                                     json=CHAT)
        assert response.status_code == 502, response.text
        message = response.json()["error"]["message"]
        assert message.startswith("worker unavailable: ClientConnectorError"), message
        assert str(port) not in message and "127.0.0.1" not in message, message
        fleet = (await client.get(f"{router.url}/admin/workers/w0",
                                  headers={"authorization": "Bearer root"})).json()
        assert str(port) in fleet["last_http_error"]


async def test_a_session_id_the_admin_api_cannot_name_is_refused_at_the_gateway(
        tmp_path: Path, stub_workers: list[StubWorker]) -> None:
    """DEL passed the gateway's check (control characters below 32 only) but not the
    admin API's path check (422): a session made with it could be listed, never read or
    ended there. Refused where it would be made, as the other control characters are."""
    settings = router_settings(tmp_path, [("w0", stub_workers[0].url)], tenants=TENANTS,
                               admin_keys=["root"])
    async with running_router(settings) as router, httpx.AsyncClient() as client:
        # (In an X-Session-ID header, DEL is refused by the HTTP server itself.)
        for field in ("session_id", "prompt_cache_key"):
            response = await client.post(f"{router.url}/v1/chat/completions",
                                         headers=KEY_A, json={**CHAT, field: "s\x7f1"})
            assert response.status_code == 400, (field, response.text)
            assert "control characters" in response.json()["error"]["message"]
        assert stub_workers[0].received == []
        ended = await client.delete(f"{router.url}/v1/sessions/s%7F1", headers=KEY_A)
        assert ended.status_code == 400, ended.text
        # Admin's own refusal of the same id (what the gateway now agrees with).
        shown = await client.get(f"{router.url}/admin/sessions/a/s%7F1",
                                 headers={"authorization": "Bearer root"})
        assert shown.status_code == 422, shown.text
