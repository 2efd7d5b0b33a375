"""Routing: choose a worker for one request from a frozen view of the fleet.

Pure: :func:`route` reads a :class:`RoutingContext` (built by the caller from the cluster
KV index and its own load bookkeeping), a :class:`RouteRequest` and a seeded
``random.Random`` used only to break exact ties; it does no I/O and keeps no state. The
live router and the simulator call the same function.

Cost model (lower is better), in prompt tokens a worker would have to compute::

    new_tokens(w)   = prompt_tokens - cached tokens on w (G1 prefix, then G2 continuation)
    host_tokens(w)  = tokens of that prefix that sit only in the host tier (G2)
    cost(w)         = new_tokens(w) + host_load_cost * host_tokens(w)
                      + queue_weight * pending_prefill_tokens(w)
                      + balance_weight * (recent_prefill_tokens(w) - min over workers)

``kv_aware`` is the public KV-router formula (overlap plus load, no hints, no session
knowledge): ``prefill blocks to compute + active decode blocks``. ``kvhint`` uses the cost
above plus *bounded* session affinity: a session stays on its worker while that worker's
recent load is within ``affinity_slack`` of the fleet mean, and a worker whose recent load
exceeds the mean by more than ``balance_cap`` (``affinity_cap`` for the session's own
worker, and by more than the tokens the request has cached there: a move recomputes them)
is only chosen when every worker does. A new session's first turn also pays
``new_session_spread x prompt_tokens`` per recently placed session above the least-loaded
worker's count, so long-lived sessions spread instead of clustering on a shared prefix.
"""

from __future__ import annotations

import enum
import random
from collections.abc import Mapping
from dataclasses import dataclass, field


class RoutingPolicy(str, enum.Enum):
    ROUND_ROBIN = "round_robin"
    SESSION_AFFINITY = "session_affinity"
    KV_AWARE = "kv_aware"
    KVHINT = "kvhint"


@dataclass(frozen=True, slots=True)
class Overlap:
    """The request's longest cached prefix on one worker, in whole blocks.

    ``gpu_blocks``: consecutive prompt blocks from the start resident in G1.
    ``host_blocks``: further consecutive blocks, right after the G1 run, resident in the
    host tier (G2) only. A block in both tiers counts as G1.
    """

    gpu_blocks: int = 0
    host_blocks: int = 0


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    """One candidate worker as routing sees it.

    ``pending_prefill_tokens``: uncached prompt tokens routed here and not yet prefilled
    (the router's own count, or the simulator's queue). ``recent_prefill_tokens``: a
    time-decayed sum of computed (uncached) prompt tokens routed here, kept by a
    :class:`RecentLoad`; it is what keeps the computed work balanced. ``active_blocks``:
    KV blocks held by running requests (decode load, for ``kv_aware``).
    """

    worker_id: str
    healthy: bool = True
    active_requests: int = 0
    active_blocks: int = 0
    pending_prefill_tokens: int = 0
    recent_prefill_tokens: float = 0.0
    # A time-decayed count of new sessions placed here (kvhint spreads new sessions).
    recent_sessions: float = 0.0


@dataclass(frozen=True, slots=True)
class SessionPlacement:
    """Where a session's previous turn ran (``worker_id``) and how many turns it had."""

    worker_id: str | None
    turns: int = 0


@dataclass(frozen=True, slots=True)
class RoutingConfig:
    policy: RoutingPolicy = RoutingPolicy.KVHINT
    # A G2 block costs this fraction of recomputing it (the host->GPU copy).
    host_load_cost: float = 0.2
    # Weight of tokens already queued for prefill on a worker (queueing delay). Below 1: a
    # queued token is only waiting, while moving a session off its cache recomputes that
    # cache on the other worker (new work for the fleet, and a second copy in its pool).
    # At 1.0, 127 of the first 6,000 Mooncake requests at 4 x 1,250 moved off 1,475 cached
    # blocks for a shorter queue; 1.0 -> 0.25 gained 13.38% -> 14.30% token hits there
    # (0.5: 14.06%), TTFT p99 0.91 -> 0.94 s, gen-agents within its noise (BENCHMARKS.md).
    queue_weight: float = 0.25
    # Weight of recent computed tokens above the least-loaded worker (long-run balance).
    # Small: it places new sessions on the least-loaded worker, while a continuation
    # stays with its cache unless its worker runs well ahead (then ``balance_cap``
    # decides). At 0.5 a 20k-token load difference outweighed a 10k-token cache hit and
    # sessions moved often (Mooncake, 4 x 1,250 blocks: 0.5 -> 10.7%, 0.05 -> 11.8% token
    # hits at max/mean computed tokens 1.004; BENCHMARKS.md).
    balance_weight: float = 0.05
    # kvhint: a worker whose recent computed tokens exceed the mean by more than this
    # fraction is not chosen while a worker below that line exists.
    balance_cap: float = 0.08
    # kvhint: for a session's own worker the line is this fraction instead. Moving a
    # session recomputes its whole cached context on the new worker, which makes that
    # worker "over" in turn (sessions ping-pong and lose their cache); the session's worker
    # is still passed over once it is this far over (hot-spot protection stays bounded).
    affinity_cap: float = 0.25
    # kvhint: ... and only once it is over that line by more than this many times the
    # tokens the request has cached there: a move recomputes them on the new worker, so an
    # excess smaller than that is not worth relieving. Without it, small recent loads (a
    # quiet spell, the end of a run) let one request put a worker "over" and sessions left
    # up to 24k cached tokens behind during a 10 s tool call. gen-agents 2 x 400 seeds
    # 1-10: 9 of 10 fewer recomputed tokens (-3.7% to +2.5%, mean -1.5%; 0.5 and 2 gave
    # the same as 1); Mooncake 4 x 1,250 unchanged (BENCHMARKS.md, "simulator").
    affinity_cache_margin: float = 1.0
    # kvhint: added to every worker's recent computed tokens before the caps are applied,
    # so an excess must also be material in absolute terms (~balance_cap x this). At low
    # load one long prompt is already 8% over the mean, and new sessions would leave the
    # worker that holds their shared prefix. The live router's default
    # (``routing.balance_floor_tokens``); on the simulated traces, where loads are large,
    # it is neutral (BENCHMARKS.md, "simulator").
    balance_floor_tokens: float = 16_384.0
    # kvhint: bounded affinity; the session's worker wins a near-tie (within this many
    # tokens of cost) while its recent load is within ``affinity_slack`` of the mean.
    affinity_tokens: int = 512
    affinity_slack: float = 0.05
    # kvhint: a new session's first turn pays this many times its prompt tokens for each
    # recently placed session a worker has above the least (against new sessions
    # clustering where their shared system prompt is cached). Off by default: at 1.0 it
    # cost hits everywhere it was measured once the simulator fed it too (Mooncake 4 x
    # 1,250: 11.82% -> 9.93%; gen-agents 2 x 400: +2.3% recomputed; the live agent bench:
    # 73.3% -> 72.6% cached, more moved turns); BENCHMARKS.md, "router" and "simulator".
    new_session_spread: float = 0.0
    # kv_aware: weight of prefill blocks against active decode blocks (Dynamo's default 1).
    kv_overlap_weight: float = 1.0


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """The request's routing features.

    ``overlaps`` maps worker id to the request's cached prefix there (from the cluster KV
    index); a worker absent from it has no overlap. ``request_seq`` is the caller's running
    count of routed requests (round robin uses it). ``session_key`` is the worker-visible
    session id (``<tenant>/<id>``) or None.
    """

    prompt_tokens: int
    block_size: int
    session_key: str | None = None
    request_seq: int = 0
    overlaps: Mapping[str, Overlap] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class RoutingContext:
    """Frozen view of the fleet for one decision. ``workers`` in any order; unhealthy
    workers are never chosen. ``session`` is None for a new session or no session."""

    workers: tuple[WorkerLoad, ...]
    config: RoutingConfig = RoutingConfig()
    session: SessionPlacement | None = None
    now: float = 0.0


@dataclass(frozen=True, slots=True)
class WorkerScore:
    worker_id: str
    cost: float
    cached_tokens: int
    host_tokens: int


@dataclass(frozen=True, slots=True)
class RouteDecision:
    """``worker_id`` to use, then ``fallbacks`` best-first for a retry when it fails
    before the response starts. ``predicted_cached_tokens`` counts G1 and G2 tokens;
    ``predicted_host_tokens`` the G2 part. ``reason`` names what decided (for metrics)."""

    worker_id: str
    fallbacks: tuple[str, ...]
    predicted_cached_tokens: int
    predicted_host_tokens: int
    reason: str
    scores: tuple[WorkerScore, ...] = ()


class NoWorkerAvailable(Exception):
    """Every worker in the context is unhealthy (or there are none)."""


def cached_tokens(overlap: Overlap | None, prompt_tokens: int, block_size: int) -> tuple[int, int]:
    """(cached tokens including G2, of which G2) for a prompt, capped like vLLM: a hit
    never covers the prompt's last token, and is whole blocks, so at most the whole
    blocks in ``prompt_tokens - 1`` (a fully cached 2-block prompt hits 1 block)."""
    if overlap is None:
        return 0, 0
    cap = max(prompt_tokens - 1, 0) // block_size * block_size
    gpu = min(overlap.gpu_blocks * block_size, cap)
    total = min((overlap.gpu_blocks + overlap.host_blocks) * block_size, cap)
    return total, total - gpu


def decay_recent(value: float, elapsed_s: float, half_life_s: float) -> float:
    """Decay a ``recent_prefill_tokens`` accumulator by ``elapsed_s`` (exponential)."""
    if elapsed_s <= 0:
        return value
    return value * 0.5 ** (elapsed_s / half_life_s)


@dataclass(slots=True)
class RecentLoad:
    """One worker's time-decayed load, as :class:`WorkerLoad` carries it to the policy:
    uncached prompt tokens routed there (``recent_prefill_tokens``) and new sessions placed
    there (``recent_sessions``), both halving every ``half_life_s``. The live router and
    the simulator keep one per worker, so ``route()`` sees the same figures from both.
    Bookkeeping, not policy: the caller owns the clock (``now`` never goes back)."""

    half_life_s: float
    prefill_tokens: float = 0.0
    sessions: float = 0.0
    at: float = 0.0

    def decay_to(self, now: float) -> None:
        factor = decay_recent(1.0, now - self.at, self.half_life_s)
        self.prefill_tokens *= factor
        self.sessions *= factor
        self.at = now

    def add_prefill(self, now: float, tokens: float) -> None:
        self.decay_to(now)
        self.prefill_tokens += tokens

    def add_session(self, now: float) -> None:
        self.decay_to(now)
        self.sessions += 1.0


def route(ctx: RoutingContext, request: RouteRequest, rng: random.Random) -> RouteDecision:
    """Choose a worker for ``request``; raises :class:`NoWorkerAvailable` when none is
    healthy. Deterministic for a given context, request and rng state."""
    healthy = [w for w in ctx.workers if w.healthy]
    if not healthy:
        raise NoWorkerAvailable("no healthy worker to route to")
    healthy.sort(key=lambda w: w.worker_id)
    policy = ctx.config.policy
    if policy is RoutingPolicy.ROUND_ROBIN:
        return _round_robin(healthy, request)
    if policy is RoutingPolicy.SESSION_AFFINITY:
        return _session_affinity(ctx, healthy, request, rng)
    if policy is RoutingPolicy.KV_AWARE:
        return _ranked(healthy, request, rng, _kv_aware_costs(ctx.config, healthy, request), "kv",
                       _cached(healthy, request))
    return _kvhint(ctx, healthy, request, rng)


def _cached(workers: list[WorkerLoad], request: RouteRequest) -> list[tuple[int, int]]:
    """Each worker's :func:`cached_tokens` for ``request``, in ``workers`` order."""
    return [cached_tokens(request.overlaps.get(w.worker_id), request.prompt_tokens,
                          request.block_size) for w in workers]


def _decision(ranked: list[WorkerScore], reason: str) -> RouteDecision:
    best = ranked[0]
    return RouteDecision(
        worker_id=best.worker_id,
        fallbacks=tuple(s.worker_id for s in ranked[1:]),
        predicted_cached_tokens=best.cached_tokens,
        predicted_host_tokens=best.host_tokens,
        reason=reason,
        scores=tuple(ranked),
    )


def _ranked(
    workers: list[WorkerLoad],
    request: RouteRequest,
    rng: random.Random,
    costs: list[float],
    reason: str,
    cached: list[tuple[int, int]],
) -> RouteDecision:
    """Workers by ``costs`` (lowest first); ``cached`` is :func:`_cached` of ``workers``."""
    # One rng draw per worker, in worker-id order, so ties break reproducibly.
    ties = [rng.random() for _ in workers]
    order = sorted(range(len(workers)), key=lambda i: (costs[i], ties[i]))
    return _decision([WorkerScore(workers[i].worker_id, costs[i], *cached[i]) for i in order],
                     reason)


def _round_robin(workers: list[WorkerLoad], request: RouteRequest) -> RouteDecision:
    start = request.request_seq % len(workers)
    rotated = workers[start:] + workers[:start]
    cached = _cached(rotated, request)
    return _decision([WorkerScore(w.worker_id, float(i), *cached[i])
                      for i, w in enumerate(rotated)], "round_robin")


def _session_affinity(
    ctx: RoutingContext, workers: list[WorkerLoad], request: RouteRequest, rng: random.Random
) -> RouteDecision:
    """Sticky: the session's previous worker when healthy, else the least busy."""
    costs = [float(w.active_requests) + w.recent_prefill_tokens * 1e-9 for w in workers]
    sticky = ctx.session.worker_id if ctx.session is not None else None
    if sticky is not None:
        costs = [-1.0 if w.worker_id == sticky else c for w, c in zip(workers, costs, strict=True)]
        reason = "affinity" if any(w.worker_id == sticky for w in workers) else "least_busy"
    else:
        reason = "least_busy"
    return _ranked(workers, request, rng, costs, reason, _cached(workers, request))


def _kv_aware_costs(
    config: RoutingConfig, workers: list[WorkerLoad], request: RouteRequest
) -> list[float]:
    block = request.block_size
    prompt_blocks = -(-request.prompt_tokens // block)
    costs = []
    for w in workers:
        overlap = request.overlaps.get(w.worker_id)
        hit_blocks = overlap.gpu_blocks if overlap is not None else 0
        prefill_blocks = max(prompt_blocks - hit_blocks, 0) + w.pending_prefill_tokens / block
        costs.append(config.kv_overlap_weight * prefill_blocks + w.active_blocks)
    return costs


def _kvhint(
    ctx: RoutingContext, workers: list[WorkerLoad], request: RouteRequest, rng: random.Random
) -> RouteDecision:
    config = ctx.config
    least_recent = min(w.recent_prefill_tokens for w in workers)
    # What the caps compare: recent computed tokens lifted by balance_floor_tokens.
    recent = [w.recent_prefill_tokens + config.balance_floor_tokens for w in workers]
    mean = sum(recent) / len(recent)
    costs = []
    cached = _cached(workers, request)
    for w, (total, host) in zip(workers, cached, strict=True):
        new_tokens = request.prompt_tokens - total
        costs.append(
            new_tokens
            + config.host_load_cost * host
            + config.queue_weight * w.pending_prefill_tokens
            + config.balance_weight * (w.recent_prefill_tokens - least_recent)
        )
    if request.session_key is not None and (ctx.session is None
                                            or ctx.session.worker_id is None):
        least = min(w.recent_sessions for w in workers)
        costs = [c + config.new_session_spread * request.prompt_tokens
                 * (w.recent_sessions - least) for c, w in zip(costs, workers, strict=True)]
    # Bounded balance: overloaded workers drop behind every worker under the line; the
    # session's own worker has a higher line (affinity_cap, plus a margin for what a move
    # would recompute: affinity_cache_margin x its cached tokens).
    sticky = ctx.session.worker_id if ctx.session is not None else None
    over = [mean > 0 and load > (
        mean * (1.0 + config.affinity_cap) + config.affinity_cache_margin * total
        if w.worker_id == sticky else mean * (1.0 + config.balance_cap))
        for w, load, (total, _) in zip(workers, recent, cached, strict=True)]
    if not all(over):
        penalty = 1.0 + max(costs) - min(costs)
        costs = [c + penalty if o else c for c, o in zip(costs, over, strict=True)]
    reason = "cost"
    if sticky is not None:
        for i, w in enumerate(workers):
            within = mean <= 0 or recent[i] <= mean * (1.0 + config.affinity_slack)
            if w.worker_id == sticky and within and not over[i]:
                costs[i] -= config.affinity_tokens
                reason = "cost+affinity"
    return _ranked(workers, request, rng, costs, reason, cached)
