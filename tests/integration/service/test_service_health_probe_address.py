"""A /health probe that fails at the address takes every worker there down: the
data-parallel ranks of one vLLM server (``<id>-dp<rank>``) share its URL and its one API
server. Each is then probed back on its own. A status other than 200 is the probed
rank's alone. Real HTTP servers on localhost (aiohttp), one that hangs on cue."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest
from aiohttp import web

from conftest import StubWorker
from kvhint.router.devstack.ports import reserved_socket
from kvhint.router.service import health
from kvhint.router.service.health import HealthProber
from kvhint.router.service.metrics import RouterMetrics
from kvhint.router.service.upstream import UpstreamPool
from kvhint.router.service.workers import WorkerRegistry

RANKS = ("gpu-0-dp0", "gpu-0-dp1", "gpu-0-dp2")


async def _until(predicate: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting"
        await asyncio.sleep(0.01)


class HealthServer:
    """Answers /health with ``status``, or holds it unanswered while ``hung`` (a server
    that accepts connections and never answers)."""

    def __init__(self) -> None:
        self.port = 0  # the kernel's pick, bound at once: known once started
        self.status = 200
        self.hung = asyncio.Event()
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _health(self, _request: web.Request) -> web.Response:
        while self.hung.is_set():
            await asyncio.sleep(0.01)
        return web.Response(status=self.status, text="x")

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/health", self._health)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()
        self.port = self._runner.addresses[0][1]

    async def stop(self) -> None:
        self.hung.clear()
        if self._runner is not None:
            await self._runner.cleanup()


def _answered(metrics: RouterMetrics) -> dict[str, float]:
    return {s.labels["worker"]: s.value for family in metrics.health_probes.collect()
            for s in family.samples
            if s.name.endswith("_total") and s.labels["outcome"] == "answered"}


@pytest.fixture
def short_probe_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(health, "PROBE_TIMEOUT_S", 0.2)


@pytest.mark.usefixtures("short_probe_timeout")
async def test_a_hung_servers_failed_probe_takes_every_rank_there_down() -> None:
    """Three ranks of one server that hangs; a fourth worker elsewhere. The suspect rank's
    probe times out. Before, only it was marked down, and the other two ranks of the
    same hung server were still routed to. Now all three are down (the worker elsewhere
    is not) and, the server answering again, each comes back by its own probe."""
    server, other = HealthServer(), HealthServer()
    await server.start()
    await other.start()
    metrics = RouterMetrics()
    pool = UpstreamPool(1.0, 5.0, keepalive_s=1.0)
    await pool.start()
    registry = WorkerRegistry([*((rank, server.url) for rank in RANKS), ("w1", other.url)])
    prober = HealthProber(registry, pool, period_s=0.05, metrics=metrics)
    try:
        server.hung.set()
        prober.probe_later(registry.get("gpu-0-dp1"))  # the forwarder's suspect: still up
        await _until(lambda: not any(registry.get(r).http_up for r in RANKS))
        assert registry.get("w1").http_up
        assert "no answer to /health within 0.2 s" in registry.get("gpu-0-dp1").last_http_error
        for rank in ("gpu-0-dp0", "gpu-0-dp2"):
            assert "(at worker gpu-0-dp1)" in registry.get(rank).last_http_error
        server.hung.clear()
        await _until(lambda: all(registry.get(r).http_up for r in RANKS))
        assert set(_answered(metrics)) == set(RANKS)  # each by its own probe
    finally:
        await prober.close()
        await pool.close()
        await server.stop()
        await other.stop()


async def test_an_address_that_refuses_a_down_ranks_probe_takes_the_others_down() -> None:
    """A rank marked down on its own (a 503 to a request) is probed, and its server's
    address refuses the connection: the other ranks there go down with it. Before, they
    stayed up until a request of theirs failed too. The server back, all three are
    back."""
    stub = StubWorker(listen_on=reserved_socket())  # its port bound until it serves
    port = stub.port
    url = f"http://127.0.0.1:{port}"  # nothing listens there yet
    metrics = RouterMetrics()
    pool = UpstreamPool(1.0, 5.0, keepalive_s=1.0)
    await pool.start()
    registry = WorkerRegistry([(rank, url) for rank in RANKS])
    prober = HealthProber(registry, pool, period_s=0.05, metrics=metrics)
    try:
        down = registry.get("gpu-0-dp0")
        down.mark_http_failure("HTTP 503")
        prober.probe_later(down)
        await _until(lambda: not any(registry.get(r).http_up for r in RANKS))
        assert "cannot connect" in registry.get("gpu-0-dp2").last_http_error
        await stub.start()
        await _until(lambda: all(registry.get(r).http_up for r in RANKS))
    finally:
        await prober.close()
        await pool.close()
        await stub.stop()


async def test_an_error_status_from_one_rank_takes_only_that_rank_down() -> None:
    """The server answers the suspect rank's /health with a 500: that rank is down, the
    other ranks there stay up (the server answered: it is not the address that failed)."""
    server = HealthServer()
    await server.start()
    metrics = RouterMetrics()
    pool = UpstreamPool(1.0, 5.0, keepalive_s=1.0)
    await pool.start()
    registry = WorkerRegistry([(rank, server.url) for rank in RANKS])
    prober = HealthProber(registry, pool, period_s=0.05, metrics=metrics)
    try:
        server.status = 500
        prober.probe_later(registry.get("gpu-0-dp0"))
        await _until(lambda: not registry.get("gpu-0-dp0").http_up)
        assert "HTTP 500" in registry.get("gpu-0-dp0").last_http_error
        await asyncio.sleep(0.2)  # several probes of the down rank, all 500
        assert registry.get("gpu-0-dp1").http_up and registry.get("gpu-0-dp2").http_up
        server.status = 200
        await _until(lambda: registry.get("gpu-0-dp0").http_up)
    finally:
        await prober.close()
        await pool.close()
        await server.stop()
