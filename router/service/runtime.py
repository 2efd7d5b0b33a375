"""Everything the router holds for its lifetime, built in the app's lifespan and torn
down in reverse order. Nothing here exists at import time.

Start order: metrics -> store (migrate, recover) -> workers, sessions, hints -> upstream
HTTP pool -> tokenizer discovery -> index + ingestor + the prompt-hashing threads -> NATS
(background connect) -> periodic loops. Stop: loops -> background tasks -> trace file -> NATS drain -> HTTP
pool -> hashing threads -> last store flush -> engine.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Engine

from kvhint.router.kv_index import (
    IndexStats,
    InMemoryClusterKvIndex,
    KvEventIngestor,
    StreamConfig,
)
from kvhint.router.policy import PlannerConfig, RoutingConfig, RoutingPolicy
from kvhint.router.service.cluster_feed import OUTCOMES_CURSOR, RELEASES_CURSOR, ClusterFeed
from kvhint.router.service.forwarding import Forwarder
from kvhint.router.service.hash_queue import FairHashQueue
from kvhint.router.service.health import HealthProber
from kvhint.router.service.hint_dispatch import HintDispatcher
from kvhint.router.service.lifecycle import SessionLifecycle
from kvhint.router.service.metric_labels import GATEWAY_REJECTIONS
from kvhint.router.service.metrics import RouterMetrics
from kvhint.router.service.metrics_state import StateSample
from kvhint.router.service.model_discovery import discover_models, warm_hasher
from kvhint.router.service.nats_link import NatsLink, StreamLimits
from kvhint.router.service.responses_cancel_notices import CancelNotices
from kvhint.router.service.routing_service import RoutingService
from kvhint.router.service.session_reads import StoredSessions
from kvhint.router.service.task_set import TaskSet
from kvhint.router.service.sessions import SessionRegistry
from kvhint.router.service.settings import DEFAULT_SALT_SECRET, RouterSettings
from kvhint.router.service.tenancy import TenantDirectory
from kvhint.router.service.tenant_call_rate import TenantCallRate
from kvhint.router.service.timeline import Timeline
from kvhint.router.service.trace_recorder import TraceRecorder
from kvhint.router.service.upstream import UpstreamPool
from kvhint.router.service.worker_urls import HeartbeatUrlPolicy
from kvhint.router.service.workers import WorkerRegistry
from kvhint.router.store.database import create_store_engine, migrate
from kvhint.router.store.reader import load_recovery
from kvhint.router.store.retention import prune
from kvhint.router.store.writer import StoreWriter
from kvhint.schemas import Subjects

log = logging.getLogger("kvhint.router")

MAX_SESSIONS_IN_MEMORY = 200_000
TIMELINE_INTERVAL_S = 5.0
FEED_TICK_S = 1.0
MODEL_DISCOVERY_S = 10.0
STORE_PRUNE_S = 3600.0
TRACE_FLUSH_S = 1.0


@dataclass
class RouterRuntime:
    settings: RouterSettings
    directory: TenantDirectory
    metrics: RouterMetrics
    engine: Engine
    writer: StoreWriter
    workers: WorkerRegistry
    sessions: SessionRegistry
    hints: HintDispatcher
    lifecycle: SessionLifecycle
    routing: RoutingService
    forwarder: Forwarder
    pool: UpstreamPool
    prober: HealthProber
    index: InMemoryClusterKvIndex
    ingestor: KvEventIngestor
    timeline: Timeline
    # Each tenant's calls to the session and admin endpoints, tenants[].api_calls.
    call_rate: TenantCallRate
    link: NatsLink | None = None
    feed: ClusterFeed | None = None
    # Cancels of background responses told between replicas (responses_cancel_notices.py).
    cancel_notices: CancelNotices | None = None
    models: dict[str, str] = field(default_factory=dict)  # served name -> tokenizer path
    recorder: TraceRecorder | None = None
    started_at: float = field(default_factory=time.time)
    # Background work outside requests and loops (task_set.py): the feed's, the cancel
    # notices' resend, the Responses gateway's rechecks; ended at stop, before the link
    # and the pool they use.
    tasks: TaskSet = field(default_factory=TaskSet)
    _loops: list[asyncio.Task[None]] = field(default_factory=list)

    # --- start / stop -------------------------------------------------------------------

    @classmethod
    async def start(cls, settings: RouterSettings) -> RouterRuntime:
        metrics = RouterMetrics()
        directory = TenantDirectory(settings)
        _announce(settings, directory)

        engine = create_store_engine(settings.database_url, settings.store_connect_timeout_s)
        if settings.migrate_on_start:
            await asyncio.to_thread(migrate, engine)
        now = time.time()
        recovery = await asyncio.to_thread(
            load_recovery, engine, now - settings.routing.session_forget_s,
            MAX_SESSIONS_IN_MEMORY, now)
        writer = StoreWriter(engine, settings.store_flush_interval_s, settings.store_queue_max,
                             on_drop=metrics.drop)

        workers = WorkerRegistry([(w.id, w.url) for w in settings.workers])
        url_policy = HeartbeatUrlPolicy.from_entries(settings.learn_workers_from_heartbeats,
                                                     settings.heartbeat_worker_hosts)
        _restore_workers(workers, recovery.workers, now, settings.routing.session_forget_s,
                         writer, url_policy)
        subjects = Subjects(settings.subject_prefix)
        link = None
        if settings.nats_url:
            limits = StreamLimits(settings.events_stream_max_bytes,
                                  settings.events_stream_max_age_s,
                                  settings.outcomes_stream_max_bytes,
                                  settings.outcomes_stream_max_age_s,
                                  settings.releases_stream_max_bytes,
                                  settings.releases_stream_max_age_s)
            link = NatsLink(settings.nats_url, subjects, limits=limits,
                            on_error=lambda kind: metrics.nats_errors.labels(kind).inc(),
                            on_lost=lambda count: metrics.drop("nats_slow_consumer", count))
        # Hint action ids come from this seed and must never repeat: not after a restart
        # (the store and the workers' idempotency memory still hold the old ones: a worker
        # would answer a new action with an old outcome), not between replicas.
        hints = HintDispatcher(link, subjects, workers, writer, metrics, PlannerConfig(),
                               seed=secrets.randbits(64), budget_of=directory.budget,
                               tenants=[tenant.name for tenant in directory.tenants])
        hints.restore(recovery.learned, recovery.pending_actions, recovery.held_actions)
        if recovery.unreadable_actions:  # rows whose payload is no object: left out
            metrics.drop("hint_not_restored:unreadable", recovery.unreadable_actions)
        # Each tenant's own bound too (TenantConfig.max_sessions): one tenant's churn of
        # new session ids evicts only its own.
        sessions = SessionRegistry(
            writer, MAX_SESSIONS_IN_MEMORY, on_drop=metrics.drop,
            tenant_cap=lambda name: directory.session_cap(name, MAX_SESSIONS_IN_MEMORY),
            on_evict=lambda name: metrics.sessions_evicted.labels(name).inc(),
            on_conflict=lambda outcome: metrics.session_save_conflicts.labels(outcome).inc(),
            replica_id=settings.routing.replica_id)
        for tenant in directory.tenants:
            metrics.sessions_evicted.labels(tenant.name)
            metrics.tenant_in_flight.labels(tenant.name)
            for reason in GATEWAY_REJECTIONS:
                metrics.gateway_rejections.labels(tenant.name, reason)
        restored = sessions.restore(recovery.sessions)
        recorder = None
        if settings.trace_dir is not None:
            # Fails the start-up if the folder cannot be made, not the first write.
            await asyncio.to_thread(settings.trace_dir.mkdir, parents=True, exist_ok=True)
            # A request silent past its timeout has ended (a 504). A stream that keeps
            # sending may last longer: one over half an hour is dropped from the trace
            # as stalled (counted), so one lost request cannot hold the file back longer.
            recorder = TraceRecorder(settings.trace_dir, metrics.drop,
                                     stall_s=max(settings.request_timeout_s + 60.0, 1800.0),
                                     on_written=metrics.trace_written.inc,
                                     max_bytes=settings.trace_max_bytes,
                                     keep_files=settings.trace_keep_files)
            log.info("recording traffic as session JSONL under %s", settings.trace_dir)
        index = InMemoryClusterKvIndex(max_sessions=MAX_SESSIONS_IN_MEMORY)
        ingestor = KvEventIngestor(index, clock=time.monotonic, subjects=subjects,
                                   config=StreamConfig(
                                       heartbeat_misses=settings.heartbeat_misses,
                                       # Dead workers are forgotten once the events
                                       # stream holds none of their messages to replay.
                                       # The settings' age is a floor: ClusterFeed raises
                                       # it to the stream's real max_age once it has
                                       # seen the stream (one made with a longer age).
                                       forget_dead_after_s=max(
                                           3600.0, settings.events_stream_max_age_s),
                                       replay_wait_s=settings.replay_wait_s,
                                       snapshot_retry_max_s=settings.snapshot_retry_max_s,
                                       conflict_hold_s=settings.conflict_hold_s,
                                       conflict_confirm_s=settings.conflict_confirm_s))
        stored_sessions = StoredSessions(engine, metrics,
                                         settings.routing.session_read_timeout_s)
        lifecycle = SessionLifecycle(
            sessions, hints, metrics, settings.hints.enabled, settings.routing.session_forget_s,
            on_end=recorder.session_ended if recorder else None,
            load_session=stored_sessions.row, latest_session=stored_sessions.latest
            if _refreshes_sessions(settings.routing.session_refresh, engine) else None,
            session_revisions=stored_sessions.revisions,  # with latest_session only
            # Replicas (as the reads above): an end releases their agent claims too.
            agent_claims=stored_sessions.agent_claims
            if _refreshes_sessions(settings.routing.session_refresh, engine) else None,
            max_prompt_blocks=-(-settings.routing.max_prompt_tokens // settings.block_size),
            # Without NATS nothing feeds the index: its (empty) view says nothing either way.
            index_exact=ingestor.view_exact if link is not None else None)

        pool = UpstreamPool(settings.connect_timeout_s, settings.request_timeout_s,
                            settings.worker_api_key,
                            {w.id: w.api_key for w in settings.workers if w.api_key is not None},
                            keepalive_s=settings.upstream_keepalive_s,
                            answer_max_bytes=settings.upstream_answer_max_bytes)
        await pool.start()
        models = await discover_models(settings, workers, pool)
        hasher = await warm_hasher(models, settings.block_size, settings.model_prompts)
        routing_config = RoutingConfig(
            policy=RoutingPolicy(settings.routing.policy),
            new_session_spread=settings.routing.new_session_spread,
            balance_floor_tokens=settings.routing.balance_floor_tokens)
        # Threads hash long prompts off the event loop (routing_service.py), serving the
        # tenants' queues in turn (hash_queue.py).
        hash_executor = FairHashQueue(settings.routing.hash_threads,
                                      settings.routing.hash_queue_per_tenant)
        routing = RoutingService(workers, metrics, routing_config, hasher,
                                 default_block_size=settings.block_size, index=index,
                                 seed=settings.routing.seed,
                                 default_model=next(iter(models), None),
                                 hash_executor=hash_executor,
                                 hash_thread_min_tokens=settings.routing.hash_thread_min_tokens,
                                 hash_inline_max_bytes=settings.routing.hash_inline_max_bytes,
                                 max_prompt_tokens=settings.routing.max_prompt_tokens)
        prober = HealthProber(workers, pool, settings.health_probe_s, metrics)
        forwarder = Forwarder(workers, routing, pool, lifecycle, metrics,
                              on_worker_down=prober.probe_later, recorder=recorder,
                              index_exact=ingestor.view_exact if link is not None else None,
                              max_event_bytes=settings.stream_event_max_bytes)
        runtime = cls(settings, directory, metrics, engine, writer, workers, sessions, hints,
                      lifecycle, routing, forwarder, pool, prober, index, ingestor, Timeline(),
                      TenantCallRate(directory, metrics), link=link, models=models,
                      recorder=recorder)
        # A background task that raised lost its work: counted as a periodic job's round.
        runtime.tasks.on_failed = lambda: metrics.drop("periodic_job_error")
        runtime.cancel_notices = CancelNotices(link, subjects, metrics, runtime.tasks)
        metrics.bind_state(runtime.state_sample)
        for tenant in directory.tenants:
            writer.upsert("tenants", (tenant.name,), {"name": tenant.name,
                                                      "cache_salt": tenant.cache_salt,
                                                      "created_at": time.time()})
        for worker in workers.all():
            writer.upsert("workers", (worker.worker_id,), {
                "worker_id": worker.worker_id, "url": worker.url,
                "from_config": worker.from_config})
        writer.start()
        if link is not None:
            runtime.feed = ClusterFeed(link, ingestor, workers, hints, metrics, writer,
                                       outcomes_last_seq=recovery.cursors.get(OUTCOMES_CURSOR),
                                       releases_last_seq=recovery.cursors.get(RELEASES_CURSOR),
                                       snapshot_timeout_s=5.0,
                                       on_hint_outcome=lifecycle.on_hint_outcome,
                                       on_hold_released=lifecycle.on_hold_released,
                                       on_worker_forgotten=routing.forget_worker,
                                       url_policy=url_policy, tasks=runtime.tasks)
            link.on_reconnected.append(runtime.feed.on_reconnected)
            link.start(runtime.feed.on_connected, runtime.cancel_notices.on_connected)
        runtime._loops = [
            asyncio.create_task(runtime._every(settings.hints.tick_s, lifecycle.tick),
                                name="kvhint-lifecycle"),
            asyncio.create_task(runtime._every(FEED_TICK_S, runtime._feed_tick),
                                name="kvhint-feed"),
            asyncio.create_task(runtime._every(TIMELINE_INTERVAL_S, runtime._sample),
                                name="kvhint-timeline"),
            asyncio.create_task(runtime._every(MODEL_DISCOVERY_S, runtime._discover),
                                name="kvhint-models"),
            asyncio.create_task(runtime._every(STORE_PRUNE_S, runtime._prune_store),
                                name="kvhint-store-retention"),
        ]
        if recorder is not None:
            runtime._loops.append(asyncio.create_task(
                runtime._every(TRACE_FLUSH_S, recorder.flush), name="kvhint-trace"))
        # What start-up built (transformers, tokenizers, torch's module graph: millions of
        # objects) lives as long as the process; left to the collector, every full
        # collection under load walks it again (measured: ~340 ms with the loop stopped).
        gc.collect()
        gc.freeze()
        log.info("router ready: %d workers, %d sessions and %d pending hints recovered, "
                 "models %s", len(workers.all()), restored, len(hints.pending),
                 sorted(models) or "(none: routing without prompt hashes)")
        return runtime

    async def stop(self) -> None:
        for task in self._loops:
            task.cancel()
        await asyncio.gather(*self._loops, return_exceptions=True)
        # Before the link and the pool they use; none starts after (task_set.py).
        await self.tasks.close()
        if self.cancel_notices is not None:  # those kept unsent, before the link's drain
            await self.cancel_notices.close()
        if self.recorder is not None:
            await self.recorder.close()
        if self.feed is not None:
            await self.feed.close()
        if self.link is not None:
            await self.link.close()
        await self.prober.close()
        await self.pool.close()
        if self.routing.hash_executor is not None:
            self.routing.hash_executor.shutdown(wait=False, cancel_futures=True)
        self.hints.save_learned(time.time())
        await self.writer.close()
        self.engine.dispose()

    # --- periodic work ------------------------------------------------------------------

    async def _every(self, period_s: float, work: Callable[[], Awaitable[None] | None]) -> None:
        while True:
            await asyncio.sleep(period_s)
            try:
                result = work()
                if result is not None:
                    await result
            except Exception:  # noqa: BLE001 - a periodic job must survive one bad round
                log.exception("periodic job %s failed", getattr(work, "__name__", work))
                self.metrics.drop("periodic_job_error")

    async def _prune_store(self) -> None:
        now = time.time()
        before = now - self.settings.store_retention_s
        # responses.session_retention_s, at most store_retention_s (prune takes the later).
        responses_before = now - self.settings.responses.session_retention_s
        pruned = await asyncio.to_thread(prune, self.engine, before, responses_before)
        # Their actions and feedback rows went with them: what memory keeps of them too.
        self.hints.workers_pruned(pruned.workers, self.settings.store_retention_s)
        for table, rows in pruned.deleted.items():
            if rows:
                self.metrics.store_pruned.labels(table).inc(rows)
        if any(pruned.deleted.values()):
            log.info("store retention: deleted %s", pruned.deleted)

    def _feed_tick(self) -> None:
        if self.feed is not None:
            self.feed.tick()

    async def _discover(self) -> None:
        """The workers' model lists, again (adapters load and unload at run time, workers
        join); and models no tokenizer is loaded for yet (a worker down at start, one
        that joined with another model) get theirs."""
        models = await discover_models(self.settings, self.workers, self.pool)
        new = {name: path for name, path in models.items() if name not in self.models}
        if new:
            self.models = {**self.models, **new}
            self.routing.hasher = await warm_hasher(self.models, self.settings.block_size,
                                                     self.settings.model_prompts)
            if self.routing.default_model is None:
                self.routing.default_model = next(iter(self.models))
            log.info("models discovered: %s", sorted(new))

    def _sample(self) -> None:
        self.timeline.sample(time.time(), self.metrics.totals, self.hints.status_counts)

    # --- views --------------------------------------------------------------------------

    def state_sample(self) -> StateSample:
        by_tier: dict[tuple[str, str], int] = {}
        for worker_id in self.index.worker_ids():
            for tier, count in self.index.worker_block_counts(worker_id).items():
                by_tier[(worker_id, tier)] = count
        stats = self.index.stats()
        return StateSample(
            index_blocks_by_worker_tier=by_tier,
            index_distinct_blocks=stats.distinct_blocks,
            sessions_by_state=self.sessions.counts_by_state(),
            workers_up={w.worker_id: (w.http_up, w.plugin_alive) for w in self.workers.all()},
            worker_inflight={w.worker_id: w.inflight for w in self.workers.all()},
            worker_id_conflicts=self.ingestor.conflicting_workers(),
            pending_hints=len(self.hints.pending),
            store_queue=self.writer.queued,
            ingest=_ingest_counters(self.ingestor, stats),
            completion_read_probability={
                tenant: self.hints.stats_of(tenant).completion_read_probability()
                for tenant in self.hints.tenants},
        )


# The cluster index's own counters (IndexStats), exported as index_<name>: what its bounds
# dropped (sessions evicted past MAX_SESSIONS_IN_MEMORY, a session's frontiers past its
# cap) and the events it found nothing to do for (a block stored twice, one removed that
# it did not hold).
_INDEX_COUNTERS = ("stored_blocks", "removed_blocks", "duplicate_stores", "missing_removes",
                   "cleared_workers", "purged_workers", "snapshots_loaded",
                   "sessions_evicted", "frontiers_dropped", "repeat_stores", "repeat_removes")


def _restore_workers(workers: WorkerRegistry, rows: list[dict[str, Any]], now: float,
                     forget_s: float, writer: StoreWriter,
                     url_policy: HeartbeatUrlPolicy = HeartbeatUrlPolicy()) -> None:
    """Add to ``workers`` (the configured ones) the stored workers that come back, and
    queue the deletion of the stored row of every worker it does not hold then.

    Workers learned from heartbeats and heard within the last ``forget_s`` (wall clock)
    come back; ones dropped from the config, or long gone (a pod deleted last week would
    be routed to, retried and probed forever), do not, and their rows go (as their
    feedback rows do, HintDispatcher.restore): before, a configured worker's row stayed
    for good (retention prunes only heartbeat-learned ones). A live one that was silent
    longer is back, and its row written again, at its next heartbeat. One whose stored
    URL ``url_policy`` refuses now (heartbeat_worker_hosts narrowed since) does not: its
    next heartbeat is judged again."""
    for row in rows:
        heard = row.get("last_seen") or 0.0
        if not row.get("from_config") and row["worker_id"] not in workers \
                and row.get("url") and now - heard <= forget_s \
                and url_policy.refusal(row["url"]) is None:
            workers.ensure(row["worker_id"], row["url"])
        # The engine epoch last seen: a first heartbeat from another one says the engine
        # restarted while the router was down (what it held, restored, is gone).
        if (worker := workers.get(row["worker_id"])) is not None:
            if worker.epoch is None:
                worker.epoch = row.get("epoch")
        else:
            writer.delete("workers", (row["worker_id"],))


def _ingest_counters(ingestor: KvEventIngestor, index: IndexStats) -> dict[str, int]:
    stats = ingestor.stats()
    counters: dict[str, int] = {f"stream_{k}": v for k, v in stats.stream.items()}
    counters.update({f"adapter_{k}": v for k, v in stats.adapter.items()})
    counters["malformed_messages"] = stats.malformed_messages
    counters["subject_mismatches"] = stats.subject_mismatches
    counters["unknown_worker_pages"] = stats.unknown_worker_pages
    counters.update({f"index_{name}": getattr(index, name) for name in _INDEX_COUNTERS})
    return counters


def _announce(settings: RouterSettings, directory: TenantDirectory) -> None:
    if directory.dev_mode:
        banner = "!" * 78
        log.warning(banner)
        log.warning("DEV MODE: no API key configured. Every request is tenant 'default' and "
                    "the admin and hint endpoints are OPEN to anyone who can reach this port.")
        log.warning("Configure tenants[].api_keys and admin_keys for anything but a laptop.")
        log.warning(banner)
    elif (settings.salt_secret == DEFAULT_SALT_SECRET
          and any(t.cache_salt is None for t in settings.tenants)):
        log.warning("salt_secret is the published default: every tenant's derived "
                    "cache_salt can be computed by anyone who knows its name; set "
                    "KVHINT_ROUTER_SALT_SECRET to a secret of your own")
    if not settings.nats_url:
        log.warning("no NATS URL: no cluster KV index and no hints; routing by load and "
                    "session affinity only")
    if not settings.workers:
        log.warning("no workers configured: waiting for heartbeats that carry an http_url")


def _refreshes_sessions(setting: bool | None, engine: Engine) -> bool:
    """``routing.session_refresh``; unset: on for a PostgreSQL store (the store router
    replicas share), off for a SQLite file (one router's own: no other replica saves its
    sessions, so a read before each turn would find only its own saves)."""
    return engine.dialect.name == "postgresql" if setting is None else setting
