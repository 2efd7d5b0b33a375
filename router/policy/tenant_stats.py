"""Learned statistics kept per tenant: each tenant's planning reads only its own.

The product promises that nothing crosses tenants. One :class:`LearnedStats` shared by
every tenant broke that three ways: tenant A's gaps moved tenant B's predictions (B's
pins expired before B came back), A's distinct tool names filled the key table
(:data:`~kvhint.router.policy.stats.MAX_GAP_KEYS`) so B's tools were never learnt, and
B's admin saw figures learnt from A's traffic. :class:`TenantStats` keeps one
:class:`LearnedStats` per tenant, so every bound of a :class:`LearnedStats` (the key cap,
the kind length) is per tenant too.

Everything a :class:`LearnedStats` learns is kept per tenant, completion reads included:
whether a next turn reads the previous response's KV depends on what the client sends
back (a framework that strips reasoning or re-renders tool calls does not read it), and
that is the tenant's, not the fleet's. Outcome feedback is outside this class: what a
worker cannot do is shared, the rest is each tenant's own (:mod:`.tenant_feedback`).

Bounded: only the tenants in ``tenants`` (the router's configured ones plus its default
tenant; the simulator's, its trace's) learn, at most :data:`MAX_TENANTS` when no list is
given. Any other tenant (a session restored from the store of a tenant since removed
from the configuration; the router never admits a request of an unknown one) plans from
the priors and learns nothing: :meth:`TenantStats.apply` says so, for the caller to count.

Plain data, no I/O: the caller applies, persists and restores (one row per tenant).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from kvhint.router.policy.stats import LearnedStats, Observation

MAX_TENANTS = 1024
"""Tenants that may learn when no tenant list is given (a backstop; the router and the
simulator give their lists)."""


@dataclass(slots=True)
class TenantStats:
    """Each tenant's own :class:`LearnedStats`, created at its first observation.

    ``tenants``: the tenants that may learn (None: any, up to :data:`MAX_TENANTS`).
    ``factory``: a fresh :class:`LearnedStats` (its priors); a tenant with no data yet
    reads one that nothing ever updates, so it predicts exactly as a fresh router does.
    """

    tenants: frozenset[str] | None = None
    factory: Callable[[], LearnedStats] = LearnedStats
    _own: dict[str, LearnedStats] = field(default_factory=dict, init=False)
    # What a tenant without statistics of its own reads. Never applied to, so it stays at
    # the priors whichever tenants read it (its hit-density memo is a pure function of
    # the priors, so sharing it shares nothing learnt).
    _blank: LearnedStats = field(init=False)

    def __post_init__(self) -> None:
        self._blank = self.factory()

    # -- reading -------------------------------------------------------------------------

    def of(self, tenant: str | None) -> LearnedStats:
        """``tenant``'s statistics: its own, else the priors (None: no tenant's)."""
        own = self._own.get(tenant) if tenant is not None else None
        return own if own is not None else self._blank

    def has_own(self, tenant: str) -> bool:
        return tenant in self._own

    def learns(self, tenant: str | None) -> bool:
        """Whether ``tenant``'s observations are kept (see the module's bounds)."""
        if tenant is None:
            return False
        if tenant in self._own:
            return True
        if self.tenants is not None:
            return tenant in self.tenants
        return len(self._own) < MAX_TENANTS

    # -- learning ------------------------------------------------------------------------

    def apply(self, tenant: str | None, observation: Observation) -> bool:
        """Fold ``observation`` into ``tenant``'s statistics only. False: not kept (a
        tenant that does not learn, see :meth:`learns`); the caller counts it."""
        if tenant is None or not self.learns(tenant):
            return False
        stats = self._own.get(tenant)
        if stats is None:
            stats = self._own[tenant] = self.factory()
        stats.apply(observation)
        return True

    def put(self, tenant: str, stats: LearnedStats) -> bool:
        """``tenant``'s statistics, as restored. False: a tenant that does not learn."""
        if not self.learns(tenant):
            return False
        self._own[tenant] = stats
        return True
