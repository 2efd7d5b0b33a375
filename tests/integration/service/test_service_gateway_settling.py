"""Every way a request through the gateway ends settles what it held exactly once: the
worker's in-flight slot, the load routing counted on it, the session's open turn, and the
request to the worker itself. Here: the handler cancelled (uvicorn's graceful-shutdown
timeout cancels the handlers still running) at each point it can wait. The router runs in
process against stub workers; ``Forwarder.forward`` is called the way the app calls it."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from aiohttp import web

from conftest import RunningRouter, StubWorker, router_settings, running_router
from kvhint.router.service.inbound import Endpoint, parse_inbound
from kvhint.router.service.routing_service import RoutingService

CHAT = {"model": "stub", "messages": [{"role": "user", "content": "hello there"}],
        "max_tokens": 4}


class HoldingWorker(StubWorker):
    """Takes a request and holds it: ``hold`` "headers" sends no status line, "body"
    sends its headers and half a JSON answer; either way it then waits for the router to
    close the connection (counted in ``closed_early``) or ``hold_s`` to pass."""

    hold: str = "headers"
    hold_s: float = 20.0
    closed_early: int = 0

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        self.received.append(await request.json())
        response = None
        if self.hold == "body":
            response = web.StreamResponse(headers={"Content-Type": "application/json"})
            await response.prepare(request)
            await response.write(b'{"id": "x", "choi')
        for _ in range(int(self.hold_s / 0.02)):
            transport = request.transport
            if transport is None or transport.is_closing():
                self.closed_early += 1
                break
            await asyncio.sleep(0.02)
        return response or web.json_response({})


def _inbound(router: RunningRouter, body: dict[str, Any]):  # noqa: ANN202
    tenant = router.runtime.directory.client(None)
    return parse_inbound(Endpoint.CHAT, json.dumps(body).encode(), tenant, None, None)


async def _metric(router: RunningRouter, prefix: str) -> float:
    async with httpx.AsyncClient() as client:
        text = (await client.get(f"{router.url}/metrics")).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(prefix))


def _assert_settled(router: RunningRouter, worker_id: str, session_id: str) -> None:
    runtime = router.runtime
    assert runtime.workers.get(worker_id).inflight == 0
    load = runtime.routing._loads.get(worker_id)
    assert load is None or (load.pending_prefill, load.active_blocks) == (0, 0)
    record = runtime.sessions.get("default", session_id)
    assert record is not None and record.inflight == 0


async def _until(predicate, timeout_s: float = 5.0) -> None:  # noqa: ANN001
    for _ in range(int(timeout_s / 0.02)):
        if predicate():
            return
        await asyncio.sleep(0.02)
    assert predicate()


async def test_a_cancelled_request_settles_its_worker_load_and_session_once(
        tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Cancelled while its worker has not answered (no client watcher: ``await`` on the
    request itself; with one: ``asyncio.wait``), while the non-streamed answer is being
    read, and while a deferred plan's prompt is being hashed: each time the worker's slot,
    its pending prefill and blocks, and the session's turn are given back, the request
    to the worker is closed at once, and the request counts as one 503 (the router
    stopping: test_service_shutdown_requests.py). Before, all of it stayed held for good
    (the router routed around a phantom load), the request kept running on the worker,
    and nothing was counted."""
    stub = HoldingWorker(model_root=str(tiny_model_dir))
    await stub.start()
    try:
        settings = router_settings(tmp_path, [("w0", stub.url)])
        async with running_router(settings) as router:
            forwarder = router.runtime.forwarder
            loop = asyncio.get_running_loop()
            cases = [("headers", None), ("headers", loop.create_future()),
                     ("body", loop.create_future())]
            for number, (hold, client_gone) in enumerate(cases):
                stub.hold = hold
                session = f"s{number}"
                task = asyncio.create_task(forwarder.forward(
                    _inbound(router, {**CHAT, "session_id": session}), client_gone))
                await _until(lambda n=number: len(stub.received) == n + 1)
                await asyncio.sleep(0.1)  # the router is waiting on the worker now
                assert router.runtime.workers.get("w0").inflight == 1
                task.cancel()
                # The router stopping (only uvicorn's grace cancels a handler): a 503.
                assert (await task).status_code == 503
                _assert_settled(router, "w0", session)
                await _until(lambda n=number: stub.closed_early == n + 1, timeout_s=2.0)
            assert await _metric(router, 'kvhint_router_requests_total{code="503"') == 3

            # Cancelled while the only worker's deferred plan is completed (hashing).
            hashing = asyncio.Event()
            real_complete = RoutingService.complete

            async def slow_complete(self, plan, inbound):  # noqa: ANN001, ANN202
                hashing.set()
                await asyncio.sleep(30)
                return await real_complete(self, plan, inbound)

            monkeypatch.setattr(RoutingService, "complete", slow_complete)
            stub.hold = "headers"
            task = asyncio.create_task(forwarder.forward(
                _inbound(router, {**CHAT, "session_id": "s-hash"}), loop.create_future()))
            await hashing.wait()
            await _until(lambda: len(stub.received) == 4)  # sent while it hashes
            task.cancel()
            assert (await task).status_code == 503
            _assert_settled(router, "w0", "s-hash")
            await _until(lambda: stub.closed_early == 4, timeout_s=2.0)
            assert await _metric(router, 'kvhint_router_requests_total{code="503"') == 4
    finally:
        await stub.stop()


async def test_a_streamed_response_cancelled_before_its_first_event_is_settled(
        tmp_path: Path, stub_workers: list[StubWorker]) -> None:
    """The streamed response is returned, then cancelled while its headers go out: its
    relay generator never starts, so closing it runs none of its accounting. The
    response settles the request itself (499, slot, load, session turn); a response that
    ran to its end is not settled a second time."""
    stub = stub_workers[0]
    settings = router_settings(tmp_path, [("w0", stub.url)])
    async with running_router(settings) as router:
        forwarder = router.runtime.forwarder
        response = await forwarder.forward(
            _inbound(router, {**CHAT, "stream": True, "session_id": "s1"}))
        assert router.runtime.workers.get("w0").inflight == 1

        async def receive() -> dict[str, Any]:
            await asyncio.sleep(30)
            return {"type": "http.disconnect"}

        async def cancelled_send(message: dict[str, Any]) -> None:
            raise asyncio.CancelledError

        with pytest.raises(asyncio.CancelledError):
            await response({"type": "http"}, receive, cancelled_send)
        _assert_settled(router, "w0", "s1")
        assert await _metric(router, 'kvhint_router_requests_total{code="499"') == 1

        sent: list[dict[str, Any]] = []

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        response = await forwarder.forward(
            _inbound(router, {**CHAT, "stream": True, "session_id": "s2"}))
        await response({"type": "http"}, receive, send)
        assert sent[-1] == {"type": "http.response.body", "body": b"", "more_body": False}
        _assert_settled(router, "w0", "s2")
        assert await _metric(router, 'kvhint_router_requests_total{code="200"') == 1
        assert await _metric(router, 'kvhint_router_requests_total{code="499"') == 1
