"""KvHintConnector: the engine plugin as a vLLM KV connector.

Load it with::

    --enable-prefix-caching --kv-transfer-config '{"kv_connector": "KvHintConnector",
      "kv_connector_module_path": "kvhint.engine_plugin.connector", "kv_role": "kv_producer",
      "kv_connector_extra_config": {"worker_id": "w0", "nats_url": "nats://127.0.0.1:4222"}}'

``kv_role`` is ``kv_producer`` (:data:`~kvhint.engine_plugin.config.KV_ROLE`): the plugin
loads no KV, and a consumer role (``kv_both``) makes vLLM hold freed blocks back while a
step is in flight; the :mod:`~kvhint.engine_plugin.vllm_adapter` docstring says what else
it changes. ``kv_both`` still works; the plugin says so in its log.

Only the SCHEDULER-role instance (in EngineCore, one per data-parallel rank) does
anything: it binds :class:`~kvhint.engine_plugin.core.PluginCore` to the KVCacheManager,
forwards vLLM's hooks to it, and runs the NATS transport in its own thread. Each rank of
``--data-parallel-size N`` is a worker of its own, ``<worker_id>-dp<rank>``
(:meth:`~kvhint.engine_plugin.config.PluginConfig.resolved_worker_id`), whose heartbeat
names the ``X-data-parallel-rank`` that reaches it (``WorkerStatus.http_dp_rank``). The
WORKER-role instance moves no data and is a no-op.

Host tier (Demote): configure vLLM's OffloadingConnector beside the plugin (CUDA only)::

    --kv-transfer-config '{"kv_connector": "MultiConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"connectors": [
        {"kv_connector": "KvHintConnector", "kv_role": "kv_producer",
         "kv_connector_module_path": "kvhint.engine_plugin.connector",
         "kv_connector_extra_config": {"worker_id": "w0", "nats_url": "..."}},
        {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
         "kv_connector_extra_config": {"cpu_bytes_to_use": 8000000000}}]}}'

The plugin finds it at bind time (:class:`~kvhint.engine_plugin.vllm_adapter.OffloadingHostTier`)
and says in its log which host tier it uses, or why none.

A hook never lets a plugin error escape into the scheduler (``PluginCore.guard``): it is
logged with its traceback once per hook, counted (``kvhint:internal_errors``), and the
engine goes on as plain vLLM would.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Mapping
from typing import Any

import msgspec
from msgspec import UNSET

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

from kvhint.engine_plugin.config import (
    KV_ROLE,
    LOGGER_NAME,
    PluginConfig,
    check_plugin_config_early,
    load_plugin_config,
)
from kvhint.engine_plugin.core import CoreCounters, EngineIdentity, PluginCore
from kvhint.engine_plugin.counter_exports import read_counters
from kvhint.engine_plugin.executor import ExecutorCounters
from kvhint.engine_plugin.hold_records import HoldCounters
from kvhint.engine_plugin.host_tier import HostTier
from kvhint.engine_plugin.mailbox import Mailbox, MailboxCounters
from kvhint.engine_plugin.metrics import (
    HINTS_KEY,
    LATENCY_KEY,
    KvHintConnectorStats,
    KvHintPromMetrics,
    StatsTracker,
    hint_counts_by_label,
)
from kvhint.engine_plugin.session_index import IndexCounters
from kvhint.engine_plugin.transport import NatsTransport
from kvhint.engine_plugin.transport_counters import TransportCounters
from kvhint.engine_plugin.vllm_adapter import (
    EventBatchEncoder,
    HostTierReset,
    OffloadingHostTier,
    VllmCacheAdapter,
    consumer_role_of,
    find_engine_waker,
    none_hash_seed,
    register_connector_name,
)
from kvhint.engine_plugin.vllm_adapter.data_parallel import data_parallel_place
from kvhint.schemas import Usage, WorkerStatus
from kvhint.schemas.nats_address import loggable_nats_url

logger = logging.getLogger(LOGGER_NAME)


class KvHintConnectorMetadata(KVConnectorMetadata):
    """Nothing travels to the workers: the plugin moves no KV data."""


class KvHintConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config: Any, role: KVConnectorRole,
                 kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        # Validated in every role, so a bad value stops start-up wherever it is read.
        self.plugin_config: PluginConfig = load_plugin_config(
            self._kv_transfer_config.kv_connector_extra_config)
        self.core: PluginCore | None = None
        self.transport: NatsTransport | None = None
        self._stats = StatsTracker(self._read_stats)
        # The KV event batches the index had taken when the figures were last read.
        self._event_batches_read = 0
        self._waker = None
        self._host_tier: OffloadingHostTier | None = None
        self._host_reset: HostTierReset | None = None  # with a host tier (bind time)
        # What the heartbeat says reaches this engine through its API server (bind time).
        self._http_dp_rank: int | None = None
        if role == KVConnectorRole.SCHEDULER:
            # Only while EngineCore is being built is it on the call stack.
            self._waker = find_engine_waker() if self.plugin_config.wake_idle_engine else None
            if consumer_role := consumer_role_of(vllm_config, type(self).__name__):
                logger.warning(
                    "kvhint: kv_role %r makes vLLM treat the plugin as a KV consumer (with "
                    "async scheduling it holds freed blocks back while a step is in flight, "
                    "and a cache reset of running requests then fails); the plugin loads "
                    "no KV: load it with kv_role %r", consumer_role, KV_ROLE)

    @property
    def requires_kv_delivery(self) -> bool:
        """The plugin hands no KV off (vLLM defaults this to the producer role): a request
        preempted with output in flight keeps it, as in plain vLLM."""
        return False

    @property
    def host_tier(self) -> OffloadingHostTier | None:
        """vLLM's OffloadingConnector as the plugin found it at bind time (None: none)."""
        return self._host_tier

    # --- binding ---------------------------------------------------------------------------

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        if self.core is not None:
            return
        config = self.plugin_config
        # Each DP rank is an EngineCore of its own with its own cache: its own worker id,
        # and the X-data-parallel-rank header the router sends to reach it (heartbeat).
        place = data_parallel_place(self._vllm_config)
        rank = place.rank
        self._http_dp_rank = place.http_rank
        model_config = self._vllm_config.model_config
        hash_algo = str(self._vllm_config.cache_config.prefix_caching_hash_algo)
        identity = EngineIdentity(
            worker_id=config.resolved_worker_id(rank, place.several),
            model=str(getattr(model_config, "served_model_name", None) or model_config.model),
            hash_algo=hash_algo, none_hash_seed=none_hash_seed(hash_algo),
            data_parallel_rank=rank)
        if place.several:
            logger.info("kvhint: data-parallel rank %d (%s): worker id %s (configured %s), "
                        "reached with X-data-parallel-rank %s", rank, place.how,
                        identity.worker_id, config.worker_id,
                        "not needed" if place.http_rank is None else place.http_rank)
        else:
            logger.info("kvhint: worker id %s", identity.worker_id)
        mailbox = None
        if config.nats_url:
            mailbox = Mailbox(config.inbound_buffer, config.outcome_buffer,
                              config.event_buffer_batches,
                              answered_limit=config.max_remembered_actions)
            if self._waker is not None:
                mailbox.wake_engine = self._waker
        self.core = PluginCore.attach(kv_cache_manager, config, identity=identity,
                                      mailbox=mailbox, find_host_tier=self._find_host_tier)
        if self._host_tier is not None:
            self._host_tier.tee_events(self.core.guarded("take_events",
                                                         self.core.on_engine_events))
            self._host_reset = HostTierReset(self.core.adapter.event_group)
        self.core.refresh_status()
        if not self.core.adapter.prefix_caching:
            logger.warning("kvhint: vLLM runs without prefix caching: nothing is cached, so "
                           "the plugin indexes no blocks, advertises no actions and answers "
                           "every hint rejected; start vLLM with --enable-prefix-caching "
                           "(worker %s)", identity.worker_id)
        if mailbox is None:
            logger.info("kvhint: no nats_url in kv_connector_extra_config: the session index "
                        "and metrics run, no hints are received and nothing is published "
                        "(worker %s)", identity.worker_id)
            return
        if self._waker is None:
            logger.warning("kvhint: found no EngineCore busy loop to wake; a hint that "
                           "arrives while the engine is idle waits for its next step")
        encoder = EventBatchEncoder()
        self.transport = NatsTransport(
            config, identity.worker_id, identity.epoch, mailbox, self._status_of,
            lambda ts, events: encoder.encode(ts, events, rank), self.core.adapter.block_size,
            self.core.adapter.event_group)
        self.transport.start()
        logger.info("kvhint: engine plugin up: worker %s, epoch %s, NATS %s, prefix %s",
                    identity.worker_id, identity.epoch, loggable_nats_url(config.nats_url),
                    config.subject_prefix)
        if config.worker_id_defaulted:
            logger.warning("kvhint: no worker_id in kv_connector_extra_config: this engine "
                           "publishes as %s, the default w<data-parallel rank> that every "
                           "other server without one uses too; the router follows one "
                           "engine per worker id and refuses the others': set "
                           "kv_connector_extra_config['worker_id'] to a name of this "
                           "server's own", identity.worker_id)
        if config.credentials_in_transfer_config:
            logger.warning("kvhint: nats_url carries credentials, and vLLM logs "
                           "--kv-transfer-config at start-up: give the URL in an environment "
                           "variable named by nats_url_env instead")

    def _find_host_tier(self, adapter: VllmCacheAdapter) -> HostTier | None:
        tier, source = OffloadingHostTier.find(self, adapter)
        self._host_tier = tier
        if tier is None:
            logger.info("kvhint: no host tier (%s): Demote and Share are answered rejected",
                        source)
        else:
            logger.info("kvhint: host tier: vLLM's %s beside the plugin (KV-cache groups %s); "
                        "Demote is on", source, list(tier.group_ids))
        return tier

    def _status_of(self, usage: Usage | None, seq: int) -> WorkerStatus:
        assert self.core is not None
        status = self.core.worker_status(usage=usage)
        # Without a header to send the field stays off the wire (an older router's form).
        http_dp_rank = UNSET if self._http_dp_rank is None else self._http_dp_rank
        return msgspec.structs.replace(status, last_event_seq=seq, http_dp_rank=http_dp_rank)

    # --- scheduler hooks ---------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        return 0, False  # no external KV: prefix hits are observed in allocate_slots

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        return None

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        if self.core is not None:
            self.core.guard("build_connector_meta", self.core.pump)
        return KvHintConnectorMetadata()

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict | None]:
        return False, None  # never delays the free: the plugin moves no data

    def request_finished_all_groups(self, request: Any,
                                    block_ids: Any) -> tuple[bool, dict | None]:
        return self.request_finished(request, block_ids)

    def has_pending_push_work(self) -> bool:
        if self.core is None:
            return False
        if self._stats.flush_due():
            return True  # one step ships the figures an idle engine still holds
        return bool(self.core.guard("has_pending_push_work", self._has_pending_work))

    def _has_pending_work(self) -> bool:
        core = self.core
        assert core is not None
        return core.has_pending_work() or (self._engine_idle() and self._stats_unsent())

    def _engine_idle(self) -> bool:
        """No request holds blocks: a step now only serves the plugin."""
        assert self.core is not None
        return self.core.adapter.num_live_requests == 0

    def _stats_unsent(self) -> bool:
        """Whether /metrics lacks a change: one the interval held back, the KV events of
        the last step (vLLM reads connector stats before it drains a step's events, so
        the last step's reach the index after its reading), or one of the transport's.
        An engine going idle runs one more step to ship them (read at once: idle); before,
        the figures stayed a step behind until the next request, with NATS down or absent
        for good."""
        core = self.core
        assert core is not None
        mailbox = core.mailbox
        return (self._stats.flush_at is not None
                or core.counters.event_batches != self._event_batches_read
                or (mailbox is not None and mailbox.stats_changed))

    def take_events(self) -> tuple[()]:
        return ()  # the plugin adds no events of its own to vLLM's stream

    def reset_cache(self) -> bool | None:
        """vLLM resets its connectors' caches (``reset_prefix_cache(reset_connector=True)``,
        e.g. ``POST /reset_prefix_cache?reset_external=true``, or a pause that clears the
        cache): the OffloadingConnector beside the plugin empties its host tier without an
        event. The plugin drops that tier from its index and publishes the reset to the
        router (:mod:`~kvhint.engine_plugin.vllm_adapter.connector_reset`), in order with
        the batches before it.

        Returns True once done; None with no host tier (nothing of the plugin's to reset)
        or when the plugin failed on it (logged once, counted in internal_errors). Never
        False: vLLM reads it as a failed reset, and a pause that clears the cache then
        raises (``EngineCore._reset_caches``), which plain vLLM would not."""
        core, reset = self.core, self._host_reset
        if core is None or reset is None:
            return None
        return core.guard("reset_cache", core.on_host_tier_reset, reset.events)

    def get_kv_connector_stats(self) -> KvHintConnectorStats | None:
        if self.core is None:
            return None
        # Idle, a reading waits for no interval: nothing else is left to ship it.
        stats = self.core.guard("get_kv_connector_stats",
                                lambda: self._stats.take(force=self._engine_idle()))
        mailbox = self.core.mailbox
        if mailbox is not None:  # the transport wakes an idle engine when it falls due
            flush_at = self._stats.flush_at
            mailbox.stats_flush_at = (
                None if flush_at is None else time.time() + flush_at - time.monotonic())
        return stats

    def shutdown(self) -> None:
        if self.transport is not None:
            self.transport.stop()
            self.transport = None
        if self._host_tier is not None:
            self._host_tier.untee_events()
        if self.core is not None:
            self.core.detach()

    def _read_stats(self) -> dict[str, Any]:
        core = self.core
        assert core is not None
        ex, cc, holds = core.executor.counters, core.counters, core.executor.holds.counters
        mailbox = core.mailbox
        if mailbox is not None:  # before reading: a change after it stays noted
            mailbox.stats_changed = False
        self._event_batches_read = cc.event_batches
        tc = self.transport.counters if self.transport is not None else None
        latencies, cc.apply_latencies_s = cc.apply_latencies_s, []
        # Every exported counter, from the table that a test holds to the dataclasses.
        out = read_counters({
            CoreCounters: cc, ExecutorCounters: ex, HoldCounters: holds,
            IndexCounters: core.index.counters,
            MailboxCounters: mailbox.counters if mailbox else None, TransportCounters: tc})
        out.update({
            "pinned_blocks": core.executor.pinned_blocks,
            "retained_blocks": core.executor.retained_blocks,
            "index_blocks": len(core.index),
            "index_sessions": core.index.num_sessions,
            "nats_connected": int(self.transport is not None and self.transport.connected),
            "events_kept": int(self.transport is not None and self.transport.events_kept),
            HINTS_KEY: _hint_counts(ex.outcomes, tc, mailbox),
            LATENCY_KEY: latencies,
        })
        return out

    # --- vLLM's config (front-end process, before any engine starts) -------------------------

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """False: the plugin runs nothing in the forward pass.

        vLLM asks this while it builds its config (``VllmConfig.__post_init__``, in the
        API-server process, before any engine starts; a MultiConnector asks each child
        with its own extra config) on a platform with CUDA graphs whose mode has full
        ones: CUDA's default, not CPU, ``--enforce-eager`` or a piecewise-only mode. The
        plugin checks its config there (:func:`check_plugin_config_early`), so a bad value
        stops ``vllm serve`` at once rather than after the model has loaded. The
        constructor checks it again, in every case."""
        check_plugin_config_early(extra_config)
        return False

    # --- vLLM's metrics plumbing (front-end process) --------------------------------------------

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None
                                 ) -> KvHintConnectorStats | None:
        return KvHintConnectorStats(data=dict(data)) if data is not None else KvHintConnectorStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: Any, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KvHintPromMetrics:
        return KvHintPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # --- worker side: no data moves ----------------------------------------------------------

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        return None


# The entry point (vllm_plugin.register) does this in every vLLM process when kvhint is
# installed; importing the module by path (vLLM does, wherever it builds the connector
# or its metrics) covers a plugin that is only on PYTHONPATH.
register_connector_name(KvHintConnector.__name__, __name__)


def _hint_counts(executor_outcomes: Mapping[tuple[str, str], int],
                 transport: TransportCounters | None, mailbox: Mailbox | None
                 ) -> dict[str, int]:
    """``kvhint:hints_total`` by "<action type>|<status>": the executor's outcomes and
    the ones the transport answered itself (inbox full, engine busy)."""
    counts = Counter(executor_outcomes)
    if transport is not None and mailbox is not None:
        counts.update(transport.outcomes_seen(mailbox.lock))
    return hint_counts_by_label(counts)  # action types from the wire: bounded labels
