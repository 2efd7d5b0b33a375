"""Against vLLM's real KVCacheManager (scheduler side, no model): the index fed with the
manager's own events, encoded as vLLM's publisher encodes them, mirrors the block pool and
predicts vLLM's prefix hits; our block hasher equals vLLM's request hasher."""

from __future__ import annotations

import random

import msgspec
import pytest

from kvhint import schemas as s
from kvhint.router.hashing import BlockHasher, HashConfig, UnsupportedHashConfig
from kvhint.router.kv_index import (
    EventBatchAdapter,
    InMemoryClusterKvIndex,
    KvEventIngestor,
    NaiveClusterKvIndex,
    RequestSnapshot,
)

U64 = (1 << 64) - 1


def cached_hashes(block_pool) -> set[int]:
    """The hashes vLLM's prefix cache holds right now, as KV events name them."""
    keys = block_pool.cached_block_hash_to_block._cache  # BlockHashWithGroupId: digest + group
    return {int.from_bytes(key[:-4], "big") & U64 for key in keys}


class Publisher:
    """Encodes the manager's events like vLLM's ZmqEventPublisher and feeds the ingestor."""

    def __init__(self, manager, ingestor: KvEventIngestor, worker: str = "w0") -> None:
        from vllm.distributed.kv_events import KVEventBatch

        self._batch_cls = KVEventBatch
        self._encoder = msgspec.msgpack.Encoder()
        self.manager, self.ingestor, self.worker, self.seq = manager, ingestor, worker, 0
        self.raw_events: list[object] = []

    def flush(self) -> None:
        events = self.manager.take_events()
        if not events:
            return
        self.raw_events += events
        self.seq += 1
        payload = self._encoder.encode(self._batch_cls(ts=0.0, events=events))
        meta = s.EventBatchMeta(self.worker, "e1", self.seq)
        actions = self.ingestor.on_event_message(meta.to_headers(), payload)
        assert not any(isinstance(a, RequestSnapshot) for a in actions)


def test_index_mirrors_vllm_block_pool_and_predicts_its_hits() -> None:
    from kvhint.engine_plugin.headless import build_kv_cache_manager

    block = 32
    hc = build_kv_cache_manager(block_size=block, num_blocks=48)
    index = InMemoryClusterKvIndex()
    ingestor = KvEventIngestor(index, clock=lambda: 0.0)
    pub = Publisher(hc.manager, ingestor)
    hasher = BlockHasher(HashConfig(block_size=block))
    rng = random.Random(5)
    prefixes = [[rng.randrange(1, 500) for _ in range(block * rng.randint(1, 4))]
                for _ in range(4)]
    checked_hits = 0
    for step in range(80):
        prompt = rng.choice(prefixes) + [rng.randrange(1, 500)
                                         for _ in range(rng.randint(5, 5 * block))]
        req = hc.make_request(prompt, session_id=f"t/s{step % 7}")
        # Prediction from the index, with hashes computed by the router's own hasher.
        ours = hasher.block_hashes(prompt)
        assert ours == [int.from_bytes(h, "big") & U64 for h in req.block_hashes]
        predicted = index.match_prefix(ours).of("w0").gpu_blocks * block
        expected = hc.lookup_hit_tokens(req)
        assert min(predicted, len(prompt) - 1) // block * block == expected
        checked_hits += expected > 0
        if hc.admit(req) is None:
            continue
        hc.append_tokens(req, [rng.randrange(1, 500) for _ in range(rng.randint(0, block))])
        hc.finish(req)
        if step == 50:
            assert hc.manager.reset_prefix_cache()  # AllBlocksCleared
        pub.flush()
        assert index.export_state().blocks.get("w0", {}).get("GPU", frozenset()) == \
            cached_hashes(hc.block_pool)
    assert checked_hits > 10, "the workload should produce prefix hits"
    stats = index.stats()
    assert stats.removed_blocks > 50 and stats.cleared_workers == 1  # evictions happened
    assert ingestor.stats().stream["batches_applied"] == pub.seq

    # The simulator path: vLLM's own event objects straight into the adapter.
    direct = NaiveClusterKvIndex()
    direct.apply_all(EventBatchAdapter().convert_events("w0", pub.raw_events))
    assert direct.export_state() == index.export_state()


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor"])
@pytest.mark.parametrize("seed", [None, "12345"])
def test_block_hasher_equals_vllm_request_hasher(algo: str, seed: str | None,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils as kcu
    from vllm.v1.request import Request

    hash_fn = get_hash_fn_by_name(algo)
    if seed is None:
        monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    else:
        monkeypatch.setenv("PYTHONHASHSEED", seed)
    kcu.init_none_hash(hash_fn)
    try:
        block = 16
        vllm_hasher = kcu.get_request_block_hasher(block, hash_fn)
        ours = BlockHasher(HashConfig(block, algo, kcu.get_none_hash_seed()))
        rng = random.Random(1)
        for salt in (None, "tenant-a", "tenant-b"):
            tokens = [rng.randrange(0, 50_000) for _ in range(block * 5 + 3)]
            req = Request(request_id="r", prompt_token_ids=tokens,
                          sampling_params=SamplingParams(max_tokens=1), pooling_params=None,
                          block_hasher=vllm_hasher, cache_salt=salt)
            assert ours.digest_chain(tokens, salt) == list(req.block_hashes)
            assert ours.block_hashes(tokens, salt) == [
                kcu.maybe_convert_block_hash(h) for h in req.block_hashes]
    finally:
        monkeypatch.delenv("PYTHONHASHSEED", raising=False)
        kcu.init_none_hash(get_hash_fn_by_name("sha256"))


def test_secret_seed_is_refused() -> None:
    with pytest.raises(UnsupportedHashConfig, match="secret"):
        BlockHasher(HashConfig(32, "xxhash", None))


def test_predicted_cached_tokens_are_vllms_hit_for_whole_and_partial_block_prompts() -> None:
    """A fully cached prompt of whole blocks hits one block less in vLLM (the hit is
    whole blocks short of the last token); the router predicted a block less one token
    (31 of a 32-token prompt at block 16, where vLLM hits 16)."""
    from kvhint.engine_plugin.headless import build_kv_cache_manager
    from kvhint.router.policy import Overlap, cached_tokens

    block = 16
    cache = build_kv_cache_manager(block_size=block, num_blocks=64)
    for tokens in (2 * block, 2 * block + 1, 4 * block, 4 * block + 7):
        prompt = list(range(1000 * tokens, 1000 * tokens + tokens))
        first = cache.make_request(prompt)
        cache.admit(first)
        cache.finish(first)
        predicted, _host = cached_tokens(Overlap(tokens // block), tokens, block)
        assert predicted == cache.lookup_hit_tokens(cache.make_request(prompt)), tokens
