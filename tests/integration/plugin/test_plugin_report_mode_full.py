"""A request with ``kv_cache_report_mode: "full"`` (vLLM's extra_args; a client's
``vllm_xargs`` used to carry it through the router) makes vLLM re-announce the blocks it
reused as a BlockStored. Against vLLM's real KVCacheManager: the plugin's index takes that
for a hit, not one more physical copy, so the blocks leave it when vLLM evicts them, and a
router resyncing from its snapshot holds what the router that followed the stream holds.
Before, every such hit added a GPU copy no BlockRemoved retired: the blocks stayed
"resident" for good, in the plugin and in every snapshot (false hits after a resync)."""

from __future__ import annotations

from vllm.v1.core.kv_cache_utils import get_block_hash

from kvhint.engine_plugin.config import PluginConfig
from kvhint.engine_plugin.core import PluginCore
from kvhint.engine_plugin.headless import build_kv_cache_manager
from kvhint.router.hashing import BlockHasher, HashConfig
from kvhint.router.kv_index import EventBatchAdapter, InMemoryClusterKvIndex

BLOCK = 16
U64 = (1 << 64) - 1


def test_re_announced_hits_are_not_copies_and_leave_with_the_eviction() -> None:
    cache = build_kv_cache_manager(block_size=BLOCK, num_blocks=20)
    core = PluginCore.attach(cache.manager, PluginConfig(worker_id="w0"))
    router, adapter = InMemoryClusterKvIndex(), EventBatchAdapter()

    def step(prompt: list[int], **extra_args: str) -> int:
        request = cache.make_request(prompt, session_id="t/s", extra_args=extra_args or None)
        hit = cache.admit(request)
        cache.finish(request)
        events = cache.manager.take_events()  # the plugin's tee indexes them
        router.apply_all(adapter.convert_events("w0", events))
        return hit or 0

    prompt = list(range(1, 4 * BLOCK + 2))
    ours = BlockHasher(HashConfig(BLOCK)).block_hashes(prompt)
    step(prompt)
    for _ in range(3):
        assert step(prompt, kv_cache_report_mode="full") == 4 * BLOCK
    assert all(core.index.is_resident(h) for h in ours)
    for j in range(6):  # other prompts evict the first one
        step([1000 * (j + 1) + k for k in range(5 * BLOCK)])
    keys = cache.block_pool.cached_block_hash_to_block._cache
    cached = {int.from_bytes(get_block_hash(k), "big") & U64 for k in keys}
    assert not any(h in cached for h in ours)
    assert not any(core.index.is_resident(h) for h in ours)
    assert core.index.num_resident_gpu == len(cached)
    resynced = InMemoryClusterKvIndex()
    resynced.apply(snapshot_of(core))
    assert resynced.export_state().blocks == router.export_state().blocks


def snapshot_of(core: PluginCore) -> object:
    """The plugin index's snapshot, as a router loads it (one page)."""
    from kvhint.router.kv_index import SnapshotBlock, SnapshotLoaded

    return SnapshotLoaded("w0", [SnapshotBlock(h, p, m)
                                 for h, p, m in core.index.snapshot_blocks()])
