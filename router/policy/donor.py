"""Semantic donor choice (DESIGN §5): pure, evidence not authority.

The caller's discovery (e.g. MinHash over prompt chunks) proposes :class:`DonorCandidate`
values; :func:`choose_donor` keeps only candidates in the request's namespace and tenant
(tenants never see each other's donors), whose donor worker is healthy, that are similar
enough, and that beat the request's exact-prefix overlap by a margin. It returns the
placement (route to the donor's worker) and the fields of a ``DonorAdvice`` to send; the
worker verifies residency and answers with an outcome. Non-identical KV is never counted
as an exact prefix hit: ``predicted_cached_tokens`` of routing is not changed by a donor.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class DonorCandidate:
    worker_id: str
    namespace: str
    tenant: str
    donor_session_id: str | None
    donor_block_hashes: tuple[int, ...]
    similarity: float
    evidence: str = ""


@dataclass(frozen=True, slots=True)
class DonorConfig:
    min_similarity: float = 0.8
    # The donor must cover this many more blocks than the best exact overlap.
    min_gain_blocks: int = 2
    advice_ttl_s: float = 30.0


@dataclass(frozen=True, slots=True)
class DonorContext:
    namespace: str
    tenant: str
    healthy_workers: frozenset[str]
    # Best exact-prefix overlap (G1 blocks) the request has anywhere.
    best_exact_blocks: int
    config: DonorConfig = DonorConfig()


@dataclass(frozen=True, slots=True)
class DonorChoice:
    candidate: DonorCandidate
    ttl_s: float
    reason: str


def choose_donor(
    ctx: DonorContext, candidates: Sequence[DonorCandidate]
) -> DonorChoice | None:
    """The best admissible donor, or None. Ties: higher similarity, more blocks, then
    worker id (deterministic)."""
    config = ctx.config
    admissible = [
        c
        for c in candidates
        if c.namespace == ctx.namespace
        and c.tenant == ctx.tenant
        and c.worker_id in ctx.healthy_workers
        and c.similarity >= config.min_similarity
        and len(c.donor_block_hashes) >= ctx.best_exact_blocks + config.min_gain_blocks
    ]
    if not admissible:
        return None
    best = min(
        admissible,
        key=lambda c: (-c.similarity, -len(c.donor_block_hashes), c.worker_id,
                       c.donor_session_id or ""),
    )
    return DonorChoice(best, config.advice_ttl_s, f"similarity {best.similarity:.2f}")
