"""Pool blocks of claims on a hybrid model: a worker's budgets (its heartbeat's
``max_pinned_blocks`` / ``max_retained_blocks``) count pool blocks, the planner and the
ledger count target positions. A Pin or Retain of n positions on a model with
sliding-window or Mamba groups beside full attention holds more than n pool blocks
(status 1.3 ``claim_cost``, :class:`~kvhint.schemas.status.ClaimCost`); without a cost
(a one-group model, a 1.2 plugin) a position is one pool block. Pure; no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvhint.schemas.status import ClaimCost


def claim_cost(positions: int, cost: ClaimCost | None) -> int:
    """Pool blocks a claim of ``positions`` target positions takes:
    ``positions * per_position + sum(min(positions, tail))``; ``positions`` without a
    cost."""
    if cost is None:
        return positions
    n = max(positions, 0)
    return n * cost.per_position + sum(min(n, tail) for tail in cost.tails)


def held_pool_blocks(positions: int, claims: int, cost: ClaimCost | None) -> int:
    """Pool blocks held, at most, by ``claims`` live claims over ``positions`` distinct
    target positions (the ledger's counts): each position ``per_position`` blocks, each
    claim its whole tails. Over-counts (the safe side for a room check), and only the
    tails (positions are the ledger's distinct ones, as the plugin holds each group's
    block at a position once): a claim of n positions holds ``min(hit, tail)`` blocks of
    a tail, ``hit <= n`` its hit point (the furthest position whose tails are resident,
    ``engine_plugin/group_holds.py``), so one shorter than a tail is counted up to
    ``tail - n`` blocks too many (none once n reaches the longest tail: 64 positions of
    16 tokens for Gemma 3's 1024-token window, 8 for gpt-oss's 128); and claims whose
    hit points coincide hold the same tail blocks once, counted once per claim (one live
    holding per scope and worker, so only a shared prefix's Retain ending where a
    session's claim ends). Exact counts need each claim's length and end on the worker:
    the ledger keeps a count of live claims only."""
    if cost is None:
        return positions
    return positions * cost.per_position + claims * sum(cost.tails)


def added_pool_blocks(positions: int, claims: Iterable[int], cost: ClaimCost | None) -> int:
    """Pool blocks new claims add, at most: ``positions`` target positions not held yet
    (the ledger's :meth:`~kvhint.router.policy.holdings.HoldingsLedger.added`), each
    ``per_position`` blocks, and each claim's tails (``claims``: each claim's
    positions; a tail block held already by another claim is counted again)."""
    if cost is None:
        return positions
    tails = cost.tails
    return positions * cost.per_position + sum(min(max(n, 0), tail) for n in claims
                                               for tail in tails)
