"""The router's background tasks, owned in one place (``RouterRuntime.tasks``).

Work started on its own, outside a request and outside the periodic loops: the feed's
snapshot requests, JetStream retries and stream checks (cluster_feed.py,
stream_watch.py), the cancel notices' resend (responses_cancel_notices.py), the cancel
rechecks after a reconnect (responses_cancel_rechecks.py). Before, each component kept
its own tasks and the runtime's stop ended only the feed's: a recheck or a resend still
running at a shutdown ran on against a closed HTTP pool or NATS link (a failed check
counted, a warning logged, for nothing) and was destroyed pending when the loop closed.
Now the runtime's stop cancels and awaits them all before it closes what they use, and
none starts after (a link reconnecting during the stop).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

log = logging.getLogger(__name__)


class TaskSet:
    """Tasks started with :meth:`spawn`, kept until done; :meth:`close` cancels and awaits
    those running and refuses new ones. Single event loop.

    ``on_failed``: called once per task that ended with an exception (the runtime counts
    it, ``drops_total{what="periodic_job_error"}``, as a periodic job's failed round: the
    work that task was to do is lost, and a log line alone raised no alert)."""

    def __init__(self, on_failed: Callable[[], None] | None = None) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()
        self.closed = False
        self.on_failed = on_failed

    def __len__(self) -> int:
        return len(self._tasks)

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str | None = None
              ) -> asyncio.Task[Any] | None:
        """Run ``coro`` as a task; None (``coro`` closed unstarted) once closed."""
        if self.closed:
            coro.close()
            return None
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            # Retrieved here, logged with its traceback: nobody awaits these tasks.
            log.error("background task %s failed", task.get_name(), exc_info=exc)
            if self.on_failed is not None:
                self.on_failed()

    async def close(self) -> None:
        """Cancel every task still running and wait for each to end."""
        self.closed = True
        while self._tasks:
            tasks = list(self._tasks)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
