"""A hybrid model (sliding-window and full-attention layers, Gemma 3's 5:1 pattern) against
vLLM's real KVCacheManager: the router's index and the plugin's follow the full-attention
group, whatever its index, and agree with each other and with vLLM's pool.

vLLM orders KV-cache groups by the layer types' first appearance, so here group 0..4 are
sliding-window groups and group 5 the full-attention one. Each group announces every block
hash, and the groups evict apart. A router that followed group 0 mirrored the
sliding-window group's residency (blocks the full-attention group had evicted looked
cached, and the reverse) and dropped every host-tier event (the offloading connector
publishes the full-attention group's index); the plugin's index applied every group's
events, so a snapshot of it disagreed with the live router view.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from kvhint import schemas as s
from kvhint.engine_plugin.mailbox import SnapshotOut
from kvhint.engine_plugin.snapshot_pages import KeptSnapshots, snapshot_page
from kvhint.engine_plugin.vllm_adapter import VllmCacheAdapter
from kvhint.schemas.events import HEADER_GROUP
from kvhint.router.kv_index import (
    EventBatchAdapter,
    InMemoryClusterKvIndex,
    KvEventIngestor,
    RequestSnapshot,
    snapshot_to_event,
)

U64 = (1 << 64) - 1
BLOCK = 16


def hybrid_manager(full_first: bool, num_blocks: int = 120):
    """vLLM's KVCacheManager over the groups vLLM itself forms for 12 layers, every sixth
    full attention and the rest a 32-token sliding window: Gemma 3's pattern (layer 5 the
    first full one), or with layer 0 full (its group then comes first)."""
    import torch
    from vllm.v1.core import kv_cache_utils as kcu
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, SlidingWindowSpec

    full = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=8,
                             dtype=torch.float32)
    window = SlidingWindowSpec(block_size=BLOCK, num_kv_heads=2, head_size=8,
                               dtype=torch.float32, sliding_window=2 * BLOCK)
    first_full = 0 if full_first else 5
    layers = {f"model.layers.{i}.self_attn.attn": full if i % 6 == first_full else window
              for i in range(12)}
    groups = kcu._get_kv_cache_groups_uniform_page_size(layers)
    config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)
    config.hash_block_size = BLOCK
    return KVCacheManager(kv_cache_config=config, max_model_len=num_blocks * BLOCK,
                          scheduler_block_size=BLOCK, hash_block_size=BLOCK,
                          enable_caching=True, log_stats=False, enable_kv_cache_events=True)


def cached_in_group(manager, group: int) -> set[int]:
    """The hashes vLLM's pool caches for one KV-cache group, as KV events name them."""
    from vllm.v1.core.kv_cache_utils import get_block_hash, get_group_id

    keys = manager.block_pool.cached_block_hash_to_block._cache
    return {int.from_bytes(get_block_hash(k), "big") & U64 for k in keys
            if get_group_id(k) == group}


@dataclass
class _Drops:
    snapshots_dropped: int = 0
    snapshots_evicted: int = 0


class Worker:
    """One engine's published stream: the plugin (its real PluginCore on ``manager``, its
    tee of vLLM's events, its index) queues what it publishes in its mailbox; those
    batches, encoded as the transport does with the plugin's headers, go into the
    router's ingestor. Bytes are counted both ways: as published, and as every group's
    events of the same batches would have been."""

    def __init__(self, manager) -> None:
        from kvhint.engine_plugin.config import PluginConfig
        from kvhint.engine_plugin.core import PluginCore
        from kvhint.engine_plugin.mailbox import Mailbox
        from kvhint.engine_plugin.vllm_adapter.engine import EventBatchEncoder

        self.manager = manager
        self.core = PluginCore.attach(manager, PluginConfig(worker_id="w0"), mailbox=Mailbox(
            inbound_limit=4, outcome_limit=4, event_batch_limit=1_000))
        self.adapter = self.core.adapter
        self.plugin = self.core.index
        self.router = InMemoryClusterKvIndex()
        self.ingestor = KvEventIngestor(self.router, clock=lambda: 0.0)
        self._encoder = EventBatchEncoder()
        self.engine_batches = self.published_bytes = self.unfiltered_bytes = 0

    def flush(self) -> None:
        from kvhint.engine_plugin.mailbox import pop_oldest

        drained = self.manager.take_events()  # the plugin's tee indexes and queues them
        if drained:
            self.engine_batches += 1
            self.unfiltered_bytes += len(self._encoder.encode(0.0, list(drained), None))
        while (batch := pop_oldest(self.core.mailbox.event_batches)) is not None:
            payload = self._encoder.encode(0.0, batch.events, None)
            self.published_bytes += len(payload)
            meta = s.EventBatchMeta("w0", "e1", batch.seq, self.adapter.event_group)
            actions = self.ingestor.on_event_message(meta.to_headers(), payload)
            assert not any(isinstance(a, RequestSnapshot) for a in actions)

    def resynced(self) -> InMemoryClusterKvIndex:
        """A fresh router index loaded from the plugin's snapshot (what a resync gives)."""
        snapshot = SnapshotOut(self.core.event_seq, self.plugin.snapshot_raw(),
                               self.plugin.snapshot_sessions(), "reply", 0, 50)
        ordered = KeptSnapshots(1_000, _Drops()).keep(snapshot)
        pages, cursor = [], 0
        while cursor is not None:
            page = s.decode_snapshot(snapshot_page(snapshot, ordered, cursor, 50, 1 << 20,
                                                   "w0", "e1", BLOCK))
            pages.append(page)
            cursor = page.next_cursor
        index = InMemoryClusterKvIndex()
        index.apply(snapshot_to_event(pages))
        return index


@pytest.mark.parametrize("full_first", [False, True])
def test_router_and_plugin_follow_the_full_attention_group_of_a_hybrid_model(
        full_first: bool) -> None:
    """Gemma 3's order: the window groups evict first, and a router following group 0
    lost blocks vLLM still hits. Full attention first: that group evicts first, and the
    plugin's index (every group's copies counted) kept blocks vLLM no longer hits."""
    from kvhint.engine_plugin.headless import _block_hasher, _request_factory
    from kvhint.router.hashing import BlockHasher, HashConfig

    manager = hybrid_manager(full_first)
    kinds = [type(g.kv_cache_spec).__name__ for g in manager.kv_cache_config.kv_cache_groups]
    group = kinds.index("FullAttentionSpec")
    assert (group, len(kinds)) == ((0, 6) if full_first else (5, 6))
    worker = Worker(manager)
    assert worker.adapter.event_group == group
    other = 1 if full_first else 0
    make_request = _request_factory(_block_hasher(BLOCK))
    hasher = BlockHasher(HashConfig(block_size=BLOCK))
    rng = random.Random(3)
    prefixes = [[rng.randrange(1, 500) for _ in range(BLOCK * rng.randint(2, 5))]
                for _ in range(5)]
    differed = hits = 0
    for step in range(60):
        prompt = rng.choice(prefixes) + [rng.randrange(1, 500)
                                         for _ in range(rng.randint(3, 4 * BLOCK))]
        request = make_request(prompt)
        blocks, hit, _ = manager.get_computed_blocks(request)
        # vLLM's hybrid hit needs the full-attention prefix: the router's prediction,
        # from its own hashes, is that prefix (an upper bound of the window's check).
        predicted = worker.router.match_prefix(hasher.block_hashes(prompt)).of("w0")
        assert min(predicted.gpu_blocks * BLOCK, (len(prompt) - 1) // BLOCK * BLOCK) >= hit
        hits += hit > 0
        if manager.allocate_slots(request, request.num_tokens - hit,
                                  num_new_computed_tokens=hit,
                                  new_computed_blocks=blocks) is None:
            continue
        request.num_computed_tokens = request.num_tokens
        for _ in range(rng.randint(0, 2 * BLOCK)):  # decode: the window slides
            request.append_output_token_ids(rng.randrange(1, 500))
            if manager.allocate_slots(request, 1) is None:
                break
            request.num_computed_tokens = request.num_tokens
        manager.free(request)
        worker.flush()
        full = cached_in_group(manager, group)
        differed += full != cached_in_group(manager, other)
        live = worker.router.export_state().blocks.get("w0", {}).get("GPU", frozenset())
        assert live == full, step
        assert worker.plugin.num_resident_gpu == len(full), step
        assert all(worker.plugin.is_resident(h) for h in full), step
        assert worker.resynced().export_state().blocks == worker.router.export_state().blocks
    assert differed > 5, "the groups should evict apart for the test to mean anything"
    assert hits > 5, "the workload should produce prefix hits"
    adapter = worker.ingestor.stats().adapter
    # The plugin publishes the followed group's events only (before, every group's: the
    # router dropped five in six of Gemma 3's), and counts what it left out.
    assert adapter["other_group_events"] == 0 and adapter["unknown_events"] == 0
    assert adapter["events"] > 0
    assert worker.core.counters.events_other_group > 0
    assert worker.core.counters.events == (worker.core.counters.events_other_group
                                           + adapter["events"])
    if not full_first:
        # Gemma 3's 5:1 layout: about a sixth of the bytes (the clears stay).
        assert worker.published_bytes * 4 < worker.unfiltered_bytes, (
            worker.published_bytes, worker.unfiltered_bytes)
    print(f"\nhybrid {'full-first' if full_first else 'gemma3'}: "
          f"{worker.engine_batches} engine batches, {worker.core.event_seq} published; "
          f"bytes per batch {worker.unfiltered_bytes / worker.engine_batches:.0f} -> "
          f"{worker.published_bytes / worker.engine_batches:.0f}")


def test_the_group_header_travels_and_defaults_to_group_zero() -> None:
    meta = s.EventBatchMeta("w0", "e1", 3, 5)
    assert s.EventBatchMeta.from_headers(meta.to_headers()) == meta
    plain = s.EventBatchMeta("w0", "e1", 3)
    assert HEADER_GROUP not in plain.to_headers()  # a single-group engine's headers
    assert s.EventBatchMeta.from_headers(plain.to_headers()).group == 0


async def test_the_plugin_transport_names_the_group_over_nats_and_the_router_follows_it(
        nats_url: str, subject_prefix: str) -> None:
    """The plugin's real transport publishes a hybrid engine's batch over a real NATS; the
    router's ingestor, fed the message as it arrives, follows the group its header names."""
    import nats

    from kvhint.engine_plugin.config import PluginConfig
    from kvhint.engine_plugin.headless import _block_hasher, _request_factory
    from kvhint.engine_plugin.mailbox import EventBatchOut, Mailbox
    from kvhint.engine_plugin.transport import NatsTransport
    from kvhint.engine_plugin.vllm_adapter.engine import EventBatchEncoder

    manager = hybrid_manager(full_first=False)
    adapter = VllmCacheAdapter(manager)
    make_request = _request_factory(_block_hasher(BLOCK))
    request = make_request(list(range(1, 6 * BLOCK + 5)))
    manager.allocate_slots(request, request.num_tokens)
    request.num_computed_tokens = request.num_tokens
    manager.free(request)
    events = manager.take_events()
    encoder = EventBatchEncoder()
    transport = NatsTransport(
        PluginConfig(worker_id="w0", subject_prefix=subject_prefix), "w0", "e1",
        Mailbox(inbound_limit=4, outcome_limit=4, event_batch_limit=4),
        lambda usage, seq: None,  # type: ignore[arg-type, return-value]
        lambda ts, evs: encoder.encode(ts, evs, None), BLOCK, adapter.event_group)
    router = InMemoryClusterKvIndex()
    ingestor = KvEventIngestor(router, clock=lambda: 0.0, subjects=s.Subjects(subject_prefix))
    nc = await nats.connect(nats_url)
    try:
        sub = await nc.subscribe(s.Subjects(subject_prefix).events("w0"))
        await transport._publish_batch(nc, EventBatchOut(1, 0.0, events))
        msg = await sub.next_msg(timeout=5)
    finally:
        await nc.drain()
    assert msg.headers[HEADER_GROUP] == "5"
    ingestor.on_event_message(msg.headers, msg.data, subject=msg.subject)
    assert router.export_state().blocks["w0"]["GPU"] == cached_in_group(manager, 5)
    assert len(cached_in_group(manager, 5)) == 6
    assert ingestor.stats().adapter["other_group_events"] == 5  # one store per window group


def test_a_chain_hashed_finer_than_a_block_is_hashed_so_by_the_router() -> None:
    """KV-cache groups hashed per 16 tokens under 32-token blocks (vLLM's hash_block_size,
    the groups' greatest common divisor or prefix_match_unit): vLLM names each block by
    the chain's hash at the block's end. The plugin's heartbeat says so (WorkerStatus
    1.2), and the router's hashes then match the blocks vLLM reports; hashed per 32
    tokens, as before, they matched none."""
    import torch
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        SlidingWindowSpec,
    )

    from kvhint.engine_plugin.config import PluginConfig
    from kvhint.engine_plugin.core import PluginCore
    from kvhint.engine_plugin.headless import _block_hasher, _request_factory
    from kvhint.router.hashing import BlockHasher, HashConfig

    block, finer = 32, 16
    spec = {"num_kv_heads": 2, "head_size": 8, "dtype": torch.float32}
    config = KVCacheConfig(num_blocks=80, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["full"], FullAttentionSpec(block_size=block, **spec)),
        KVCacheGroupSpec(["window"], SlidingWindowSpec(block_size=block, sliding_window=64,
                                                       **spec))])
    config.hash_block_size = finer
    manager = KVCacheManager(kv_cache_config=config, max_model_len=80 * block,
                             scheduler_block_size=block, hash_block_size=finer,
                             enable_caching=True, log_stats=False,
                             enable_kv_cache_events=True)
    core = PluginCore.attach(manager, PluginConfig(worker_id="w0"))
    status = s.decode_status(s.encode_status(core.worker_status()))
    assert (status.block_size, status.hash_block_size) == (block, finer)
    hasher = BlockHasher(HashConfig.from_status(status))
    make_request = _request_factory(_block_hasher(finer))
    router = InMemoryClusterKvIndex()
    rng = random.Random(7)
    prefixes = [[rng.randrange(1, 500) for _ in range(block * rng.randint(1, 4))]
                for _ in range(4)]
    hits = 0
    for step in range(30):
        prompt = rng.choice(prefixes) + [rng.randrange(1, 500)
                                         for _ in range(rng.randint(3, 3 * block))]
        request = make_request(prompt)
        blocks, hit, _ = manager.get_computed_blocks(request)
        predicted = router.match_prefix(hasher.block_hashes(prompt)).of("w0").gpu_blocks
        assert min(predicted * block, (len(prompt) - 1) // block * block) == hit, step
        hits += hit > 0
        assert manager.allocate_slots(request, request.num_tokens - hit,
                                      num_new_computed_tokens=hit,
                                      new_computed_blocks=blocks) is not None
        request.num_computed_tokens = request.num_tokens
        manager.free(request)
        events = [e for e in manager.take_events() if getattr(e, "group_idx", 0) == 0]
        router.apply_all(EventBatchAdapter().convert_events("w0", events))
    assert hits > 5
    # The 1.1 reading (hashed per block) matches no block vLLM holds.
    old = BlockHasher(HashConfig(block_size=block))
    assert not any(router.locate(h) for p in prefixes for h in old.block_hashes(p))


def test_a_hash_block_size_that_does_not_divide_the_block_is_refused() -> None:
    from kvhint.router.hashing import BlockHasher, HashConfig, UnsupportedHashConfig

    with pytest.raises(UnsupportedHashConfig, match="does not divide"):
        BlockHasher(HashConfig(block_size=32, hash_block_size=12))
    # A status that names the block size itself reads as the 1.1 form.
    assert HashConfig.from_status(s.WorkerStatus(
        worker_id="w0", epoch="e1", model="m", cache_namespace="n", block_size=32,
        hash_algo="sha256", none_hash_seed="vllm-none-hash", supported_actions={},
        budgets=s.Budgets(max_pinned_blocks=0, max_pin_ttl_s=0, max_retained_blocks=0,
                          max_retain_ttl_s=0),
        usage=s.Usage(gpu_blocks_total=1, gpu_blocks_free=1, kv_usage=0.0),
        interval_s=1.0, at=0.0, hash_block_size=32)) == HashConfig(block_size=32)


def test_a_host_tier_reset_removal_is_of_the_followed_group() -> None:
    """A connector reset that left vLLM's GPU tier (one BlockRemoved naming every host
    copy, see connector_reset.py) names the followed group: as group 0's (vLLM's
    default), a hybrid model's plugin left it out of its stream and its index, and every
    router dropped it, so the host copies stayed in both views: false hits."""
    from kvhint.engine_plugin.index_events import Removed
    from kvhint.engine_plugin.vllm_adapter import HostTierReset

    worker = Worker(hybrid_manager(full_first=False))
    group = worker.adapter.event_group
    events = HostTierReset(group).events(False, [11, 12, 11], "CPU")
    assert worker.adapter.followed_events(events) == (events, 0)
    (removed,) = worker.adapter.index_events(events, group)
    assert isinstance(removed, Removed) and list(removed.hashes) == [11, 12, 11]
    (router_removed,) = EventBatchAdapter().convert_events("w0", events, group)
    assert list(router_removed.block_hashes) == [11, 12, 11]
