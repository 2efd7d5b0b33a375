"""The one place that touches vLLM internals (KVCacheManager, BlockPool, Request, events,
connectors): :mod:`.cache` (the block cache port and the tees; :mod:`.free_queue`, where
it moves blocks in vLLM's free queue; :mod:`.event_translation`, vLLM's KV events read
into the session index's), :mod:`.offloading` (the host tier over vLLM's
OffloadingConnector), :mod:`.connector_reset` (what the plugin
publishes when vLLM's connector reset empties that host tier, which vLLM announces with no
event), :mod:`.engine` (wake-up, registration, role, event encoding), :mod:`.data_parallel`
(which data-parallel rank an EngineCore is, read from its config at bind time).

Everything here runs on the scheduler thread, apart from the registration (every vLLM
process) and the encoder (the NATS thread). It detects features instead of checking
versions: every attribute it relies on is looked up once in :meth:`VllmCacheAdapter.check`
and a missing one stops start-up with its name.

What it does to the engine (all reversible, nothing patched at class level):
- tees ``kv_cache_manager.take_events()`` so the plugin sees every KV event the scheduler
  drains (the list is returned unchanged, so vLLM's own publisher sees the same events);
- wraps ``kv_cache_manager.reset_prefix_cache()`` so the plugin's held blocks are released
  first when that is what stands between vLLM and a successful reset, and notes whether
  the reset succeeded (the connector's ``reset_cache``, which vLLM calls next when it
  resets the connectors too, publishes the host tier's reset accordingly);
- wraps ``kv_cache_manager.allocate_slots()``: when vLLM cannot allocate, retained (soft)
  blocks are released, lowest priority first, and the allocation is retried, so a retain
  never causes a preemption or a failed admission that plain vLLM would not have. A
  successful allocation also reports the request's local prefix hit
  (``num_new_computed_tokens``: vLLM emits no BlockStored for reused blocks) and maps its
  new block hashes;
- wraps ``kv_cache_manager.free()`` to map a finished request's last hashes and forget the
  ones that were never cached, and ``pop_blocks_for_free()`` (where vLLM has it) the same
  way: with ``Scheduler.defer_block_free`` (several batches in flight and a KV-consumer
  connector beside the plugin) vLLM frees a request through it, not ``free()``;
- turns on the block pool's KV events when the operator did not (``--kv-events-config``
  absent): vLLM then drains them every step into its null publisher;
- with vLLM's OffloadingConnector beside the plugin (:class:`OffloadingHostTier`): reads
  and refreshes its manager's host copies for Demote and Prefetch, and tees the
  connector's ``take_events()`` the same way as the cache manager's.

The plugin's kv_role (``config.KV_ROLE``, "kv_producer"). It loads no KV, and vLLM 0.32
reads a consumer role (``kv_consumer``, ``kv_both``) as "may load KV into blocks as soon
as they are allocated": with overlapping batches (async scheduling, the CUDA default, or
pipeline parallelism) ``Scheduler.defer_block_free`` then returns a freed request's blocks
to the pool only once the step in flight ends (and ``reset_prefix_cache
(reset_running_requests=True)``, which pause/sleep call, raises while one is in flight);
a multimodal model also starts accepting pre-computed embedding inputs
(``allow_missing_mm_embeddings``), and a consumer-only gauge is registered. The producer
side is the same for both roles (``finalize_partial_tail_offloads`` for Mamba align
caches, the connector's ``requires_kv_delivery`` default, which the plugin overrides to
False: it hands no KV off, so a preempted request's in-flight output is kept as plain
vLLM keeps it). Deployed as ``kv_both`` anyway, or beside vLLM's OffloadingConnector
(which is a consumer), the deferred frees go through ``pop_blocks_for_free()``, wrapped
below, so the plugin's per-request state still ends with the request.

The pool is keyed by sha256 digests (bytes) while events and hints use the low 64 bits as
an int; the int -> digest map is learnt from ``request.block_hashes`` (incrementally, at
each allocation) and pruned when a hash leaves the cache, or its request goes without
caching it, once no live request has it mapped (each mapped hash counts the live
requests that mapped it: a request maps its whole prompt at its first allocation and
may cache those blocks steps later). It therefore works the same
under vLLM's scheduler and under the simulator, which drives the manager directly.
"""

from kvhint.engine_plugin.vllm_adapter.cache import (
    U64_MASK,
    VllmCacheAdapter,
    VllmFeatureMissing,
    digest_to_int,
)
from kvhint.engine_plugin.vllm_adapter.connector_reset import HostTierReset
from kvhint.engine_plugin.vllm_adapter.engine import (
    EventBatchEncoder,
    consumer_role_of,
    find_engine_waker,
    none_hash_seed,
    register_connector_name,
)
from kvhint.engine_plugin.vllm_adapter.offloading import OffloadingHostTier

__all__ = [
    "U64_MASK",
    "EventBatchEncoder",
    "HostTierReset",
    "OffloadingHostTier",
    "VllmCacheAdapter",
    "VllmFeatureMissing",
    "consumer_role_of",
    "digest_to_int",
    "find_engine_waker",
    "none_hash_seed",
    "register_connector_name",
]
