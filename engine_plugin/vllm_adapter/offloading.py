"""OffloadingHostTier: the host tier port over vLLM's OffloadingConnector (CUDA servers)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from kvhint.engine_plugin.vllm_adapter.cache import VllmCacheAdapter
from kvhint.engine_plugin.vllm_adapter.engine import find_on_stack


class OffloadingHostTier:
    """The executor's HostTier port over vLLM's OffloadingConnector running beside the
    plugin (``MultiConnector``; CUDA servers).

    vLLM's connector stores every block a request computes: its scheduler side
    (``OffloadingConnectorScheduler``) issues the store jobs, its worker copies with CUDA,
    and its manager marks a copy ready when the worker reports it done. This tier issues no
    copies of its own. ``keep`` refreshes the finished copies (``touch``: most recently used
    in the host's eviction policy, so they outlive the GPU copies the executor lets go
    first) and reports which blocks have one; a block whose copy is missing or in flight
    is left out, and the executor keeps it in G1.

    Keys: the offload key is the block's full hash plus its KV-cache group
    (``make_offload_key``); the plugin's 64-bit hashes map to full hashes through the cache
    adapter. A block has a host copy when every offloaded full-attention group has one.
    """

    def __init__(self, connector: Any, manager: Any, group_ids: tuple[int, ...],
                 digest_of: Callable[[int], bytes | None]) -> None:
        from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key

        self.connector = connector
        self.manager = manager
        self.group_ids = group_ids
        self._digest_of = digest_of
        self._make_key = make_offload_key
        self._ready = LookupResult.HIT
        self._pending = LookupResult.HIT_PENDING
        # lookup() and touch() record nothing on the context; one serves every call.
        self._context = ReqContext(req_id="kvhint-host-tier")

    @classmethod
    def find(cls, connector: Any, adapter: VllmCacheAdapter
             ) -> tuple[OffloadingHostTier | None, str]:
        """The OffloadingConnector configured beside ``connector``, as a host tier, or
        None and why not. Must run inside ``bind_kv_cache_manager``: the MultiConnector
        that holds both is found on the call stack (a sub-connector has no link to it)."""
        multi = find_on_stack(lambda owner: owner is not connector and isinstance(
            getattr(owner, "sub_connectors", None), list) and connector in owner.sub_connectors)
        siblings = [c for c in multi.sub_connectors if c is not connector] if multi else []
        for sibling in siblings:
            scheduler = getattr(sibling, "connector_scheduler", None)
            manager = getattr(scheduler, "manager", None)
            config = getattr(scheduler, "config", None)
            if not all(hasattr(manager, a) for a in ("lookup", "touch")) or \
                    not hasattr(config, "kv_group_configs"):
                continue
            name = type(sibling).__name__
            full = set(adapter.full_attention_group_ids)
            groups = [g for g in config.kv_group_configs if g.group_idx in full]
            if not groups:
                return None, f"{name} offloads none of the full-attention KV-cache groups"
            if not adapter.blocks_are_hash_blocks or \
                    any(getattr(g, "hashes_per_chunk", None) != 1 for g in groups):
                return None, (f"{name} stores chunks of several blocks (blocks_per_chunk or "
                              "a hash block size below the block size); the plugin maps "
                              "one block to one host chunk")
            return cls(sibling, manager, tuple(g.group_idx for g in groups),
                       adapter.digest), name
        return None, "no KV connector with an offloading manager runs beside the plugin"

    def tee_events(self, on_events: Callable[[list[Any]], None]) -> None:
        """Show the plugin the host tier's KV events (BlockStored / BlockRemoved with medium
        ``CPU``) as the scheduler drains them, so the session index knows what G2 holds
        and the router hears it. The events go on to vLLM unchanged. vLLM's offloading
        manager emits them only with ``--kv-events-config`` (any publisher, ``null`` too)."""
        drain = self.connector.take_events

        def tee_take_events() -> list[Any]:
            events = list(drain())
            if events:
                on_events(events)
            return events

        self.connector.take_events = tee_take_events

    def untee_events(self) -> None:
        self.connector.__dict__.pop("take_events", None)

    def _keys(self, block_hash: int) -> list[Any] | None:
        digest = self._digest_of(block_hash)
        if digest is None:
            return None
        return [self._make_key(digest, group) for group in self.group_ids]

    def _ready_keys(self, block_hash: int) -> list[Any] | None:
        """The block's offload keys when every one has a finished copy, else None."""
        keys = self._keys(block_hash)
        if keys is None or any(self.manager.lookup(key, self._context) is not self._ready
                               for key in keys):
            return None
        return keys

    def contains(self, block_hash: int) -> bool:
        return self._ready_keys(block_hash) is not None

    def copying(self, block_hash: int) -> bool:
        keys = self._keys(block_hash)
        return keys is not None and any(
            self.manager.lookup(key, self._context) is self._pending for key in keys)

    def keep(self, block_hashes: Sequence[int]) -> frozenset[int]:
        kept: list[int] = []
        keys: list[Any] = []
        for block_hash in block_hashes:
            ready = self._ready_keys(block_hash)
            if ready is not None:
                kept.append(block_hash)
                keys.extend(ready)
        if keys:
            self.manager.touch(keys, self._context)
        return frozenset(kept)
