"""The one place that touches vLLM internals (KVCacheManager, BlockPool, Request, events,
connectors): :mod:`.cache` (the block cache port and the tees), :mod:`.offloading` (the
host tier over vLLM's OffloadingConnector), :mod:`.engine` (wake-up, registration, event
encoding).

Everything here runs on the scheduler thread, apart from the registration (every vLLM
process) and the encoder (the NATS thread). It detects features instead of checking
versions: every attribute it relies on is looked up once in :meth:`VllmCacheAdapter.check`
and a missing one stops start-up with its name.

What it does to the engine (all reversible, nothing patched at class level):
- tees ``kv_cache_manager.take_events()`` so the plugin sees every KV event the scheduler
  drains (the list is returned unchanged, so vLLM's own publisher sees the same events);
- wraps ``kv_cache_manager.reset_prefix_cache()`` so the plugin's held blocks are released
  first when that is what stands between vLLM and a successful reset;
- wraps ``kv_cache_manager.allocate_slots()``: when vLLM cannot allocate, retained (soft)
  blocks are released, lowest priority first, and the allocation is retried, so a retain
  never causes a preemption or a failed admission that plain vLLM would not have. A
  successful allocation also reports the request's local prefix hit
  (``num_new_computed_tokens``: vLLM emits no BlockStored for reused blocks) and maps its
  new block hashes;
- wraps ``kv_cache_manager.free()`` to map a finished request's last hashes and forget the
  ones that were never cached;
- turns on the block pool's KV events when the operator did not (``--kv-events-config``
  absent): vLLM then drains them every step into its null publisher;
- with vLLM's OffloadingConnector beside the plugin (:class:`OffloadingHostTier`): reads
  and refreshes its manager's host copies for Demote and Prefetch, and tees the
  connector's ``take_events()`` the same way as the cache manager's.

The pool is keyed by sha256 digests (bytes) while events and hints use the low 64 bits as
an int; the int -> digest map is learnt from ``request.block_hashes`` (incrementally, at
each allocation) and pruned when a hash leaves the cache. It therefore works the same
under vLLM's scheduler and under the simulator, which drives the manager directly.
"""

from kvhint.engine_plugin.vllm_adapter.cache import (
    U64_MASK,
    VllmCacheAdapter,
    VllmFeatureMissing,
    digest_to_int,
)
from kvhint.engine_plugin.vllm_adapter.engine import (
    EventBatchEncoder,
    find_engine_waker,
    none_hash_seed,
    register_connector_name,
)
from kvhint.engine_plugin.vllm_adapter.offloading import OffloadingHostTier

__all__ = [
    "U64_MASK",
    "EventBatchEncoder",
    "OffloadingHostTier",
    "VllmCacheAdapter",
    "VllmFeatureMissing",
    "digest_to_int",
    "find_engine_waker",
    "none_hash_seed",
    "register_connector_name",
]
