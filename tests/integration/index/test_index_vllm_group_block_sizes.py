"""A hybrid model whose KV-cache groups have different block sizes, on vLLM's real
KVCacheManager: the plugin reports the block size of the group it follows (the first
full-attention one), and the router, hashing at vLLM's hash_block_size (the groups'
greatest common divisor) and keeping the hash at each of that group's block ends, matches
the blocks vLLM hits.

vLLM 0.32 (kv_cache_utils.resolve_kv_cache_block_sizes): with several groups,
hash_block_size is the gcd of the groups' block sizes and the scheduler block size their
lcm; each group's BlockStored events name its own blocks, by the chain's hash at each
block's end (BlockHashListWithBlockSize). Before, the plugin reported the smallest
group's block size (here the sliding window's 16): the router then kept every 16-token
hash and matched none of the full-attention group's 32-token blocks.
"""

from __future__ import annotations

import random

import pytest

from kvhint import schemas as s
from kvhint.engine_plugin.config import PluginConfig
from kvhint.engine_plugin.core import PluginCore
from kvhint.engine_plugin.headless import _block_hasher, _request_factory
from kvhint.engine_plugin.mailbox import Mailbox, pop_oldest
from kvhint.engine_plugin.vllm_adapter.engine import EventBatchEncoder
from kvhint.router.hashing import BlockHasher, HashConfig
from kvhint.router.kv_index import InMemoryClusterKvIndex, KvEventIngestor

FULL_BLOCK, WINDOW_BLOCK = 32, 16


def _manager(full_first: bool):
    import torch
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        SlidingWindowSpec,
    )

    spec = {"num_kv_heads": 2, "head_size": 8, "dtype": torch.float32}
    full = KVCacheGroupSpec(["full"], FullAttentionSpec(block_size=FULL_BLOCK, **spec))
    window = KVCacheGroupSpec(["window"], SlidingWindowSpec(
        block_size=WINDOW_BLOCK, sliding_window=2 * WINDOW_BLOCK, **spec))
    groups = [full, window] if full_first else [window, full]
    config = KVCacheConfig(num_blocks=160, kv_cache_tensors=[], kv_cache_groups=groups)
    config.hash_block_size = WINDOW_BLOCK  # gcd(32, 16), as vLLM resolves it
    return KVCacheManager(kv_cache_config=config, max_model_len=80 * FULL_BLOCK,
                          scheduler_block_size=FULL_BLOCK, hash_block_size=WINDOW_BLOCK,
                          enable_caching=True, log_stats=False, enable_kv_cache_events=True)


@pytest.mark.parametrize("full_first", [True, False])
def test_the_router_hashes_at_the_followed_groups_block_size(full_first: bool) -> None:
    manager = _manager(full_first)
    assert [g.kv_cache_spec.block_size for g in manager.kv_cache_config.kv_cache_groups] \
        == ([32, 16] if full_first else [16, 32])
    core = PluginCore.attach(manager, PluginConfig(worker_id="w0"), mailbox=Mailbox(
        inbound_limit=4, outcome_limit=4, event_batch_limit=1_000))
    group = core.adapter.event_group
    assert group == (0 if full_first else 1)
    status = s.decode_status(s.encode_status(core.worker_status()))
    # Before: (16, UNSET), the smallest group's block size.
    assert (status.block_size, status.hash_block_size) == (FULL_BLOCK, WINDOW_BLOCK)
    hasher = BlockHasher(HashConfig.from_status(status))
    router = InMemoryClusterKvIndex()
    ingestor = KvEventIngestor(router, clock=lambda: 0.0)
    encoder = EventBatchEncoder()
    make_request = _request_factory(_block_hasher(WINDOW_BLOCK))
    rng = random.Random(11)
    prefixes = [[rng.randrange(1, 500) for _ in range(FULL_BLOCK * rng.randint(1, 4))]
                for _ in range(4)]
    hits = 0
    for step in range(30):
        prompt = rng.choice(prefixes) + [rng.randrange(1, 500)
                                         for _ in range(rng.randint(3, 3 * FULL_BLOCK))]
        request = make_request(prompt, session_id=f"s{step}")
        blocks, hit, _ = manager.get_computed_blocks(request)
        predicted = router.match_prefix(hasher.block_hashes(prompt)).of("w0").gpu_blocks
        assert min(predicted * FULL_BLOCK, (len(prompt) - 1) // FULL_BLOCK * FULL_BLOCK) \
            >= hit, step
        if hit:
            # The full-attention prefix the router sees is what vLLM could hit on; the
            # window group may only shorten it, to a 32-token boundary.
            assert predicted * FULL_BLOCK >= hit and hit % FULL_BLOCK == 0, step
        hits += hit > 0
        assert manager.allocate_slots(request, request.num_tokens - hit,
                                      num_new_computed_tokens=hit,
                                      new_computed_blocks=blocks) is not None
        request.num_computed_tokens = request.num_tokens
        manager.free(request)
        manager.take_events()  # the plugin's tee indexes and queues them
        while (batch := pop_oldest(core.mailbox.event_batches)) is not None:
            meta = s.EventBatchMeta("w0", "e1", batch.seq, group)
            ingestor.on_event_message(meta.to_headers(),
                                      encoder.encode(0.0, batch.events, None))
        # The plugin's index names the session's blocks by the keys vLLM's events use.
        session = core.index.session_blocks(f"s{step}")
        assert session and all(router.locate(k) for k in session), step
    assert hits > 5
    # Every prefix the router was told of is matched whole, at 32-token blocks.
    for prefix in prefixes:
        matched = router.match_prefix(hasher.block_hashes(prefix)).of("w0").gpu_blocks
        assert matched in (0, len(prefix) // FULL_BLOCK)
    assert any(router.match_prefix(hasher.block_hashes(p)).of("w0").gpu_blocks
               for p in prefixes)
