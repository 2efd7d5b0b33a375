"""BlockHasher rules that need no vLLM (equality with vLLM's own hasher is in
tests/integration/index, with a real server's events in tests/e2e/index)."""

from __future__ import annotations

import hashlib
import pickle

import pytest

from kvhint.router.hashing import (
    DEFAULT_NONE_HASH_SEED,
    BlockHasher,
    HashConfig,
    UnsupportedHashConfig,
)
from kvhint.schemas import Budgets, Usage, WorkerStatus


def test_first_block_is_sha256_of_pickled_none_hash_tokens_and_extra_keys() -> None:
    none_hash = hashlib.sha256(pickle.dumps("vllm-none-hash", pickle.HIGHEST_PROTOCOL)).digest()
    first = hashlib.sha256(pickle.dumps((none_hash, (1, 2, 3, 4), None),
                                        pickle.HIGHEST_PROTOCOL)).digest()
    hasher = BlockHasher(HashConfig(block_size=4))
    assert hasher.digest_chain([1, 2, 3, 4]) == [first]
    assert hasher.block_hashes([1, 2, 3, 4]) == [int.from_bytes(first, "big") & (2**64 - 1)]


def test_only_full_blocks_are_hashed_and_the_chain_is_prefix_stable() -> None:
    hasher = BlockHasher(HashConfig(block_size=4))
    tokens = list(range(11))
    assert len(hasher.block_hashes(tokens)) == 2
    assert hasher.block_hashes(tokens[:8]) == hasher.block_hashes(tokens)
    assert hasher.block_hashes(tokens[:3]) == []
    other = hasher.block_hashes([0, 1, 2, 3, 9, 9, 9, 9])
    assert other[0] == hasher.block_hashes(tokens)[0] and other[1] != hasher.block_hashes(tokens)[1]


def test_cache_salt_keys_the_first_block_and_so_the_whole_chain() -> None:
    hasher = BlockHasher(HashConfig(block_size=4))
    tokens = list(range(12))
    plain, a, b = (hasher.block_hashes(tokens, salt) for salt in (None, "a", "b"))
    assert len({plain[0], a[0], b[0]}) == 3
    assert all(x != y for x, y in zip(plain[1:], a[1:]))
    assert hasher.block_hashes(tokens, "") == plain  # an empty salt is no salt, as in vLLM


def test_seed_algorithm_and_block_size_change_the_hashes() -> None:
    tokens = list(range(8))
    base = BlockHasher(HashConfig(4)).block_hashes(tokens)
    assert BlockHasher(HashConfig(4, none_hash_seed="123")).block_hashes(tokens) != base
    assert BlockHasher(HashConfig(4, "sha256_cbor")).block_hashes(tokens) != base
    assert BlockHasher(HashConfig(8)).block_hashes(tokens)[0] != base[1]


@pytest.mark.parametrize("config, message", [
    (HashConfig(0), "block_size must be positive"),
    (HashConfig(16, "md5"), "cannot reproduce hash_algo 'md5'"),
    (HashConfig(16, "xxhash", None), "secret"),
])
def test_unreproducible_configs_are_refused(config: HashConfig, message: str) -> None:
    with pytest.raises(UnsupportedHashConfig, match=message):
        BlockHasher(config)


def test_config_from_worker_status() -> None:
    status = WorkerStatus(
        worker_id="w0", epoch="e", model="m", cache_namespace="ns", block_size=64,
        hash_algo="sha256_cbor", none_hash_seed="42", supported_actions={},
        budgets=Budgets(max_pinned_blocks=0, max_pin_ttl_s=0, max_retained_blocks=0,
                        max_retain_ttl_s=0),
        usage=Usage(gpu_blocks_total=1, gpu_blocks_free=1, kv_usage=0), interval_s=1, at=0)
    assert HashConfig.from_status(status) == HashConfig(64, "sha256_cbor", "42")
    assert HashConfig(16).none_hash_seed == DEFAULT_NONE_HASH_SEED
