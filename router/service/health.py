"""Bring failed workers back, and take hung ones out: a worker the proxy could not reach is
probed on ``/health`` every ``period_s`` until it answers, then routed to again.

A worker still up when it is handed over (the forwarder's suspect: several requests in a
row held past ``request_timeout_s`` without a status line) is probed at once instead. A
hung server that accepts connections and never answers fails that probe too, is marked
down and probed like any other worker down; a slow worker that is alive answers
``/health`` (vLLM's answers while the engine is busy) and stays up.

A probe that fails at the address (no connection, or no answer in time:
``ProbeResult.address_failed``) marks every other worker still up at that address down
too, each then probed back on its own: the data-parallel ranks of one vLLM server share
its URL and its one API server, so a hung or dead server is every rank's. A status other
than 200 is the probed worker's alone.

Every probe is counted, ``kvhint_router_health_probes_total{worker, outcome}`` (outcome
``answered``: a 200 within PROBE_TIMEOUT_S; ``failed``: anything else), and timed,
``kvhint_router_health_probe_seconds`` (no worker label: one histogram for the fleet).
"""

from __future__ import annotations

import asyncio
import logging
import time

from kvhint.router.service.metrics import RouterMetrics
from kvhint.router.service.upstream import ProbeResult, UpstreamPool
from kvhint.router.service.workers import WorkerRegistry, WorkerState

log = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 2.0


class HealthProber:
    def __init__(self, workers: WorkerRegistry, pool: UpstreamPool, period_s: float,
                 metrics: RouterMetrics) -> None:
        self._workers = workers
        self._pool = pool
        self._metrics = metrics
        self._period_s = period_s
        self._tasks: dict[str, asyncio.Task[None]] = {}

    def probe_later(self, worker: WorkerState) -> None:
        """Probe ``worker`` (the state a request failed or timed out at) until it answers
        (down), or once now (still up: a suspect). One probe task per worker: a call
        while one runs adds nothing (that one goes on with the worker's current state)."""
        if worker.worker_id not in self._tasks:
            self._tasks[worker.worker_id] = asyncio.create_task(
                self._probe(worker), name=f"kvhint-probe-{worker.worker_id}")

    async def _probe(self, worker: WorkerState) -> None:
        """What a probe finds is noted on the state whose address it asked (a worker that
        moved meanwhile is not marked down, nor up, at its new address for it); a worker
        down is then probed at its address of the moment."""
        worker_id = worker.worker_id
        try:
            if worker.http_up and worker.url is not None and self._workers.is_current(worker):
                url = worker.url
                result = await self._ask(worker_id, url)
                if not result.ok:
                    worker.mark_http_failure(
                        f"{result.reason} after requests timed out before their headers")
                    log.warning("worker %s holds requests without answering and fails "
                                "its /health at %r (%s): marked down%s", worker_id, url,
                                result.reason, "" if self._workers.is_current(worker) else
                                " (an address it has left since)")
                    if result.address_failed:
                        self._address_down(url, worker_id, result.reason)
                # Slow, not hung, it stays up; unless marked down meanwhile by a failed
                # request, then probed as such.
            while True:
                worker = self._workers.get(worker_id)
                if worker is None or worker.url is None or worker.http_up:
                    return  # gone, or up (back, or moved to a new address)
                await asyncio.sleep(self._period_s)
                worker = self._workers.get(worker_id)
                if worker is None or worker.url is None or worker.http_up:
                    return
                result = await self._ask(worker_id, worker.url)
                if not result.ok:
                    if result.address_failed:
                        self._address_down(worker.url, worker_id, result.reason)
                    continue
                worker.mark_http_ok()
                if self._workers.is_current(worker):
                    log.info("worker %s answers /health again", worker_id)
                    return
                log.info("worker %s answers /health at %r, an address it has left "
                         "since: its new one is probed", worker_id, worker.url)
        finally:
            self._tasks.pop(worker_id, None)

    def _address_down(self, url: str, worker_id: str, reason: str) -> None:
        """``url`` failed ``worker_id``'s probe at the address: the other workers still up
        there are marked down and probed, each on its own (it comes back when its own
        probe answers)."""
        for sibling in self._workers.mark_address_down(url, worker_id, reason):
            self.probe_later(sibling)
            log.warning("worker %s: its address %r failed worker %s's /health (%s): "
                        "marked down too", sibling.worker_id, url, worker_id, reason)

    async def _ask(self, worker_id: str, url: str) -> ProbeResult:
        started = time.perf_counter()
        result = await self._pool.probe(url + "/health", timeout_s=PROBE_TIMEOUT_S,
                                        worker_id=worker_id)
        self._metrics.record_probe(worker_id, result.ok, time.perf_counter() - started)
        return result

    async def close(self) -> None:
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
