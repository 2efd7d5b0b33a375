"""A worker that moves (its heartbeat names a new http_url) while requests or probes are
still on their way to its old address: what comes back from there is recorded on the
address it concerns, never on the worker's new one. Real HTTP servers on localhost."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import msgspec
import pytest
from aiohttp import web

from conftest import StubWorker, router_settings, running_router
from feed_helpers import status as _status_wire
from kvhint.router.devstack.nats_server import free_port
from kvhint.router.service import health
from kvhint.router.service.health import HealthProber
from kvhint.router.service.metrics import RouterMetrics
from kvhint.router.service.upstream import UpstreamPool
from kvhint.router.service.workers import WorkerRegistry
from kvhint.schemas import decode_status

CHAT = {"model": "stub", "messages": [{"role": "user", "content": "hello there"}],
        "max_tokens": 4}


def _heard_at(registry: WorkerRegistry, url: str, seq: int) -> None:
    """Worker ``w``'s plugin heartbeats, naming ``url`` as its address."""
    registry.on_heartbeat(msgspec.structs.replace(
        decode_status(_status_wire("w", "e1", seq)), http_url=url))


async def _until(predicate: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting"
        await asyncio.sleep(0.01)


async def _metric(client: httpx.AsyncClient, url: str, prefix: str) -> float:
    text = (await client.get(f"{url}/metrics")).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(prefix))


def _drops(what: str) -> str:
    return f'kvhint_router_drops_total{{what="{what}"}}'


class HeldWorker(StubWorker):
    """A stub that holds each inference request (``held`` counts them) until ``release``
    is set, then drops its connection unanswered."""

    held: int = 0
    release: asyncio.Event | None = None

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        assert self.release is not None
        self.held += 1
        await self.release.wait()
        if request.transport is not None:  # (None: the router gave up on it already)
            request.transport.abort()
        raise web.HTTPServiceUnavailable()  # never sent: the connection is gone


class CountingWorker(StubWorker):
    """A stub that counts the /health probes it answers; ``health_gate``, when set, holds
    each probe until it is set (``health_asked`` says one arrived)."""

    health_calls: int = 0
    health_asked: asyncio.Event | None = None
    health_gate: asyncio.Event | None = None

    async def _health(self, request: web.Request) -> web.Response:
        self.health_calls += 1
        if self.health_asked is not None:
            self.health_asked.set()
        if self.health_gate is not None:
            await self.health_gate.wait()
        return await super()._health(request)


async def test_a_failure_at_the_address_a_worker_left_does_not_mark_its_new_one_down(
        tmp_path: Path) -> None:
    """A request is on its way to w's old address when w's heartbeat names a new one;
    then the old address drops the connection unanswered. Before, the forwarder marked
    down whatever the registry held under "w" by then, the new address, which took no
    traffic until the next probe, and the retry left "w" out, so the request failed with
    a 502 though w was up. Now the failure is recorded on the old address's state, the
    new one stays up (the skip is counted) and the retry goes there."""
    old, new = HeldWorker(), StubWorker()
    old.release = asyncio.Event()
    await old.start()
    await new.start()
    try:
        settings = router_settings(tmp_path, [], health_probe_s=30.0)
        async with running_router(settings) as router, httpx.AsyncClient(timeout=10) as client:
            workers = router.runtime.workers
            _heard_at(workers, old.url, 0)
            left = workers.get("w")
            sent = asyncio.create_task(client.post(f"{router.url}/v1/chat/completions",
                                                   json=CHAT))
            await _until(lambda: old.held == 1)
            _heard_at(workers, new.url, 1)
            old.release.set()
            response = await sent
            moved = workers.get("w")
            assert moved is not left and moved.url == new.url
            assert moved.http_up and moved.http_failures == 0, moved.last_http_error
            assert not left.http_up and left.http_failures == 1
            assert response.status_code == 200, response.text
            assert response.headers["x-kvhint-worker"] == "w" and len(new.received) == 1
            assert await _metric(client, router.url,
                                 _drops("worker_left_address:failure")) == 1
    finally:
        await old.stop()
        await new.stop()


async def test_timeouts_at_the_address_a_worker_left_do_not_make_its_new_one_a_suspect(
        tmp_path: Path) -> None:
    """Two requests held at w's old address past request_timeout_s, w having moved
    meanwhile: before, both timeouts counted against the new address (silent_timeouts
    2), which the prober then checked as a hung worker. Now they count on the old
    address's state and the new one is left alone."""
    old, new = HeldWorker(), CountingWorker()
    old.release = asyncio.Event()
    await old.start()
    await new.start()
    try:
        settings = router_settings(tmp_path, [], request_timeout_s=0.5, health_probe_s=30.0)
        async with running_router(settings) as router, httpx.AsyncClient(timeout=10) as client:
            workers = router.runtime.workers
            _heard_at(workers, old.url, 0)
            left = workers.get("w")
            sent = [asyncio.create_task(client.post(f"{router.url}/v1/chat/completions",
                                                    json=CHAT)) for _ in range(2)]
            await _until(lambda: old.held == 2)
            _heard_at(workers, new.url, 1)
            codes = [(await task).status_code for task in sent]
            assert codes == [504, 504]
            await asyncio.sleep(0.2)  # a suspect probe, were one started, has run
            moved = workers.get("w")
            assert moved.url == new.url and moved.http_up
            assert moved.silent_timeouts == 0 and new.health_calls == 0
            assert left.silent_timeouts == 2
            assert await _metric(client, router.url,
                                 _drops("worker_left_address:timeout")) == 2
            # Its new address answers: routed to, nothing left over.
            response = await client.post(f"{router.url}/v1/chat/completions", json=CHAT)
            assert response.status_code == 200 and len(new.received) == 1
    finally:
        old.release.set()
        await old.stop()
        await new.stop()


async def test_a_suspect_probe_of_the_address_a_worker_left_does_not_mark_its_new_one_down(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The prober checks a suspect's /health (requests held without headers) at its
    address; the worker moves while the probe waits on a hung server there. Before, the
    failed probe marked the new address down."""
    monkeypatch.setattr(health, "PROBE_TIMEOUT_S", 0.3)
    accepted: list[asyncio.StreamWriter] = []

    async def hold(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(writer)  # read nothing, answer nothing

    hung = await asyncio.start_server(hold, "127.0.0.1", 0)
    new = StubWorker()
    await new.start()
    pool = UpstreamPool(1.0, 5.0, keepalive_s=1.0)
    await pool.start()
    registry = WorkerRegistry([])
    prober = HealthProber(registry, pool, period_s=30.0, metrics=RouterMetrics())
    try:
        _heard_at(registry, f"http://127.0.0.1:{hung.sockets[0].getsockname()[1]}", 0)
        left = registry.get("w")
        prober.probe_later(left)
        await _until(lambda: bool(accepted))
        _heard_at(registry, new.url, 1)
        moved = registry.get("w")
        await _until(lambda: not left.http_up or not moved.http_up)  # the probe timed out
        assert moved.url == new.url and moved.http_up, moved.last_http_error
        assert not left.http_up and "/health" in left.last_http_error
    finally:
        await prober.close()
        await pool.close()
        for writer in accepted:
            writer.close()
        hung.close()
        await new.stop()


async def test_the_address_a_worker_left_answering_its_probe_does_not_bring_its_new_one_up(
        ) -> None:
    """A worker down at its old address is probed there; it moves while the probe is on
    its way, and its new address is down too (nothing listens there). Before, the old
    address's late answer marked the new one up: requests went to it and failed. Now it
    stays down and the prober goes on with the new address."""
    old = CountingWorker()
    old.health_asked, old.health_gate = asyncio.Event(), asyncio.Event()
    await old.start()
    pool = UpstreamPool(1.0, 5.0, keepalive_s=1.0)
    await pool.start()
    registry = WorkerRegistry([])
    prober = HealthProber(registry, pool, period_s=0.05, metrics=RouterMetrics())
    try:
        _heard_at(registry, old.url, 0)
        left = registry.get("w")
        left.mark_http_failure("refused")
        prober.probe_later(left)
        await asyncio.wait_for(old.health_asked.wait(), 5.0)
        _heard_at(registry, f"http://127.0.0.1:{free_port()}", 1)
        moved = registry.get("w")
        moved.mark_http_failure("refused")
        old.health_gate.set()
        await _until(lambda: left.http_up or moved.http_up)  # the old address answered
        await asyncio.sleep(0.2)  # the prober went on with the new address
        assert registry.get("w") is moved and not moved.http_up
        assert left.http_up  # what the old address's answer says, on its own state
    finally:
        await prober.close()
        await pool.close()
        await old.stop()
