"""VllmCacheAdapter: the executor's BlockCache port over vLLM's KVCacheManager and
BlockPool, with the tees and wrappers the plugin installs (see the package docstring).
Where it puts blocks in vLLM's free queue is :mod:`.free_queue`; how it reads vLLM's KV
events into the session index's, :mod:`.event_translation`."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from kvhint.engine_plugin.config import LOGGER_NAME
from kvhint.engine_plugin.block_cache import BlockHandle, GroupNeed
from kvhint.engine_plugin.vllm_adapter.allocation_args import (
    block_ids,
    need_reader,
    positional_index,
)
from kvhint.engine_plugin.vllm_adapter.event_translation import index_events as _index_events
from kvhint.engine_plugin.vllm_adapter.event_translation import removed_in_groups
from kvhint.engine_plugin.vllm_adapter.free_queue import evict_first
from kvhint.engine_plugin.vllm_adapter.hit_groups import hit_group_needs
from kvhint.schemas.events import follows_group

logger = logging.getLogger(LOGGER_NAME)

_NO_GROUP = object()  # an event kind with no group_idx field

U64_MASK = (1 << 64) - 1

# Attributes the plugin needs, by object; checked at bind time.
_REQUIRED = {
    "kv_cache_manager": ("take_events", "allocate_slots", "free", "reset_prefix_cache",
                         "block_pool", "kv_cache_config"),
    "block_pool": ("touch", "free_blocks", "get_cached_block", "get_num_free_blocks",
                   "num_gpu_blocks", "hash_block_size", "enable_kv_cache_events", "blocks"),
}


class VllmFeatureMissing(RuntimeError):
    """The installed vLLM lacks something the plugin needs (named in the message)."""


def digest_to_int(digest: bytes) -> int:
    """vLLM's event form of a block hash: the low 64 bits of the digest."""
    return int.from_bytes(digest, "big") & U64_MASK


class VllmCacheAdapter:
    """Implements the executor's BlockCache port over vLLM's KVCacheManager."""

    def __init__(self, kv_cache_manager: Any) -> None:
        self.check(kv_cache_manager)
        self.manager = kv_cache_manager
        self.pool = kv_cache_manager.block_pool
        groups = kv_cache_manager.kv_cache_config.kv_cache_groups
        self._group_ids = self._full_attention_groups(groups)
        self._block_size = self._group_block_size(groups, self._group_ids[0])
        self._hit_groups, self._unheld_groups = hit_group_needs(kv_cache_manager, groups,
                                                                self._group_ids)
        self._hit_group_ids = frozenset(n.group_id for n in self._hit_groups)
        # The smallest group's: a floor of the blocks an allocation needs (need_reader).
        self._min_block_size = min(int(g.kv_cache_spec.block_size) for g in groups)
        self._hash_block_size = int(self.pool.hash_block_size)
        self._resolve_hashes = self._hash_resolver()
        from vllm.v1.core import kv_cache_utils

        # A pool cache key (BlockHashWithGroupId: digest + 4-byte group id) -> its digest.
        self._entry_digest: Callable[[bytes], bytes] = getattr(
            kv_cache_utils, "get_block_hash", lambda entry: entry[:-4])
        self._digests: dict[int, bytes] = {}
        # Live requests that mapped each hash: a digest a live request still needs (it
        # may cache that block later, its cursor already past it) is never dropped.
        self._refs: dict[int, int] = {}
        self._mapped: dict[str, int] = {}  # live request id -> block hashes already mapped
        self._installed: dict[str, Any] = {}
        self.events_enabled_by_plugin = False
        # What the last reset_prefix_cache() returned, until take_reset_result() reads it.
        self._reset_result: bool | None = None
        # The BlockStored events vLLM re-announces reused blocks with (a request's
        # kv_cache_report_mode "full": emit_cached_block_events), until the batch that
        # carries them is indexed (re_reports_in): a hit, not one more physical copy.
        self._re_reports: list[Any] = []
        self._coordinator_emit: tuple[Any, Any] | None = None

    # --- feature detection ------------------------------------------------------------------

    @staticmethod
    def check(kv_cache_manager: Any) -> None:
        for attr in _REQUIRED["kv_cache_manager"]:
            if not hasattr(kv_cache_manager, attr):
                raise VllmFeatureMissing(f"vLLM KVCacheManager has no {attr!r}; the kvhint "
                                         "plugin needs it")
        pool = kv_cache_manager.block_pool
        for attr in _REQUIRED["block_pool"]:
            if not hasattr(pool, attr):
                raise VllmFeatureMissing(f"vLLM BlockPool has no {attr!r}; the kvhint plugin "
                                         "needs it")

    @staticmethod
    def _group_block_size(groups: Sequence[Any], followed: int) -> int:
        """The block size of the group whose events the plugin and the router follow
        (:attr:`event_group`): its BlockStored events name one hash per block of that
        size (the chain's hash at the block's end, vLLM's hash_block_size a divisor of
        it), so the router hashes at it. vLLM 0.32 lets groups differ (hash_block_size
        their gcd); the smallest one's, reported before, made the router's hashes miss
        every block of a larger full-attention group."""
        sizes = [int(g.kv_cache_spec.block_size) for g in groups]
        if len(set(sizes)) != 1:
            logger.info("kvhint: KV cache groups have block sizes %s; following group %d's "
                        "(%d tokens)", sizes, followed, sizes[followed])
        return sizes[followed]

    @staticmethod
    def _full_attention_groups(groups: Sequence[Any]) -> list[int]:
        from vllm.v1 import kv_cache_interface as kci

        full = getattr(kci, "FullAttentionSpec", None)
        ids = [i for i, g in enumerate(groups)
               if full is not None and isinstance(g.kv_cache_spec, full)]
        return ids or list(range(len(groups)))

    def _hash_resolver(self) -> Callable[[Sequence[bytes]], Sequence[bytes]]:
        if self._block_size == self._hash_block_size:
            return lambda hashes: hashes
        from vllm.v1.core import kv_cache_utils

        resolve = getattr(kv_cache_utils, "resolve_block_hashes", None)
        if resolve is None:
            raise VllmFeatureMissing(
                f"block size {self._block_size} differs from the hash block size "
                f"{self._hash_block_size} and this vLLM has no resolve_block_hashes")
        return lambda hashes: resolve(hashes, self._hash_block_size, self._block_size)

    # --- installing the tees and wrappers ---------------------------------------------------

    def install(self, on_events: Callable[[list[Any]], None],
                before_reset: Callable[[], None],
                relieve_pressure: Callable[[int, frozenset[int]], int],
                on_hit: Callable[[Any, int], None],
                releasable: Callable[[int, frozenset[int]], int],
                guard: Callable[..., Any]) -> None:
        """Shadow manager methods on the instance (see the module docstring). The
        callbacks are the plugin's, already guarded; ``guard(hook, fn, *args)`` runs this
        adapter's own bookkeeping the same way (``PluginCore.guard``: an error is logged
        and counted, never raised into vLLM), and always after vLLM's own method, so a
        plugin error can never keep a request's blocks from being allocated or freed."""
        manager, pool = self.manager, self.pool
        if not pool.enable_kv_cache_events:
            pool.enable_kv_cache_events = True
            self.events_enabled_by_plugin = True
        take_events = manager.take_events
        reset_prefix_cache = manager.reset_prefix_cache
        allocate_slots = manager.allocate_slots
        free = manager.free
        # Scheduler.defer_block_free (async scheduling or pipeline parallelism with a KV
        # consumer connector): a freed request's blocks are popped here and returned to
        # the pool later, without manager.free.
        pop_blocks_for_free = getattr(manager, "pop_blocks_for_free", None)
        self._installed = {"take_events": take_events, "reset_prefix_cache": reset_prefix_cache,
                           "allocate_slots": allocate_slots, "free": free}
        if pop_blocks_for_free is not None:
            self._installed["pop_blocks_for_free"] = pop_blocks_for_free
        hit_position = positional_index(allocate_slots, "num_new_computed_tokens")
        computed_position = positional_index(allocate_slots, "new_computed_blocks")
        need_of = need_reader(manager, allocate_slots, self._min_block_size)
        block_size = self._min_block_size
        map_request, forget_request = self._map_request, self.forget_request

        def tee_take_events() -> list[Any]:
            self._reset_result = None  # a step passed: no connector reset follows it
            events = take_events()
            if events:
                on_events(list(events))
            self._re_reports.clear()  # all were in this batch: indexed, or lost with it
            return events

        def reset_releasing_holds() -> bool:
            before_reset()
            succeeded = reset_prefix_cache()
            # Read by the connector's reset_cache, which vLLM's Scheduler.reset_prefix_cache
            # calls right after this one when it resets the connectors too.
            self._reset_result = bool(succeeded)
            return succeeded

        def allocate_slots_releasing_retained(request: Any, num_new_tokens: int,
                                              *args: Any, **kwargs: Any) -> Any:
            # Pass-through wrapper: the signature varies across vLLM releases.
            blocks = allocate_slots(request, num_new_tokens, *args, **kwargs)
            if blocks is None:
                free = pool.get_num_free_blocks()
                # The request's own prefix hits: released, each frees a block and needs
                # one back (vLLM counts a free hit block as one to allocate).
                hits = guard("allocate_slots:hits", block_ids, kwargs.get(
                    "new_computed_blocks", args[computed_position]
                    if computed_position is not None and len(args) > computed_position
                    else None), default=frozenset())
                # Less one if a block is partly full (need_reader says what it counts).
                need = guard("allocate_slots:need", need_of, request, num_new_tokens, args,
                             kwargs, hits, default=-(-num_new_tokens // block_size))
                if free + releasable(need - 1 - free, hits) < need - 1:
                    return None  # releasing every releasable block would not be enough
                chunk = max(1, need - free)
                while blocks is None and relieve_pressure(chunk, hits) > 0:
                    blocks = allocate_slots(request, num_new_tokens, *args, **kwargs)
                    chunk *= 2
                if blocks is None:
                    return None
            guard("allocate_slots:map_request", map_request, request)
            hit = kwargs.get("num_new_computed_tokens", 0)
            if not hit and hit_position is not None and len(args) > hit_position:
                hit = args[hit_position]
            if hit:
                on_hit(request, hit)
            return blocks

        def free_mapping_last_hashes(request: Any) -> None:
            free(request)  # freed blocks stay cached: the request's hashes still resolve
            guard("free:forget_request", forget_request, request)

        def pop_blocks_mapping_last_hashes(request: Any) -> Any:
            # The blocks stay out of the pool until the scheduler frees them, but what was
            # cached stays cached and what was not never will be: forget as free() does.
            blocks = pop_blocks_for_free(request)
            guard("pop_blocks_for_free:forget_request", forget_request, request)
            return blocks

        manager.take_events = tee_take_events
        manager.reset_prefix_cache = reset_releasing_holds
        manager.allocate_slots = allocate_slots_releasing_retained
        manager.free = free_mapping_last_hashes
        if pop_blocks_for_free is not None:
            manager.pop_blocks_for_free = pop_blocks_mapping_last_hashes
        self._mark_re_reports(guard)

    def _mark_re_reports(self, guard: Callable[..., Any]) -> None:
        """Shadow the coordinator's ``emit_cached_block_events`` to note the events it
        queues: re-announcements of blocks already cached, which the session index must
        not count as new copies (no BlockRemoved ever retires them: the blocks stayed
        "resident" in it, and in the snapshots a router resyncs from, after vLLM evicted
        them). A vLLM without the method announces no re-reports."""
        coordinator = getattr(self.manager, "coordinator", None)
        emit = getattr(coordinator, "emit_cached_block_events", None)
        if emit is None:
            return
        pools = list({id(m.block_pool): m.block_pool for m in getattr(
            coordinator, "single_type_managers", ())}.values()) or [self.pool]
        re_reports = self._re_reports

        def mark(before: list[tuple[Any, int]]) -> None:
            for pool, n in before:
                re_reports.extend(pool.kv_event_queue[n:])

        def emit_marking_re_reports(request: Any, computed_blocks: Any) -> None:
            before = [(pool, len(pool.kv_event_queue)) for pool in pools]
            emit(request, computed_blocks)
            guard("emit_cached_block_events:mark", mark, before)

        coordinator.emit_cached_block_events = emit_marking_re_reports
        self._coordinator_emit = (coordinator, emit)

    def re_reports_in(self, events: Iterable[Any]) -> frozenset[int]:
        """The ids of the events of ``events`` that re-announce cached blocks (see
        :meth:`_mark_re_reports`), for :meth:`index_events` to skip; forgotten here."""
        if not self._re_reports:
            return frozenset()
        batch = {id(e) for e in events}
        ids = frozenset(id(e) for e in self._re_reports if id(e) in batch)
        self._re_reports[:] = [e for e in self._re_reports if id(e) not in ids]
        return ids

    def take_reset_result(self) -> bool | None:
        """Whether the last ``reset_prefix_cache()`` reset the GPU pool (its
        AllBlocksCleared then waits in the pool's event queue); None: no reset since the
        last call."""
        result, self._reset_result = self._reset_result, None
        return result

    def uninstall(self) -> None:
        for name, original in self._installed.items():
            setattr(self.manager, name, original)
        self._installed = {}
        if self._coordinator_emit is not None:
            coordinator, emit = self._coordinator_emit
            coordinator.emit_cached_block_events = emit
            self._coordinator_emit = None

    # --- BlockCache port ----------------------------------------------------------------------

    @property
    def prefix_caching(self) -> bool:
        """Whether vLLM caches blocks by hash (``--enable-prefix-caching``): without it no
        block is ever cached, stored in an event or found again. A vLLM without the flag
        on its pool is taken to cache (it always did when this was written)."""
        return bool(getattr(self.pool, "enable_caching", True))

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def hash_block_size(self) -> int:
        """Tokens per hash of vLLM's block-hash chain (``Request.block_hashes``): the block
        size, or a divisor of it in a hybrid model (the router hashes at it)."""
        return self._hash_block_size

    @property
    def num_blocks(self) -> int:
        return int(self.pool.num_gpu_blocks) - 1  # one is vLLM's null block

    @property
    def num_free_blocks(self) -> int:
        return int(self.pool.get_num_free_blocks())

    def lookup(self, key: int) -> BlockHandle | None:
        digest = self._digests.get(key)
        if digest is None:
            return None
        blocks = self.pool.get_cached_block(digest, self._group_ids)
        if not blocks:
            return None
        first = blocks[0]
        num_tokens = getattr(first, "block_hash_num_tokens", None)
        depth = num_tokens // self._block_size - 1 if num_tokens else 0
        return BlockHandle(key=key, block_id=first.block_id, depth=depth, blocks=tuple(blocks))

    @property
    def hit_groups(self) -> tuple[GroupNeed, ...]:
        """A hybrid model's other KV cache groups a prefix hit needs (:mod:`.hit_groups`)."""
        return self._hit_groups

    @property
    def unheld_groups(self) -> tuple[str, ...]:
        """The groups a prefix hit needs that no hold can take (:mod:`.hit_groups`)."""
        return self._unheld_groups

    def side_removed(self, events: Iterable[Any]) -> list[int]:
        """The hashes of the :attr:`hit_groups`' blocks these vLLM events remove (a held
        one may be among them)."""
        return removed_in_groups(events, self._hit_group_ids)

    def side_block(self, handle: BlockHandle, group_id: int) -> BlockHandle | None:
        digest = self._digests.get(handle.key)
        blocks = None if digest is None else self.pool.get_cached_block(digest, [group_id])
        if not blocks:
            return None
        return BlockHandle(key=handle.key, block_id=blocks[0].block_id, depth=handle.depth,
                           blocks=(blocks[0],), side=True)

    def digest(self, key: int) -> bytes | None:
        """The full block hash (vLLM's pool and offload key) behind a 64-bit event hash,
        while the block is cached."""
        return self._digests.get(key)

    @property
    def full_attention_group_ids(self) -> tuple[int, ...]:
        return tuple(self._group_ids)

    @property
    def event_group(self) -> int:
        """The KV-cache group whose block events the plugin's index and the router follow
        (``schemas.events.follows_group``): the first full-attention group, the one
        prefix lookups use; group 0 of a single-group model."""
        return self._group_ids[0]

    def followed_events(self, events: list[Any]) -> tuple[list[Any], int]:
        """``events`` less the block events of KV-cache groups other than
        :attr:`event_group` (``schemas.events.follows_group``, the rule the router drops
        them by), and how many were left out: what the plugin publishes. A hybrid model's
        vLLM repeats every block event once per group (Gemma 3: six groups); the router
        applies only the followed group's. Events naming no group (AllBlocksCleared, a
        kind this plugin does not know) all stay."""
        group = self.event_group
        kept = [e for e in events
                if (g := getattr(e, "group_idx", _NO_GROUP)) is _NO_GROUP
                or follows_group(g, group)]
        return kept, len(events) - len(kept)

    @property
    def blocks_are_hash_blocks(self) -> bool:
        """Whether one cache block is one hash block (no ``resolve_block_hashes`` merge)."""
        return self._block_size == self._hash_block_size

    def hold(self, handles: Sequence[BlockHandle]) -> None:
        if handles:
            self.pool.touch([b for h in handles for b in h.blocks])

    def release(self, handles: Sequence[BlockHandle]) -> None:
        if handles:
            self.pool.free_blocks([b for h in handles for b in h.blocks])

    def evict_first(self, handles: Sequence[BlockHandle]) -> int:
        """Put the free ones of these blocks first among the *cached* free blocks, behind
        the empty ones (:func:`.free_queue.evict_first`); how many moved."""
        return evict_first(self.pool.free_block_queue, handles)

    def in_use(self, handle: BlockHandle) -> bool:
        # The plugin's hold is one reference (BlockPool.touch); a running request adds one.
        return any(b.ref_cnt > 1 for b in handle.blocks)

    def is_cached(self, handle: BlockHandle) -> bool:
        # A cache entry is the block's own hash or one of the extra hashes the pool keeps
        # for it (``cached_block_hashes_by_block``), each a digest plus a 4-byte group id
        # (vLLM's BlockHashWithGroupId); evict_blocks and move_block_hashes clear both.
        extra = getattr(self.pool, "cached_block_hashes_by_block", None) or {}
        for block in handle.blocks:
            entries = [block.block_hash, *extra.get(block.block_id, ())]
            if not any(e is not None and digest_to_int(self._entry_digest(e)) == handle.key
                       for e in entries):
                return False
        return True

    def only_held_blocks_in_use(self, handles: Iterable[BlockHandle]) -> bool:
        """True when nothing but these holds keeps blocks in use (so releasing them lets
        ``reset_prefix_cache`` succeed)."""
        ours = sum(1 for h in handles for b in h.blocks if b.ref_cnt == 1)
        used = int(self.pool.num_gpu_blocks) - int(self.pool.get_num_free_blocks()) - 1
        return used == ours

    # --- requests and hashes --------------------------------------------------------------

    def _forget_request(self, request: Any) -> None:
        """The request's blocks went back to the pool: stop tracking it and drop the
        hashes it mapped that never made it into the cache and no other live request
        mapped (that one may still cache them)."""
        mapped = self._mapped.pop(request.request_id, None)
        if not mapped:
            return
        refs, digests = self._refs, self._digests
        for digest in self._resolve_hashes(request.block_hashes)[:mapped]:
            key = digest_to_int(digest)
            left = refs.get(key, 0) - 1
            if left > 0:
                refs[key] = left
                continue
            refs.pop(key, None)
            if self.pool.get_cached_block(digest, self._group_ids) is None:
                digests.pop(key, None)

    def forget_request(self, request: Any) -> None:
        """The scheduler is done with the request: map its last hashes and forget it as
        when its blocks are freed."""
        self._map_request(request)
        self._forget_request(request)

    def hit_keys(self, request: Any, num_hit_tokens: int) -> list[int]:
        """The 64-bit hashes of the request's first ``num_hit_tokens`` (cached) tokens."""
        self._map_request(request)
        hashes = self._resolve_hashes(request.block_hashes)
        return [digest_to_int(d) for d in hashes[:num_hit_tokens // self._block_size]]

    def session_id(self, request: Any) -> str | None:
        return getattr(request, "session_id", None)

    def forget(self, keys: Iterable[int]) -> None:
        """These hashes left the cache (per the event stream); drop their digests unless
        another copy is still cached or a live request mapped them (it may cache them
        again: its cursor is past them)."""
        refs = self._refs
        for key in keys:
            digest = self._digests.get(key)
            if (digest is not None and key not in refs
                    and self.pool.get_cached_block(digest, self._group_ids) is None):
                del self._digests[key]

    def known_keys(self) -> list[int]:
        return list(self._digests)

    def forget_all(self) -> None:
        self._digests.clear()
        self._refs.clear()  # every live request maps (and counts) its hashes again
        self._mapped = dict.fromkeys(self._mapped, 0)

    @property
    def num_live_requests(self) -> int:
        return len(self._mapped)

    @property
    def num_mapped_hashes(self) -> int:
        return len(self._digests)

    def _map_request(self, request: Any) -> None:
        hashes = self._resolve_hashes(request.block_hashes)
        start = self._mapped.get(request.request_id, 0)
        if start >= len(hashes):
            return
        digests, refs = self._digests, self._refs
        for digest in hashes[start:]:
            key = digest_to_int(digest)
            digests[key] = digest
            refs[key] = refs.get(key, 0) + 1
        self._mapped[request.request_id] = len(hashes)

    # --- events -------------------------------------------------------------------------------

    # vLLM KV events -> the index's domain events (:func:`.event_translation.index_events`).
    index_events = staticmethod(_index_events)
