"""vLLM-compatible block hashes: the chain a worker's prefix cache is keyed by.

vLLM 0.32 (``vllm/v1/core/kv_cache_utils.py``) hashes every full block of
``block_size`` tokens as ``hash_fn((parent_hash or NONE_HASH, tuple(tokens), extra_keys))``
with ``parent_hash`` the previous block's full digest and ``NONE_HASH = hash_fn(seed)``.
The seed is ``PYTHONHASHSEED`` when the worker sets it, else ``"vllm-none-hash"`` for the
cryptographic algorithms (random and secret for xxhash, which we then cannot reproduce).
``extra_keys`` is ``None`` except on the first block of a salted request, where it is
``(("cache_salt", salt),)`` (``generate_block_hash_extra_keys``). KV events publish the low
64 bits of each digest as an unsigned int; that is what this module returns.

A hybrid model whose KV-cache groups have different block sizes (or one run with
``prefix_match_unit``) hashes the chain at a finer ``hash_block_size``, a divisor of the
block size, and names each cache block by the chain's hash at the block's end
(``BlockHashListWithBlockSize``): we hash at that size and keep every
``block_size // hash_block_size``-th hash.

Everything a router needs to pick the right parameters travels in the worker's status
heartbeat (``WorkerStatus.block_size``, ``hash_block_size``, ``hash_algo``,
``none_hash_seed``).
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvhint.router.hashing.errors import UnsupportedHashConfig

DEFAULT_NONE_HASH_SEED = "vllm-none-hash"
SUPPORTED_HASH_ALGOS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
_U64 = (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class HashConfig:
    """The parameters that make our hashes equal a worker's.

    ``none_hash_seed`` None means the worker's seed is secret (xxhash without
    ``PYTHONHASHSEED``): such a config is refused by :class:`BlockHasher`.
    ``hash_block_size`` None: the chain is hashed per block (``block_size``).
    """

    block_size: int
    hash_algo: str = "sha256"
    none_hash_seed: str | None = DEFAULT_NONE_HASH_SEED
    hash_block_size: int | None = None

    @classmethod
    def from_status(cls, status: Any) -> HashConfig:
        """From a ``kvhint.schemas.WorkerStatus`` (or anything with the same fields; a
        status without ``hash_block_size``, or with it UNSET, hashes per block)."""
        finer = getattr(status, "hash_block_size", None)
        return cls(block_size=status.block_size, hash_algo=status.hash_algo,
                   none_hash_seed=status.none_hash_seed,
                   hash_block_size=finer if isinstance(finer, int)
                   and finer != status.block_size else None)


def _pickle_serialize(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def _cbor_serializer() -> Callable[[Any], bytes]:
    try:
        import cbor2
    except ImportError as exc:
        raise UnsupportedHashConfig(
            "hash_algo sha256_cbor/xxhash_cbor needs the 'cbor2' package in the router"
        ) from exc

    def serialize(obj: Any) -> bytes:
        return cbor2.dumps(obj, canonical=True)

    return serialize


def _xxhash_digest() -> Callable[[bytes], bytes]:
    try:
        import xxhash
    except ImportError as exc:
        raise UnsupportedHashConfig(
            "hash_algo xxhash/xxhash_cbor needs the 'xxhash' package in the router"
        ) from exc
    if not hasattr(xxhash, "xxh3_128_digest"):
        raise UnsupportedHashConfig("the installed xxhash has no xxh3_128_digest")
    return xxhash.xxh3_128_digest


def _sha256_digest(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def _resolve(config: HashConfig) -> tuple[Callable[[Any], bytes], Callable[[bytes], bytes]]:
    if config.block_size <= 0:
        raise UnsupportedHashConfig(f"block_size must be positive, got {config.block_size}")
    finer = config.hash_block_size
    if finer is not None and (finer <= 0 or config.block_size % finer):
        raise UnsupportedHashConfig(
            f"hash_block_size {finer} does not divide block_size {config.block_size}")
    if config.hash_algo not in SUPPORTED_HASH_ALGOS:
        raise UnsupportedHashConfig(
            f"cannot reproduce hash_algo {config.hash_algo!r}; supported: "
            + ", ".join(SUPPORTED_HASH_ALGOS))
    if config.none_hash_seed is None:
        raise UnsupportedHashConfig(
            f"worker's NONE_HASH seed for {config.hash_algo} is secret (random per process); "
            "set PYTHONHASHSEED on the worker or use sha256")
    serialize = _cbor_serializer() if config.hash_algo.endswith("_cbor") else _pickle_serialize
    digest = _xxhash_digest() if config.hash_algo.startswith("xxhash") else _sha256_digest
    return serialize, digest


class BlockHasher:
    """Hashes token sequences into vLLM's block-hash chain for one :class:`HashConfig`.

    Immutable after construction (safe to share); raises :class:`UnsupportedHashConfig`
    at construction for a config it cannot reproduce.
    """

    def __init__(self, config: HashConfig) -> None:
        self.config = config
        self._serialize, self._digest = _resolve(config)
        self._none_hash = self._digest(self._serialize(config.none_hash_seed))

    @property
    def block_size(self) -> int:
        return self.config.block_size

    def digest_chain(self, token_ids: Sequence[int], cache_salt: str | None = None
                     ) -> list[bytes]:
        """Full digests of every full block (what vLLM chains with): the chain's digest
        at each block's end, the chain hashed per ``hash_block_size`` when that is set."""
        finer = self.config.hash_block_size
        if finer is None:
            return self._chain(token_ids, cache_salt, self.config.block_size)
        step = self.config.block_size // finer
        return self._chain(token_ids, cache_salt, finer)[step - 1::step]

    def _chain(self, token_ids: Sequence[int], cache_salt: str | None, size: int
               ) -> list[bytes]:
        serialize, digest = self._serialize, self._digest
        parent = self._none_hash
        salt_keys = (("cache_salt", cache_salt),) if cache_salt else None
        out: list[bytes] = []
        for start in range(0, len(token_ids) - size + 1, size):
            extra = salt_keys if start == 0 else None
            parent = digest(serialize((parent, tuple(token_ids[start:start + size]), extra)))
            out.append(parent)
        return out

    def block_hashes(self, token_ids: Sequence[int], cache_salt: str | None = None
                     ) -> list[int]:
        """The 64-bit hashes vLLM publishes in KV events, one per full block (a trailing
        partial block is not hashed, as in vLLM)."""
        return [int.from_bytes(d, "big") & _U64 for d in self.digest_chain(token_ids, cache_salt)]
