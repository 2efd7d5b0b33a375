"""Bring failed workers back: a worker the proxy could not reach is probed on
``/health`` every ``period_s`` until it answers, then routed to again."""

from __future__ import annotations

import asyncio
import logging

from kvhint.router.service.upstream import UpstreamPool
from kvhint.router.service.workers import WorkerRegistry

log = logging.getLogger(__name__)


class HealthProber:
    def __init__(self, workers: WorkerRegistry, pool: UpstreamPool, period_s: float) -> None:
        self._workers = workers
        self._pool = pool
        self._period_s = period_s
        self._tasks: dict[str, asyncio.Task[None]] = {}

    def probe_later(self, worker_id: str) -> None:
        if worker_id not in self._tasks:
            self._tasks[worker_id] = asyncio.create_task(self._probe(worker_id),
                                                         name=f"kvhint-probe-{worker_id}")

    async def _probe(self, worker_id: str) -> None:
        try:
            while True:
                await asyncio.sleep(self._period_s)
                worker = self._workers.get(worker_id)
                if worker is None or worker.url is None:
                    return
                if await self._pool.get_ok(worker.url + "/health", timeout_s=2.0):
                    self._workers.mark_http_ok(worker_id)
                    log.info("worker %s answers /health again", worker_id)
                    return
        finally:
            self._tasks.pop(worker_id, None)

    async def close(self) -> None:
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
