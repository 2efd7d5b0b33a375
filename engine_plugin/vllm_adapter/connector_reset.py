"""HostTierReset: the events that tell the plugin's stream that vLLM's connector reset
dropped the host tier.

vLLM's ``Scheduler.reset_prefix_cache(reset_connector=True)`` first resets the GPU prefix
cache (``KVCacheManager.reset_prefix_cache``: the pool queues an ``AllBlocksCleared`` when
it succeeds, nothing when blocks are still in use), then, whatever that returned, each
connector's cache (``reset_connector_cache`` -> ``MultiConnector.reset_cache`` -> every
child's ``reset_cache``). The OffloadingConnector's reset empties its CPU tier and
announces nothing (``CPUOffloadingManager.reset_cache`` queues no event), so without these
events the plugin's index and every router reading its stream keep that tier: false hits.

vLLM's ``AllBlocksCleared`` names no medium; the router (and the plugin's own index, see
``VllmCacheAdapter.index_events``) reads the first of a run of clears in one batch as the
GPU tier's and each further one as the CPU tier's. So:

- the GPU reset succeeded: a batch of two clears. Its first clears the GPU tier, which
  vLLM emptied just before in the same call (its own clear is still queued and follows in
  the next drained batch, after which the GPU view is the same either way); the second
  clears the CPU tier.
- the GPU reset failed (``reset_running_requests=False`` with requests holding blocks, e.g.
  ``POST /reset_prefix_cache?reset_external=true`` under load; vLLM still resets the
  connectors): two clears would make the router drop its whole view of the GPU tier, which
  vLLM kept (false misses for every cached prefix of the worker until it is stored again,
  and its later removals counted missing). Instead one ``BlockRemoved`` (medium CPU) names
  every host copy the plugin tracks, each hash once per copy, which is exactly the
  router's references (the plugin's index and the router apply the same stream). A batch
  too large for the event buffer is dropped, counted, and the router resyncs from a
  snapshot of the plugin's (already corrected) index.

Events of the host tier still queued in the connector at the reset (evictions a
``schedule()`` queued that no step drained yet) reach the stream after this batch: each
is then a removal of an unknown block, counted on both sides, never a false hit. Its
stores are queued when the worker reports a copy done, and drained in that same step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class HostTierReset:
    """Builds the vLLM events for a connector reset (module docstring). The classes are
    looked up once, at bind time."""

    def __init__(self, group: int = 0) -> None:
        from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved

        self._cleared = AllBlocksCleared
        self._removed = BlockRemoved
        # The KV-cache group the stream follows (``VllmCacheAdapter.event_group``): a
        # removal of another group's (group 0's, a hybrid model's window group) would be
        # dropped by the plugin's index and every router.
        self._group = group

    def events(self, gpu_reset: bool | None, host_copies: Sequence[int],
               medium: str) -> list[Any]:
        """The events to publish for a connector reset that emptied ``medium``:
        ``gpu_reset`` is whether vLLM's GPU reset of the same call succeeded (None: the
        plugin saw none, read as failed), ``host_copies`` the hashes the plugin's index
        holds in ``medium``, each once per copy."""
        if gpu_reset:
            return [self._cleared(), self._cleared()]
        if not host_copies:
            return []
        return [self._removed(block_hashes=list(host_copies), medium=medium,
                              group_idx=self._group)]
