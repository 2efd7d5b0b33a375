"""Worker status heartbeat: engine plugin -> router on ``<prefix>.v1.status.<worker>``.

Sent every ``interval_s``; the router treats a worker as gone after a few missed beats
and resyncs when ``epoch`` changes. Everything the router needs to compute vLLM-compatible
block hashes for this worker is here (``block_size``, ``hash_algo``, ``none_hash_seed``).
"""

from __future__ import annotations

import msgspec

from kvhint.schemas._codec import decode_json, encode_json


class Budgets(msgspec.Struct, frozen=True, kw_only=True):
    max_pinned_blocks: int
    max_pin_ttl_s: float
    max_retained_blocks: int
    max_retain_ttl_s: float


class Usage(msgspec.Struct, frozen=True, kw_only=True):
    gpu_blocks_total: int
    gpu_blocks_free: int
    kv_usage: float
    pinned_blocks: int = 0
    retained_blocks: int = 0
    host_blocks_used: int = 0
    indexed_blocks: int = 0
    sessions: int = 0
    active_requests: int = 0
    pending_hints: int = 0


class WorkerStatus(msgspec.Struct, frozen=True, kw_only=True):
    worker_id: str
    epoch: str
    model: str
    # Blocks are comparable across workers only within one namespace: same model,
    # block size, hash algorithm and seed.
    cache_namespace: str
    block_size: int
    hash_algo: str
    # Seed of vLLM's NONE_HASH; None when it is secret (non-cryptographic hashes).
    none_hash_seed: str | None
    data_parallel_rank: int = 0
    supported_actions: dict[str, list[str]]
    host_tier: bool = False
    budgets: Budgets
    usage: Usage
    last_event_seq: int = 0
    interval_s: float
    at: float
    # Where the router reaches this worker's OpenAI server (a worker known only by its
    # heartbeat can then be routed to). None: the router must have it from its config.
    http_url: str | None = None


def encode_status(status: WorkerStatus) -> bytes:
    return encode_json(status)


def decode_status(data: bytes | str) -> WorkerStatus:
    return decode_json(data, WorkerStatus, "worker status")
