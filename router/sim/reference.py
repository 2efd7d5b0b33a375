"""Reference lines: what any cache of the same size could do on the trace.

Block-level models over the trace's prompt blocks with vLLM's hit rules (only full
blocks are cached; a hit is the longest cached prefix of full blocks, whole blocks only,
leaving at least the last prompt token to compute: at most ``(input_length - 1) //
block_size`` blocks). No routing, no queueing: one pool, requests in arrival
order, each request's blocks cached the moment it arrives.

- ``unbounded``: every block ever seen stays cached.
- ``oracle``: Belady's furthest-next-use eviction over ``capacity_blocks`` (the
  optimum for a single pool with known future; with prefix chains a parent's next use is
  never later than its child's, so it evicts leaves first). It may also decline to cache a
  block whose next use is furthest, as Belady does.

Block identity is the whole prefix chain (ids interned per (parent, id)), so a trace
whose ids are only unique per position is still read correctly.
"""

from __future__ import annotations

import heapq
import math

from kvhint.router.sim.results import ReferenceResult
from kvhint.router.sim.trace import Trace


def _chains(trace: Trace) -> list[list[int]]:
    """Per request, the interned chain keys of its full prompt blocks."""
    interned: dict[tuple[int, int], int] = {}
    chains = []
    block_size = trace.block_size
    for request in trace.requests:
        parent = -1
        keys = []
        for block_id in request.block_ids[: request.full_blocks(block_size)]:
            key = interned.setdefault((parent, block_id), len(interned))
            keys.append(key)
            parent = key
        chains.append(keys)
    return chains


def _hit_tokens(matched_blocks: int, input_length: int, block_size: int) -> int:
    """vLLM's hit: whole cached blocks only, and never the last prompt token (it is
    recomputed for the first output), so at most (input_length - 1) // block_size blocks."""
    return min(matched_blocks, max(input_length - 1, 0) // block_size) * block_size


def unbounded(trace: Trace) -> ReferenceResult:
    hits = unbounded_hit_tokens(trace)
    return ReferenceResult("unbounded", None, sum(r.input_length for r in trace.requests),
                           sum(hits))


def unbounded_hit_tokens(trace: Trace) -> list[int]:
    """Per request (trace order), the tokens an unbounded cache serves it."""
    seen: set[int] = set()
    hits = []
    for request, keys in zip(trace.requests, _chains(trace), strict=True):
        matched = 0
        for key in keys:
            if key not in seen:
                break
            matched += 1
        hits.append(_hit_tokens(matched, request.input_length, trace.block_size))
        seen.update(keys)
    return hits


def oracle(trace: Trace, capacity_blocks: int) -> ReferenceResult:
    """Belady (furthest next use) over one pool of ``capacity_blocks`` blocks."""
    hits = oracle_hit_tokens(trace, capacity_blocks)
    return ReferenceResult("oracle", capacity_blocks,
                           sum(r.input_length for r in trace.requests), sum(hits))


def oracle_hit_tokens(trace: Trace, capacity_blocks: int) -> list[int]:
    """Per request (trace order), the tokens :func:`oracle`'s pool serves it."""
    if capacity_blocks <= 0:
        raise ValueError("capacity_blocks must be > 0")
    chains = _chains(trace)
    # next_use[i][j]: the next request index after i that uses chains[i][j] (inf: never).
    next_use: list[list[float]] = [[] for _ in chains]
    upcoming: dict[int, float] = {}
    for i in range(len(chains) - 1, -1, -1):
        keys = chains[i]
        next_use[i] = [upcoming.get(k, math.inf) for k in keys]
        for key in keys:
            upcoming[key] = i
    cached: dict[int, float] = {}  # key -> its next use
    heap: list[tuple[float, int, int]] = []  # (-next_use, -depth, key), lazily invalidated
    hits = []
    for i, (request, keys) in enumerate(zip(trace.requests, chains, strict=True)):
        matched = 0
        for key in keys:
            if key not in cached:
                break
            matched += 1
        hits.append(_hit_tokens(matched, request.input_length, trace.block_size))
        for depth, (key, nxt) in enumerate(zip(keys, next_use[i], strict=True)):
            cached[key] = nxt
            heapq.heappush(heap, (-nxt, -depth, key))
        while len(cached) > capacity_blocks:
            neg_next, _, key = heapq.heappop(heap)
            if cached.get(key) == -neg_next:
                del cached[key]
    return hits
