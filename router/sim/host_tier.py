"""The host tier (G2) of a simulated worker: vLLM's own CPU offloading bookkeeping.

:class:`SimHostTier` drives vLLM's ``CPUOffloadingManager`` (``vllm.v1.kv_offload.cpu``,
the manager behind the OffloadingConnector, with its LRU or ARC cache policy) without
CUDA: the chunk pool, eviction, ref counts and events are vLLM's; only the copies are
modelled (loads cost time in the worker's prefill, see :mod:`.timing`; stores complete
at once, i.e. the host link is assumed to keep up).

It serves two callers:
- the plugin's hint executor, through the :class:`kvhint.engine_plugin.host_tier.HostTier`
  port (``keep`` for Demote, ``contains``);
- the simulated worker, which stores each request's newly computed blocks (what the
  OffloadingConnector does by default) when ``store_on_compute`` is set, and loads the
  continuation of a G1 prefix hit from G2 at admission (``load_prefix``).

Block hashes are the 64-bit ints of KV events; vLLM's offload key is their 8 bytes.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

_HASH_BYTES = 8


def _key(block_hash: int) -> bytes:
    return make_offload_key(block_hash.to_bytes(_HASH_BYTES, "big"), 0)


def _hash_of(key: bytes) -> int:
    return int.from_bytes(key[:_HASH_BYTES], "big")


@dataclass(slots=True)
class HostTierCounters:
    stored_blocks: int = 0
    store_failures: int = 0
    loaded_blocks: int = 0
    evicted_blocks: int = 0


class SimHostTier:
    """One worker's G2 tier of ``num_blocks`` blocks over vLLM's CPUOffloadingManager."""

    def __init__(self, num_blocks: int, cache_policy: str = "lru") -> None:
        if num_blocks <= 0:
            raise ValueError("a host tier needs at least one block")
        self.num_blocks = num_blocks
        self.manager = CPUOffloadingManager(
            num_chunks=num_blocks, cache_policy=cache_policy, enable_events=True
        )
        self.counters = HostTierCounters()
        self._ids = itertools.count()
        # lookup() records nothing on the context; one serves every probe.
        self._probe = ReqContext(req_id="host-probe")

    def _context(self) -> ReqContext:
        ctx = ReqContext(req_id=f"host-{next(self._ids)}")
        self.manager.on_new_request(ctx)
        return ctx

    # -- the plugin's HostTier port ----------------------------------------------------------

    def keep(self, block_hashes: Sequence[int]) -> frozenset[int]:
        """Keep a host copy of these blocks (storing the missing ones, refreshing the
        ones already there); returns the ones that have one afterwards."""
        present = self.store(block_hashes)
        return frozenset(h for h, kept in zip(block_hashes, present, strict=True) if kept)

    def store(self, block_hashes: Sequence[int]) -> list[bool]:
        """Store these blocks (refreshing the ones already there); for each, whether it
        has a host copy afterwards."""
        if not block_hashes:
            return []
        ctx = self._context()
        keys = [_key(h) for h in block_hashes]
        out = self.manager.prepare_store(keys, ctx)
        if out is None:
            self.counters.store_failures += 1
        else:
            self.manager.complete_store(out.keys_to_store, ctx)
            self.counters.stored_blocks += len(out.keys_to_store)
        present = [self.manager.lookup(k, ctx) is LookupResult.HIT for k in keys]
        self.manager.touch([k for k, kept in zip(keys, present, strict=True) if kept], ctx)
        self.manager.on_request_finished(ctx)
        return present

    def contains(self, block_hash: int) -> bool:
        return self.manager.lookup(_key(block_hash), self._probe) is LookupResult.HIT

    def copying(self, block_hash: int) -> bool:
        """Never: stores complete at once here."""
        return False

    # -- the worker's side ---------------------------------------------------------------------

    def prefix_blocks(self, block_hashes: Sequence[int]) -> int:
        """How many of ``block_hashes``, from the first, are in G2 and ready."""
        count = 0
        for block_hash in block_hashes:
            if not self.contains(block_hash):
                break
            count += 1
        return count

    def load(self, block_hashes: Sequence[int]) -> None:
        """Read these (present) blocks into G1: vLLM's prepare_load/complete_load, which
        also marks them recently used."""
        if not block_hashes:
            return
        ctx = self._context()
        keys = [_key(h) for h in block_hashes]
        self.manager.prepare_load(keys, ctx)
        self.manager.complete_load(keys, ctx)
        self.manager.on_request_finished(ctx)
        self.counters.loaded_blocks += len(keys)

    def take_events(self) -> list[tuple[bool, list[int]]]:
        """``(removed, block hashes)`` per vLLM offloading event since the last call, in
        order (False = stored)."""
        out = []
        for event in self.manager.take_events():
            hashes = [_hash_of(k) for k in event.keys]
            if event.removed:
                self.counters.evicted_blocks += len(hashes)
            out.append((event.removed, hashes))
        return out
