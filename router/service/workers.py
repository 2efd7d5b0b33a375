"""The fleet as the router sees it: workers from config and from heartbeats.

Two independent kinds of liveness:

- HTTP: a worker the proxy could not reach is marked down and probed (``/health``)
  until it answers; only HTTP-up workers with a URL are routed to.
- Plugin: a worker whose plugin heartbeats (``kvhint.v1.status.<w>``) is ``plugin_alive``
  until the index's stream tracker declares it dead (missed heartbeats; its index entries
  are purged then) and no hints go to it meanwhile. Plain vLLM workers (no plugin) never
  heartbeat and still serve.

A worker that moves (its heartbeat names a new ``http_url``) gets a new
:class:`WorkerState`. What a request or a probe learns of an *address* (it failed, it
timed out, it answered) is recorded on the state it used, never on whatever the registry
holds under the worker's id by then: a failure at the address a worker has left says
nothing of its new one. What belongs to the *worker* (requests in flight and served,
its heartbeat, its plugin) carries over to the new state and is settled by id.

All state lives on the event loop thread; nothing here does I/O.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field, replace
from enum import Enum

from kvhint.schemas import WorkerStatus


class HeartbeatVerdict(str, Enum):
    FIRST = "first"
    SAME_EPOCH = "same_epoch"
    NEW_EPOCH = "new_epoch"
    REVIVED = "revived"


@dataclass(slots=True)
class WorkerState:
    worker_id: str
    url: str | None
    from_config: bool
    http_up: bool = True
    http_failures: int = 0
    last_http_error: str = ""
    # Requests in a row it held past request_timeout_s without sending its headers
    # (reset by any response that starts): see :meth:`note_timeout`.
    silent_timeouts: int = 0
    # Requests the router has in flight on this worker.
    inflight: int = 0
    status: WorkerStatus | None = None
    last_heartbeat: float | None = None  # monotonic
    plugin_alive: bool = False
    epoch: str | None = None
    requests: int = 0
    # The model names its /v1/models lists (served names and LoRA adapters); None until
    # it has answered once.
    served_models: frozenset[str] | None = None
    added_at: float = field(default_factory=time.monotonic)
    # A response has started, or /health answered, at this address (a move resets it,
    # with served_models: ``requests`` is the worker's, from any address).
    http_answered: bool = False

    @property
    def routable(self) -> bool:
        return self.url is not None and self.http_up

    @property
    def answered(self) -> bool:
        """It has answered over HTTP at its current address (``/ready``)."""
        return self.http_answered or self.served_models is not None

    def may_serve(self, model: str) -> bool:
        return self.served_models is None or model in self.served_models

    # What a request or a probe learnt of an address, recorded on the state it used
    # (module doc): the caller asks :meth:`WorkerRegistry.is_current` before acting on
    # the worker. They change this state only: the registry keeps no count of its own.

    def mark_http_failure(self, reason: str) -> None:
        self.http_up = False
        self.http_failures += 1
        self.last_http_error = reason

    def mark_http_ok(self) -> None:
        """Its /health answered."""
        self.http_up = True
        self.silent_timeouts = 0
        self.http_answered = True

    def note_timeout(self) -> int:
        """The worker held a request past request_timeout_s without sending its headers;
        returns how many in a row. One is a slow worker (a long non-streamed answer);
        several in a row may be a hung one, which the caller has probed."""
        self.silent_timeouts += 1
        return self.silent_timeouts

    def note_answered(self) -> None:
        """The worker started a response: not hung, whatever timed out before."""
        self.silent_timeouts = 0
        self.http_answered = True


class WorkerRegistry:
    def __init__(self, configured: list[tuple[str, str]]) -> None:
        self._workers: dict[str, WorkerState] = {
            worker_id: WorkerState(worker_id, url, from_config=True)
            for worker_id, url in configured
        }
        # Callers waiting for a worker's heartbeat (see :meth:`wait_heard`), set and
        # dropped by the heartbeat.
        self._heard: dict[str, asyncio.Event] = {}

    def __contains__(self, worker_id: str) -> bool:
        return worker_id in self._workers

    def get(self, worker_id: str) -> WorkerState | None:
        return self._workers.get(worker_id)

    def all(self) -> list[WorkerState]:
        return list(self._workers.values())

    def routable(self) -> list[WorkerState]:
        return [w for w in self._workers.values() if w.routable]

    def at_address(self, url: str) -> list[WorkerState]:
        """The workers whose current address is ``url``. Several is normal: each
        data-parallel rank of one vLLM server is a worker id of its own at the server's URL
        (told apart by the X-data-parallel-rank its heartbeat names). Moves, failures and
        probes stay per worker id; only a request that could not connect to the address at
        all (forwarding.py), or a /health probe that could not connect or got no answer
        in time (health.py), marks the others there down with it."""
        return [w for w in self._workers.values() if w.url == url]

    def mark_address_down(self, url: str, failed_id: str, reason: str) -> list[WorkerState]:
        """``url`` failed ``failed_id`` at the address itself: every other worker still up
        there is marked down with ``reason``. Returns those, for the caller to probe
        (each comes back by its own probe)."""
        siblings = [w for w in self.at_address(url) if w.worker_id != failed_id and w.http_up]
        for sibling in siblings:
            sibling.mark_http_failure(f"{reason} (at worker {failed_id})")
        return siblings

    def forget_silent(self, now: float, after_s: float) -> list[str]:
        """Forget the workers known only by their heartbeats (not configured) that have
        said nothing for ``after_s`` (monotonic ``now``) and have nothing in flight: a pod
        gone for good. Before, they stayed for the router's life, probed, listed, and
        their metric series kept alerting. Returns their ids."""
        gone = [w.worker_id for w in self._workers.values()
                if not w.from_config and w.inflight == 0
                and now - (w.last_heartbeat if w.last_heartbeat is not None
                           else w.added_at) > after_s]
        for worker_id in gone:
            del self._workers[worker_id]
        return gone

    def heard_within(self, worker_id: str, window_s: float, now: float | None = None) -> bool:
        """Whether the worker's plugin heartbeated to this router within the last
        ``window_s`` (monotonic ``now``); False for one it does not hold, or has not heard
        since it started (restored from the store)."""
        worker = self._workers.get(worker_id)
        if worker is None or worker.last_heartbeat is None:
            return False
        now = time.monotonic() if now is None else now
        return now - worker.last_heartbeat <= window_s

    def not_serving(self, model: str | None) -> frozenset[str]:
        """Workers a request for ``model`` must not go to: those whose model list lacks
        it, once some worker lists it (vLLM answers another model's name with a 404).
        Empty when ``model`` is None or no worker lists it: a worker that has not
        answered /v1/models yet, or a list out of date, may still serve it."""
        if model is None or not any(w.served_models and model in w.served_models
                                    for w in self._workers.values()):
            return frozenset()
        return frozenset(w.worker_id for w in self._workers.values() if not w.may_serve(model))

    def ensure(self, worker_id: str, url: str | None = None) -> WorkerState:
        worker = self._workers.get(worker_id)
        if worker is None:
            worker = WorkerState(worker_id, url, from_config=False)
            self._workers[worker_id] = worker
        elif url and url != worker.url and (worker.url is None or not worker.from_config):
            # A worker known by its heartbeats moved (a pod rescheduled on another
            # address): route to where it says it is now, and learn its models again.
            # Before, the first address was kept for good. A configured URL wins.
            # A new state, not the old one changed: whoever still holds the old one
            # (a model listing of the old address still on its way) writes what it
            # learnt there onto a state nobody routes by, never onto the new address.
            # What belongs to the worker, not to its address, carries over (in-flight
            # requests are settled by id, on this state).
            worker = replace(worker, url=url, http_up=True, http_failures=0,
                             last_http_error="", silent_timeouts=0, served_models=None,
                             http_answered=False)
            self._workers[worker_id] = worker
        return worker

    def on_heartbeat(self, status: WorkerStatus, now: float | None = None) -> HeartbeatVerdict:
        """Record a heartbeat; the verdict says whether the engine restarted.

        Contract: only heartbeats the index's stream took (``KvEventIngestor.follows``;
        cluster_feed.py). It judges epochs (an engine moved past, two engines under one
        worker id, kv_index/stream_sources.py); this takes any epoch it is given as the
        worker's, so two engines' heartbeats given both would swap the worker's epoch,
        address and status at every beat."""
        now = time.monotonic() if now is None else now
        worker = self.ensure(status.worker_id, getattr(status, "http_url", None))
        if worker.epoch is None:
            verdict = HeartbeatVerdict.FIRST
        elif worker.epoch != status.epoch:
            verdict = HeartbeatVerdict.NEW_EPOCH
        elif not worker.plugin_alive:
            verdict = HeartbeatVerdict.REVIVED
        else:
            verdict = HeartbeatVerdict.SAME_EPOCH
        worker.status = status
        worker.epoch = status.epoch
        worker.last_heartbeat = now
        worker.plugin_alive = True
        heard = self._heard.pop(status.worker_id, None)
        if heard is not None:
            heard.set()
        return verdict

    async def wait_heard(self, worker_id: str, timeout_s: float) -> WorkerState | None:
        """The worker once its plugin has heartbeated (now or within ``timeout_s``), else
        None. Only a heartbeat counts: it brings the status hints are checked against."""
        worker = self._workers.get(worker_id)
        if worker is not None and worker.plugin_alive and worker.status is not None:
            return worker
        if timeout_s <= 0:
            return None
        heard = self._heard.setdefault(worker_id, asyncio.Event())
        try:
            await asyncio.wait_for(heard.wait(), timeout_s)
        except asyncio.TimeoutError:
            return None
        return self._workers.get(worker_id)

    def is_current(self, worker: WorkerState) -> bool:
        """Whether ``worker`` is still its worker's state: False once the worker moved (a
        new address, a new state) or was forgotten."""
        return self._workers.get(worker.worker_id) is worker
