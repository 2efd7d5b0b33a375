"""The prompt-hashing threads' queue, fair across tenants.

Long prompts are tokenized and hashed off the event loop (``routing_service.py``). With
one first-in-first-out queue, one tenant's burst of long prompts (each up to
``routing.max_prompt_tokens``: tens of ms to seconds of tokenizer work) delayed every other
tenant's hashing, and so its routing, by the whole burst. Here each tenant has its own
FIFO queue and the threads take one job from each tenant with jobs waiting in turn
(round-robin): a tenant's job waits for at most about one job of each other tenant's
(per thread), whatever their backlog.

A tenant may have at most ``per_tenant`` jobs waiting; :meth:`FairHashQueue.submit` over
that raises :class:`TenantQueueFull` (the caller routes the request without prompt hashes,
counted) rather than let one tenant's backlog, and its memory, grow without bound.

Built in the runtime's lifespan and shut down on close (``runtime.py``); nothing here
exists at import time.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

# A queued call: its future, the function, its arguments.
_Job = tuple[Future[Any], Callable[..., Any], tuple[Any, ...]]


class TenantQueueFull(Exception):
    """The tenant already has ``per_tenant`` hash jobs waiting."""


class FairHashQueue:
    """``threads`` threads serving per-tenant FIFO queues round-robin. Thread-safe; the
    futures are ``concurrent.futures.Future`` (await them with ``asyncio.wrap_future``;
    cancelling one that has not started means it never runs).

    The round: a tenant with jobs waiting and none running is *ready*; threads take the
    first ready tenant's next job, and the tenant rejoins the back of the ready line
    when that job ends (not when it starts: a tenant that arrives while another's job
    runs is served before that other's next job). Only when no tenant is ready does a
    free thread take another job of a tenant that has one running (the one with the
    fewest running), so a lone tenant still uses every thread."""

    def __init__(self, threads: int = 1, per_tenant: int = 64,
                 thread_name_prefix: str = "kvhint-hash") -> None:
        if threads < 1 or per_tenant < 1:
            raise ValueError("FairHashQueue needs at least one thread and one job per tenant")
        self.per_tenant = per_tenant
        self._cond = threading.Condition()
        self._queues: dict[str, deque[_Job]] = {}  # tenants with jobs waiting (non-empty)
        self._ready: dict[str, None] = {}  # in _queues and none running; ordered: the line
        self._running: dict[str, int] = {}
        self._closed = False
        # Daemon threads: a hash still running at exit must not hold the process.
        self._threads = [threading.Thread(target=self._serve, daemon=True,
                                          name=f"{thread_name_prefix}_{i}")
                         for i in range(threads)]
        for thread in self._threads:
            thread.start()

    def submit(self, tenant: str, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        """Queue ``fn(*args)`` behind ``tenant``'s own waiting jobs; raises
        :class:`TenantQueueFull` when it has ``per_tenant`` waiting, RuntimeError once
        shut down."""
        future: Future[Any] = Future()
        with self._cond:
            if self._closed:
                raise RuntimeError("the hashing queue is shut down")
            queue = self._queues.get(tenant)
            if queue is None:
                queue = self._queues[tenant] = deque()
            elif len(queue) >= self.per_tenant:
                raise TenantQueueFull(tenant)
            queue.append((future, fn, args))
            if tenant not in self._running:
                self._ready.setdefault(tenant)
            self._cond.notify()
        return future

    def waiting(self, tenant: str) -> int:
        """Jobs of ``tenant`` not yet started."""
        with self._cond:
            return len(self._queues.get(tenant, ()))

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Stop taking jobs (the signature of ``Executor.shutdown``). Waiting jobs are
        cancelled with ``cancel_futures``, else still run; ``wait``: join the threads."""
        with self._cond:
            self._closed = True
            if cancel_futures:
                for queue in self._queues.values():
                    for future, _fn, _args in queue:
                        future.cancel()
                self._queues.clear()
                self._ready.clear()
            self._cond.notify_all()
        if wait:
            for thread in self._threads:
                thread.join()

    def _take(self) -> tuple[str, _Job] | None:
        """The next job and its tenant (counted running); None once shut down and empty."""
        with self._cond:
            while not self._queues and not self._closed:
                self._cond.wait()
            if not self._queues:
                return None
            if self._ready:
                tenant = next(iter(self._ready))
                del self._ready[tenant]
            else:
                tenant = min(self._queues, key=lambda name: self._running.get(name, 0))
            queue = self._queues[tenant]
            job = queue.popleft()
            if not queue:
                del self._queues[tenant]
            self._running[tenant] = self._running.get(tenant, 0) + 1
            return tenant, job

    def _done(self, tenant: str) -> None:
        with self._cond:
            left = self._running[tenant] - 1
            if left:
                self._running[tenant] = left
                return
            del self._running[tenant]
            if tenant in self._queues:
                self._ready.setdefault(tenant)  # the back of the line

    def _serve(self) -> None:
        while (taken := self._take()) is not None:
            tenant, (future, fn, args) = taken
            try:
                if future.set_running_or_notify_cancel():  # else its request went away
                    try:
                        result = fn(*args)
                    except BaseException as exc:  # noqa: BLE001 - handed to the request
                        future.set_exception(exc)
                    else:
                        future.set_result(result)
            finally:
                self._done(tenant)
