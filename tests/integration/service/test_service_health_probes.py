"""The health prober's own metrics: every /health probe counted by worker and outcome,
and timed; a forgotten worker's probe series go with it. A real HTTP server on
localhost."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from conftest import StubWorker
from kvhint.router.devstack.ports import reserved_socket
from kvhint.router.service.health import HealthProber
from kvhint.router.service.metrics import RouterMetrics
from kvhint.router.service.upstream import UpstreamPool
from kvhint.router.service.workers import WorkerRegistry


async def _until(predicate: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting"
        await asyncio.sleep(0.01)


def _probes(metrics: RouterMetrics) -> dict[tuple[str, str], float]:
    return {(s.labels["worker"], s.labels["outcome"]): s.value
            for family in metrics.health_probes.collect() for s in family.samples
            if s.name.endswith("_total")}


def _timed(metrics: RouterMetrics) -> float:
    return next(s.value for family in metrics.health_probe_seconds.collect()
                for s in family.samples if s.name.endswith("_count"))


async def test_each_probe_is_counted_by_outcome_and_timed_and_forgotten_with_its_worker(
        ) -> None:
    """A worker down (nothing listens at its address) is probed and fails, then comes up
    and answers: both outcomes counted under its id, each probe timed. Before, the prober
    had no metric of its own: a worker flapping, or probes slow, showed nowhere."""
    worker = StubWorker(listen_on=reserved_socket())  # its port bound until it serves
    port = worker.port
    metrics = RouterMetrics()
    pool = UpstreamPool(1.0, 5.0, keepalive_s=1.0)
    await pool.start()
    registry = WorkerRegistry([("w0", f"http://127.0.0.1:{port}")])
    prober = HealthProber(registry, pool, period_s=0.02, metrics=metrics)
    try:
        down = registry.get("w0")
        down.mark_http_failure("refused")
        prober.probe_later(down)
        await _until(lambda: _probes(metrics).get(("w0", "failed"), 0) >= 2)
        await worker.start()
        await _until(lambda: registry.get("w0").http_up)
        probes = _probes(metrics)
        assert probes[("w0", "answered")] == 1
        assert _timed(metrics) == probes[("w0", "answered")] + probes[("w0", "failed")]
        assert "kvhint_router_health_probes_total{" in metrics.render().decode()
        metrics.forget_worker("w0")
        assert _probes(metrics) == {}
        assert "kvhint_router_health_probes_total{" not in metrics.render().decode()
    finally:
        await prober.close()
        await pool.close()
        await worker.stop()
