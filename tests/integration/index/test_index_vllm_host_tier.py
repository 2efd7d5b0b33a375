"""The host (CPU) tier against vLLM's real event producers: the offloading connector's
``OffloadingEventsTracker`` (self-describing events, vLLM 0.32) announces a hash once per
chunk holding it and fans a chunk's eviction out to all of its hashes, and the GPU
``BlockPool``'s prefix-cache reset emits a medium-less ``AllBlocksCleared`` while the host
tier keeps its chunks. The index, fed those events through the adapter, must hold what the
host tier holds.

The tracker translates the ``OffloadingEvent``s of vLLM's own ``CPUOffloadingManager``
(one store per chunk key when its copy completes, one removal per key it evicts), driven
as the scheduler side drives it; only the copies (CUDA streams) are not run, as in
``router/sim/host_tier.py``."""

from __future__ import annotations

import pytest

from kvhint.router.kv_index import (
    EventBatchAdapter,
    InMemoryClusterKvIndex,
    NaiveClusterKvIndex,
    WorkerOverlap,
)

BLOCK = 16
HASHES_PER_CHUNK = 4


@pytest.fixture
def vllm_request_hasher():  # noqa: ANN201
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils as kcu

    hash_fn = get_hash_fn_by_name("sha256")
    kcu.init_none_hash(hash_fn)
    return kcu.get_request_block_hasher(BLOCK, hash_fn)


def _request(request_id: str, tokens: list[int], hasher):  # noqa: ANN001, ANN202
    from vllm import SamplingParams
    from vllm.v1.request import Request

    return Request(request_id=request_id, prompt_token_ids=tokens,
                   sampling_params=SamplingParams(max_tokens=1), pooling_params=None,
                   block_hasher=hasher)


class HostTier:
    """vLLM's CPU offloading manager and the connector's events tracker, driven as the
    connector's scheduler side drives them for a request's first chunk."""

    def __init__(self, num_chunks: int) -> None:
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.events import (
            OffloadingEventGroupSpec,
            OffloadingEventsTracker,
        )
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (
            GroupOffloadConfig,
        )
        from vllm.v1.kv_offload.base import OffloadingKVEventsConfig
        from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

        self.manager = CPUOffloadingManager(num_chunks=num_chunks, cache_policy="lru",
                                            enable_events=True)
        self.tracker = OffloadingEventsTracker(OffloadingKVEventsConfig(
            enable_kv_cache_events=True, self_describing_kv_events=True))
        # One full-attention group, chunks of 4 blocks.
        self.group = GroupOffloadConfig(
            group_idx=0, tokens_per_block=BLOCK, tokens_per_chunk=BLOCK * HASHES_PER_CHUNK,
            hashes_per_chunk=HASHES_PER_CHUNK,
            kv_event_group_spec=OffloadingEventGroupSpec("full_attention", None),
            sliding_window_size_in_chunks=None, kv_cache_spec=None, manager_cls=None)

    def offload_first_chunk(self, req) -> list[object]:  # noqa: ANN001
        """Copy the request's first chunk to the host; the KV events that come of it."""
        from vllm.v1.kv_offload.base import ReqContext, make_offload_key

        key = make_offload_key(req.block_hashes[HASHES_PER_CHUNK - 1], 0)
        self.tracker.record_store(req, self.group, 0, key)
        ctx = ReqContext(req_id=req.request_id)
        self.manager.on_new_request(ctx)
        out = self.manager.prepare_store([key], ctx)
        assert out is not None and out.keys_to_store == [key]
        self.manager.complete_store(out.keys_to_store, ctx)
        self.manager.on_request_finished(ctx)
        return list(self.tracker.take_events(self.manager.take_events()))


@pytest.mark.parametrize("impl", [InMemoryClusterKvIndex, NaiveClusterKvIndex])
def test_chunks_sharing_a_prefix_keep_it_on_the_host_until_the_last_goes(
        impl: type, vllm_request_hasher) -> None:  # noqa: ANN001
    host = HostTier(num_chunks=2)
    adapter, index = EventBatchAdapter(), impl()
    shared = list(range(100, 100 + 2 * BLOCK))  # two blocks: half a chunk
    seen: list[tuple[str, str, tuple[int, ...]]] = []

    def offload(request_id: str, tokens: list[int]) -> list[int]:
        events = host.offload_first_chunk(_request(request_id, tokens, vllm_request_hasher))
        index.apply_all(adapter.convert_events("w0", events))
        seen.extend((type(e).__name__, e.medium, tuple(e.block_hashes)) for e in events)
        return list(events[-1].block_hashes)

    a = offload("a", shared + list(range(500, 500 + 2 * BLOCK)))
    b = offload("b", shared + list(range(900, 900 + 2 * BLOCK)))
    # vLLM's own events: the shared hashes announced once per chunk, medium "CPU".
    assert a[:2] == b[:2] and a[2:] != b[2:]
    assert seen == [("BlockStored", "CPU", tuple(a)), ("BlockStored", "CPU", tuple(b))]
    # A third chunk: the host holds two, so the least recently used (a's) is evicted,
    # and its removal names all four of its hashes.
    c = offload("c", list(range(2000, 2000 + HASHES_PER_CHUNK * BLOCK)))
    assert seen[2:] == [("BlockRemoved", "CPU", tuple(a)), ("BlockStored", "CPU", tuple(c))]
    # Chunk b still holds the shared blocks: the index must too (before: dropped).
    assert index.tier_prefix(b, "CPU") == {"w0": 4}
    assert not index.has_block("w0", a[2]) and index.worker_block_counts("w0") == {"CPU": 8}


def test_a_prefix_cache_reset_leaves_the_host_tier(vllm_request_hasher) -> None:  # noqa: ANN001
    from kvhint.engine_plugin.headless import build_kv_cache_manager
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    cache = build_kv_cache_manager(block_size=BLOCK, num_blocks=32)
    req = cache.make_request(list(range(300, 300 + HASHES_PER_CHUNK * BLOCK + 1)))
    assert cache.admit(req) is not None
    cache.finish(req)
    events = cache.manager.take_events()
    events += HostTier(num_chunks=4).offload_first_chunk(req)
    assert cache.manager.reset_prefix_cache()
    events += cache.manager.take_events()  # vLLM's AllBlocksCleared, no medium
    assert type(events[-1]).__name__ == "AllBlocksCleared"
    index = InMemoryClusterKvIndex()
    index.apply_all(EventBatchAdapter().convert_events("w0", events))
    chain = [maybe_convert_block_hash(h) for h in req.block_hashes[:HASHES_PER_CHUNK]]
    # GPU gone (vLLM's pool holds no hash now), the host copy stays loadable.
    assert not any(index.has_block("w0", h, "GPU") for h in chain)
    assert index.match_prefix(chain).of("w0") == WorkerOverlap(0, HASHES_PER_CHUNK)
