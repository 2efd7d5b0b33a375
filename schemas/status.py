"""Worker status heartbeat: engine plugin -> router on ``<prefix>.v1.status.<worker>``.

Sent every ``interval_s``; the router treats a worker as gone after a few missed beats
and resyncs when ``epoch`` changes. Everything the router needs to compute vLLM-compatible
block hashes for this worker is here (``block_size``, ``hash_algo``, ``none_hash_seed``).

Versions: 1.0 is the message without ``http_dp_rank``; 1.1 adds ``http_dp_rank``, the
``X-data-parallel-rank`` header value that reaches this worker (one data-parallel rank of a
vLLM server, each rank a worker of its own) through the OpenAI server at its address.
Absent or null: send no header (the server fronts this engine only). The field is off the
wire when the plugin has no header to ask for, so a single-rank worker sends the 1.0 form
byte for byte; a 1.0 router ignores the field (unknown fields are ignored) and reaches
every rank of such a server through vLLM's own balancing, as before; a 1.1 router reads
a 1.0 plugin's status as "no header". No new subject or action version: what a receiver
does without the field is what it did before. 1.2 adds ``hash_block_size``: the tokens
per hash of vLLM's block-hash chain when it is finer than ``block_size`` (a hybrid model
whose KV-cache groups have different block sizes, or ``prefix_match_unit``: vLLM hashes at
their greatest common divisor and names each cache block by the chain's hash at the
block's end). It is off the wire when it equals ``block_size``, so other workers send the
1.1 form byte for byte; a 1.2 router reads its absence as "equal". (A 1.1 router hashing
such a worker at ``block_size`` matched none of its blocks.) Each version has its golden
JSON (``tests/golden/worker_status.json`` 1.0, ``worker_status_v1_1.json`` 1.1,
``worker_status_v1_2.json`` 1.2). 1.3 adds ``claim_cost`` (:class:`ClaimCost`): the pool
blocks a Pin or Retain of n target positions takes on a hybrid model (sliding-window or
Mamba groups beside full attention: each claim also holds other groups' blocks), so a
router compares what it plans with ``budgets`` (pool blocks) in the same unit. Off the
wire on one-group models (a claim of n positions takes n pool blocks), which send the 1.2
form byte for byte; a 1.2 router ignores it (and plans hybrid workers' pins in positions,
over their budget: the worker clips); a 1.3 router reads its absence as "one block a
position" (``worker_status_v1_3.json``).

Every version's ``budgets`` are bounded (:data:`BudgetTtl`, :data:`BudgetBlocks`): TTLs in
(0, 86400] s, block budgets in [0, 2**40]; so is its ``usage`` (:data:`UsageCount`,
:data:`UsageShare`): counts in [0, 2**40], ``kv_usage`` in [0, 1]. The bounds are what
every plugin ever sent, so they refuse no valid message; a status outside them is
malformed (dropped and counted).
"""

from __future__ import annotations

import re
import time
import uuid
from typing import Annotated

import msgspec
from msgspec import UNSET, Meta, UnsetType

from kvhint.schemas._codec import decode_json, encode_json

# An epoch names one engine start: "<start, ms since 1970, 12 hex digits>-<8 hex random>".
# Its start orders epochs, so a router that hears an older engine's messages after a newer
# one's (JetStream history replayed at its start, a late snapshot reply) does not take
# them for a restart. Epochs of other forms (plugins before this one: 16 random hex
# digits) have no order.
_EPOCH = re.compile(r"([0-9a-f]{12})-[0-9a-f]{8}")
# Any epoch on the wire: 1-128 visible ASCII characters. An empty or odd one is a
# malformed message (dropped and counted), never an engine restart.
Epoch = Annotated[str, Meta(min_length=1, max_length=128, pattern=r"^[!-~]+$")]
_ANY_EPOCH = re.compile(r"[!-~]{1,128}")
# The heartbeat intervals a plugin may be configured with (its heartbeat_interval_s). The
# router takes a status's interval_s within them: it sets the worker's liveness window, so
# a tiny one would have a live worker purged between two beats, a huge one a dead
# worker's view trusted for ever.
MIN_HEARTBEAT_INTERVAL_S = 0.1
MAX_HEARTBEAT_INTERVAL_S = 300.0


def epoch_problem(epoch: str) -> str | None:
    """Why ``epoch`` cannot name an engine start, or None."""
    if _ANY_EPOCH.fullmatch(epoch):
        return None
    return f"epoch {epoch[:40]!r} is not 1-128 visible ASCII characters"


def new_epoch(now_s: float | None = None) -> str:
    started = time.time() if now_s is None else now_s
    return f"{int(started * 1000):012x}-{uuid.uuid4().hex[:8]}"


def epoch_started_ms(epoch: str) -> int | None:
    """When the engine of ``epoch`` started (ms), or None for an epoch without order."""
    match = _EPOCH.fullmatch(epoch)
    return int(match.group(1), 16) if match else None


def epoch_is_older(epoch: str, than: str) -> bool:
    """Whether ``epoch`` names an engine started before ``than``'s (False when either has
    no order, or both started in the same millisecond)."""
    a, b = epoch_started_ms(epoch), epoch_started_ms(than)
    return a is not None and b is not None and a < b


# Bounds of a heartbeat's budgets: a status outside them is malformed (dropped, counted as
# the ingest counter ``malformed_messages``; the worker is not heard from it). The router
# plans hints from them: a TTL of 0 or over a day, or a negative budget, made the planner
# send hints every worker refuses (and repeated refusals switch Pin/Retain off). Every
# plugin sends within them (its config: TTLs in [1, 86400] s, an older one's in
# (0, 86400]; block budgets are parts of its pool), so no valid message of any version
# is refused. A TTL's bound is a hint's (hints.MAX_TTL_S); a block budget's is more
# than any pool.
MAX_BUDGET_TTL_S = 86_400.0
MAX_BUDGET_BLOCKS = 2**40
BudgetBlocks = Annotated[int, Meta(ge=0, le=MAX_BUDGET_BLOCKS)]
BudgetTtl = Annotated[float, Meta(gt=0, le=MAX_BUDGET_TTL_S)]


class Budgets(msgspec.Struct, frozen=True, kw_only=True):
    max_pinned_blocks: BudgetBlocks
    max_pin_ttl_s: BudgetTtl
    max_retained_blocks: BudgetBlocks
    max_retain_ttl_s: BudgetTtl


# Bounds of a heartbeat's usage, as of its budgets (malformed outside them, counted the
# same): every count is of blocks, sessions or requests of one engine, in [0, 2**40];
# ``kv_usage`` is the used share of the GPU pool, in [0, 1] (the plugin sends
# ``1 - free / total``, rounded). Before, a negative or absurd figure was taken: shown on
# the dashboard and the admin API, stored with the worker's row, and a negative or absurd
# ``gpu_blocks_total`` turned off the hints API's check of ``prefix_tokens`` against the
# worker's pool. A usage above its budget is not refused: the router plans from its own
# ledger, never from these figures, and refusing the heartbeat would have the worker
# taken for dead.
UsageCount = Annotated[int, Meta(ge=0, le=MAX_BUDGET_BLOCKS)]
UsageShare = Annotated[float, Meta(ge=0.0, le=1.0)]


class Usage(msgspec.Struct, frozen=True, kw_only=True):
    gpu_blocks_total: UsageCount
    gpu_blocks_free: UsageCount
    kv_usage: UsageShare
    pinned_blocks: UsageCount = 0
    retained_blocks: UsageCount = 0
    host_blocks_used: UsageCount = 0
    indexed_blocks: UsageCount = 0
    sessions: UsageCount = 0
    active_requests: UsageCount = 0
    pending_hints: UsageCount = 0


class ClaimCost(msgspec.Struct, frozen=True, kw_only=True):
    """Status 1.3: what a Pin or Retain of ``n`` target positions holds in pool blocks,
    ``n * per_position + sum(min(n, tail) for tail in tails)`` (the plugin's
    ``engine_plugin/group_holds.py``): ``per_position`` blocks at each position (the
    followed full-attention group's and each other full-attention group's), and each
    sliding-window or Mamba group's blocks of the last ``tail`` positions before the hit
    point. An upper bound: blocks another claim holds already, or not resident, cost
    nothing more. The router's arithmetic: ``kvhint.router.policy.claim_cost``."""

    per_position: Annotated[int, Meta(ge=1, le=MAX_BUDGET_BLOCKS)]
    tails: list[Annotated[int, Meta(ge=1, le=MAX_BUDGET_BLOCKS)]] = []


class WorkerStatus(msgspec.Struct, frozen=True, kw_only=True):
    worker_id: str
    epoch: Epoch
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
    last_event_seq: Annotated[int, Meta(ge=0)] = 0
    interval_s: float
    at: float
    # Where the router reaches this worker's OpenAI server (a worker known only by its
    # heartbeat can then be routed to). None: the router must have it from its config.
    http_url: str | None = None
    # 1.1: the X-data-parallel-rank value that reaches this engine through that server
    # (module doc). UNSET (off the wire) or None: no header.
    http_dp_rank: Annotated[int, Meta(ge=0)] | None | UnsetType = UNSET
    # 1.2: the tokens per hash of vLLM's block-hash chain (module doc); UNSET: block_size.
    hash_block_size: Annotated[int, Meta(gt=0)] | UnsetType = UNSET
    # 1.3: pool blocks a claim of n positions takes (module doc); UNSET: n.
    claim_cost: ClaimCost | UnsetType = UNSET

    @property
    def data_parallel_header(self) -> int | None:
        """The X-data-parallel-rank to send this worker's requests with, or None."""
        rank = self.http_dp_rank
        return rank if isinstance(rank, int) else None


def encode_status(status: WorkerStatus) -> bytes:
    return encode_json(status)


def decode_status(data: bytes | str) -> WorkerStatus:
    return decode_json(data, WorkerStatus, "worker status")
