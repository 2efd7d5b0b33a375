"""xxhash / xxhash_cbor block hashes against vLLM's real code (``vllm.utils.hashing``,
``kv_cache_utils.init_none_hash`` / ``resolve_none_hash_seed`` and the request block
hasher): the seed the engine plugin reports in its WorkerStatus, taken by the router
through ``HashConfig.from_status``, gives vLLM's block hashes; without PYTHONHASHSEED the
seed is random per process, the plugin reports it as secret (None) and the router refuses.

vLLM's NONE_HASH is module-level state: every test here restores it (and the seed it was
derived from) afterwards, so other tests see the state they had."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest

from kvhint.router.hashing import BlockHasher, HashConfig, UnsupportedHashConfig
from kvhint.schemas import Budgets, Usage, WorkerStatus

U64 = (1 << 64) - 1
ALGOS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
_MISSING = object()


@pytest.fixture()
def kcu(monkeypatch: pytest.MonkeyPatch) -> Iterator[object]:
    """vLLM's kv_cache_utils with its NONE_HASH globals put back after the test (the
    environment through monkeypatch)."""
    from vllm.v1.core import kv_cache_utils

    saved = (getattr(kv_cache_utils, "NONE_HASH", _MISSING), kv_cache_utils._NONE_HASH_SEED)
    try:
        yield kv_cache_utils
    finally:
        if saved[0] is _MISSING:
            if hasattr(kv_cache_utils, "NONE_HASH"):
                del kv_cache_utils.NONE_HASH
        else:
            kv_cache_utils.NONE_HASH = saved[0]
        kv_cache_utils._NONE_HASH_SEED = saved[1]


def _set_seed(monkeypatch: pytest.MonkeyPatch, seed: str | None) -> None:
    if seed is None:
        monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    else:
        monkeypatch.setenv("PYTHONHASHSEED", seed)


def _status(algo: str, block_size: int, seed: str | None) -> WorkerStatus:
    return WorkerStatus(
        worker_id="w0", epoch="e", model="m", cache_namespace="ns", block_size=block_size,
        hash_algo=algo, none_hash_seed=seed, supported_actions={},
        budgets=Budgets(max_pinned_blocks=0, max_pin_ttl_s=0, max_retained_blocks=0,
                        max_retain_ttl_s=0),
        usage=Usage(gpu_blocks_total=1, gpu_blocks_free=1, kv_usage=0), interval_s=1, at=0)


def _vllm_hashes(kcu, hash_fn, block: int, tokens: list[int], salt: str | None) -> list[bytes]:
    from vllm import SamplingParams
    from vllm.v1.request import Request

    req = Request(request_id="r", prompt_token_ids=tokens,
                  sampling_params=SamplingParams(max_tokens=1), pooling_params=None,
                  block_hasher=kcu.get_request_block_hasher(block, hash_fn), cache_salt=salt)
    return list(req.block_hashes)


@pytest.mark.parametrize("algo", ["xxhash", "xxhash_cbor"])
@pytest.mark.parametrize("seed", ["12345", "0", ""])
def test_router_hashes_equal_vllm_for_the_seed_the_plugin_reports(
        algo: str, seed: str, kcu, monkeypatch: pytest.MonkeyPatch) -> None:
    """Whole prompts of several blocks, with and without cache salt, per block and at a
    finer hash_block_size; the router's config comes from the plugin's report."""
    from vllm.utils.hashing import get_hash_fn_by_name

    from kvhint.engine_plugin.vllm_adapter.engine import none_hash_seed

    _set_seed(monkeypatch, seed)
    hash_fn = get_hash_fn_by_name(algo)
    kcu.init_none_hash(hash_fn)
    reported = none_hash_seed(algo)
    assert reported == seed == kcu.get_none_hash_seed()
    block, finer = 16, 8
    ours = BlockHasher(HashConfig.from_status(_status(algo, block, reported)))
    ours_finer = BlockHasher(HashConfig(block, algo, reported, hash_block_size=finer))
    rng = random.Random(7)
    for salt in (None, "tenant-a", "tenant-b"):
        for n_blocks in (1, 3, 6):
            tokens = [rng.randrange(0, 150_000) for _ in range(block * n_blocks + 5)]
            theirs = _vllm_hashes(kcu, hash_fn, block, tokens, salt)
            assert len(theirs) == n_blocks
            assert ours.digest_chain(tokens, salt) == theirs
            assert ours.block_hashes(tokens, salt) == [
                int.from_bytes(h, "big") & U64 for h in theirs]
            fine = _vllm_hashes(kcu, hash_fn, finer, tokens, salt)
            assert ours_finer.digest_chain(tokens, salt) == fine[block // finer - 1::block // finer]


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("seed", [None, "4242"])
def test_plugin_reports_the_seed_vllm_resolves_or_none_when_it_is_secret(
        algo: str, seed: str | None, kcu, monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.utils.hashing import get_hash_fn_by_name

    from kvhint.engine_plugin.vllm_adapter.engine import none_hash_seed

    _set_seed(monkeypatch, seed)
    hash_fn = get_hash_fn_by_name(algo)
    reported = none_hash_seed(algo)
    resolved = {kcu.resolve_none_hash_seed(hash_fn) for _ in range(3)}
    if seed is None and algo.startswith("xxhash"):
        assert len(resolved) == 3  # random per process: nothing the router could follow
        assert reported is None
        with pytest.raises(UnsupportedHashConfig, match="secret"):
            BlockHasher(HashConfig.from_status(_status(algo, 16, reported)))
    else:
        assert resolved == {reported}


def test_without_pythonhashseed_two_xxhash_workers_hash_apart(
        kcu, monkeypatch: pytest.MonkeyPatch) -> None:
    """Why the router refuses: two vLLM processes hashing with xxhash and no
    PYTHONHASHSEED (two init_none_hash calls here) name the same prompt differently, and
    neither matches a router hashing with vLLM's default seed."""
    from vllm.utils.hashing import get_hash_fn_by_name

    _set_seed(monkeypatch, None)
    hash_fn = get_hash_fn_by_name("xxhash")
    tokens = list(range(48))
    chains = []
    for _ in range(2):
        kcu.init_none_hash(hash_fn)
        chains.append(_vllm_hashes(kcu, hash_fn, 16, tokens, None))
    guess = BlockHasher(HashConfig(16, "xxhash")).digest_chain(tokens)
    assert chains[0] != chains[1] and guess not in chains
