"""The KV event ingestor's actions, performed: what the cluster feed (cluster_feed.py)
does with each list of actions the ingestor (``kvhint.router.kv_index``) returns.

- :class:`~kvhint.router.kv_index.RequestSnapshot`: the worker's snapshot page, asked by
  request/reply on ``<prefix>.v1.snapshot.<w>`` (a task of the feed's), fed back to the
  ingestor (or its failure); counted in ``kvhint_router_resyncs_total{worker, reason,
  result}`` (requested, loaded, purged; refused: the worker's ``SnapshotRefused``, its
  reason logged; failed: a timeout, a NATS error, a reply that is neither page nor
  refusal, that one logged too; both logs throttled per worker). Either is asked again (``snapshot_retry_s``, doubled for each
  failure in a row up to ``snapshot_retry_max_s``);
- :class:`~kvhint.router.kv_index.WorkerDead` / ``WorkerAlive``: the registry's
  ``plugin_alive``;
- ``WorkerPurgedNotice``, ``WorkerIdConflict``: counted, logged.

The ingestor decides; this module only performs. Single event loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from nats.errors import Error as NatsError

from kvhint.router.kv_index import (
    IngestAction,
    KvEventIngestor,
    RequestSnapshot,
    WorkerAlive,
    WorkerDead,
    WorkerIdConflict,
    WorkerPurgedNotice,
)
from kvhint.router.service.log_throttle import PerKeyLogThrottle
from kvhint.router.service.metrics import RouterMetrics
from kvhint.router.service.nats_link import NatsLink
from kvhint.router.service.workers import WorkerRegistry
from kvhint.schemas import (
    SnapshotRefused,
    SnapshotRequest,
    WireDecodeError,
    decode_snapshot_reply,
    encode_snapshot_request,
)

log = logging.getLogger(__name__)


class IndexActions:
    """Performs the ingestor's actions; ``spawn`` runs a snapshot request as a task the
    caller owns (and cancels on close)."""

    def __init__(self, link: NatsLink, ingestor: KvEventIngestor, workers: WorkerRegistry,
                 metrics: RouterMetrics, snapshot_timeout_s: float,
                 spawn: Callable[[Coroutine[Any, Any, None]], None]) -> None:
        self._link = link
        self._ingestor = ingestor
        self._workers = workers
        self._metrics = metrics
        self._snapshot_timeout_s = snapshot_timeout_s
        self._spawn = spawn
        # Refused and failed snapshot requests logged per worker and kind, throttled:
        # a busy worker refuses each retry (every failure is counted).
        self.failure_log = PerKeyLogThrottle()

    def perform(self, actions: list[IngestAction]) -> None:
        for action in actions:
            if isinstance(action, RequestSnapshot):
                self._metrics.resyncs.labels(action.worker_id, _reason_label(action.reason),
                                             "requested").inc()
                self._spawn(self._fetch_page(action))
            elif isinstance(action, WorkerPurgedNotice):
                log.info("index purged worker %s: %s", action.worker_id, action.reason)
                self._metrics.resyncs.labels(action.worker_id, _reason_label(action.reason),
                                             "purged").inc()
            elif isinstance(action, WorkerDead):
                log.warning("worker %s silent for %.1fs: purged from the index",
                            action.worker_id, action.silence_s)
                worker = self._workers.get(action.worker_id)
                if worker is not None:
                    worker.plugin_alive = False
            elif isinstance(action, WorkerAlive):
                worker = self._workers.ensure(action.worker_id)
                worker.plugin_alive = True
            elif isinstance(action, WorkerIdConflict):
                # Once per conflict (the ingestor holds it; kvhint_router_worker_id_conflict
                # shows it while held, the admin worker view's "conflict" names the other).
                # Each URL and epoch as written on the wire, repr'd: whoever publishes a
                # heartbeat writes them (not yet checked: the refused engine's never is),
                # and a newline in one would forge log lines of its own.
                log.warning(
                    "worker id %s: two engines heartbeat under it: %s (epoch %r, followed) "
                    "and %s (epoch %r, refused); give each server its own worker_id in "
                    "kv_connector_extra_config (the default is w<data-parallel rank>)",
                    action.worker_id, _shown_url(action.url), action.epoch,
                    _shown_url(action.other_url), action.other_epoch)

    async def _fetch_page(self, request: RequestSnapshot) -> None:
        payload = encode_snapshot_request(SnapshotRequest(cursor=request.cursor,
                                                          limit=request.limit,
                                                          seq=request.seq))
        try:
            reply = await self._link.request(self._link.subjects.snapshot(request.worker_id),
                                             payload, self._snapshot_timeout_s)
            page = decode_snapshot_reply(reply)
        except (NatsError, asyncio.TimeoutError, WireDecodeError, RuntimeError) as exc:
            reason = f"{type(exc).__name__}: {exc}"
            self._metrics.resyncs.labels(request.worker_id, "snapshot", "failed").inc()
            if isinstance(exc, WireDecodeError):  # neither a page nor a refusal
                self._log_failure(request.worker_id, "undecodable",
                                  "answered with no snapshot page nor refusal", reason)
            self.perform(self._ingestor.on_snapshot_failed(request.worker_id, reason))
            return
        if isinstance(page, SnapshotRefused):
            # The worker could not serve it now (its inbox full...): asked again soon.
            self._metrics.resyncs.labels(request.worker_id, "snapshot", "refused").inc()
            self._log_failure(request.worker_id, "refused", "refused its snapshot request",
                              page.error)
            self.perform(self._ingestor.on_snapshot_failed(
                request.worker_id, f"snapshot refused: {page.error}"))
            return
        if page.worker_id != request.worker_id:
            # A plugin answering under another worker's id would overwrite that worker's
            # resync; this one's request is retried.
            self._metrics.drop("snapshot_wrong_worker")
            self.perform(self._ingestor.on_snapshot_failed(
                request.worker_id, f"snapshot reply names worker {page.worker_id!r}"))
            return
        actions = self._ingestor.on_snapshot_page(page, request.cursor)
        if page.next_cursor is None:
            self._metrics.resyncs.labels(request.worker_id, "snapshot", "loaded").inc()
        self.perform(actions)

    def _log_failure(self, worker_id: str, kind: str, what: str, reason: str) -> None:
        held = self.failure_log.admit(f"{kind}:{worker_id}")
        if held is None:
            return
        # The reason is the worker's text: repr'd (no raw newline or control), cut short.
        log.warning("worker %s %s: %r (asked again; %d more like it not logged since the "
                    "last)", worker_id, what, reason[:300], held)


def _reason_label(reason: str) -> str:
    """A bounded label from a free-text reason ("engine restarted (epoch a -> b)")."""
    # "stalled" first: a stalled resync's reason quotes the reason the resync began.
    for word in ("stalled", "restart", "gap", "mid-stream", "dead", "behind", "tail", "epoch",
                 "silent"):
        if word in reason:
            return word
    return "other"


def _shown_url(url: str | None) -> str:
    """A heartbeat's ``http_url`` as a log line shows it: repr'd (no raw newline or
    control), at most 200 characters of it."""
    return "an engine without http_url" if url is None else repr(url[:200])
