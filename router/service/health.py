"""Bring failed workers back, and take hung ones out: a worker the proxy could not reach is
probed on ``/health`` every ``period_s`` until it answers, then routed to again.

A worker still up when it is handed over (the forwarder's suspect: several requests in a
row held past ``request_timeout_s`` without a status line) is probed at once instead. A
hung server that accepts connections and never answers fails that probe too, is marked
down and probed like any other worker down; a slow worker that is alive answers
``/health`` (vLLM's answers while the engine is busy) and stays up.
"""

from __future__ import annotations

import asyncio
import logging

from kvhint.router.service.upstream import UpstreamPool
from kvhint.router.service.workers import WorkerRegistry

log = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 2.0


class HealthProber:
    def __init__(self, workers: WorkerRegistry, pool: UpstreamPool, period_s: float) -> None:
        self._workers = workers
        self._pool = pool
        self._period_s = period_s
        self._tasks: dict[str, asyncio.Task[None]] = {}

    def probe_later(self, worker_id: str) -> None:
        """Probe ``worker_id`` until it answers (down), or once now (still up: a suspect).
        One probe task per worker: a call while one runs adds nothing."""
        if worker_id not in self._tasks:
            self._tasks[worker_id] = asyncio.create_task(self._probe(worker_id),
                                                         name=f"kvhint-probe-{worker_id}")

    async def _probe(self, worker_id: str) -> None:
        try:
            worker = self._workers.get(worker_id)
            if worker is not None and worker.http_up and worker.url is not None:
                if await self._answers(worker.url):
                    worker = self._workers.get(worker_id)
                    if worker is None or worker.http_up:
                        return  # slow, not hung: it stays up
                    # Marked down meanwhile by a failed request: probe it as such.
                else:
                    self._workers.mark_http_failure(
                        worker_id, f"no answer to /health within {PROBE_TIMEOUT_S:g} s "
                        "after requests timed out before their headers")
                    log.warning("worker %s holds requests without answering and fails "
                                "its /health: marked down", worker_id)
            while True:
                await asyncio.sleep(self._period_s)
                worker = self._workers.get(worker_id)
                if worker is None or worker.url is None:
                    return
                if worker.http_up:
                    return  # back meanwhile (moved to a new address)
                if await self._answers(worker.url):
                    self._workers.mark_http_ok(worker_id)
                    log.info("worker %s answers /health again", worker_id)
                    return
        finally:
            self._tasks.pop(worker_id, None)

    async def _answers(self, url: str) -> bool:
        return await self._pool.get_ok(url + "/health", timeout_s=PROBE_TIMEOUT_S)

    async def close(self) -> None:
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
