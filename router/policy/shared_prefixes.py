"""Which prefixes many sessions share (system prompts, tool schemas), per worker and tenant;
:func:`~kvhint.router.policy.planner.plan_shared_prefixes` retains them.

The live router's lifecycle and the simulator both feed :func:`find_shared_prefixes` the
block hashes of each live session's last routed prompt, every
``PlannerConfig.shared_prefix_scan_s``, and keep a :class:`SharedPrefixRetains` of what they
sent, so the two run the same scan.

A prefix is identified by the hash of its last block (the chain hash covers everything
before it). For every session, prefixes at power-of-two lengths are counted; for each
worker the longest prefix used by at least ``min_sessions`` sessions of one tenant wins
(shorter ones are inside it).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from kvhint.router.policy.plan_types import PlannedAction, SharedPrefix

PREFIX_SCOPE = "prefix:"


@dataclass(frozen=True, slots=True)
class SessionChain:
    """A live (not ended) session's last routed prompt on its worker, as block hashes, and
    the session's hit density (:func:`~kvhint.router.policy.planner.session_hit_density`)."""

    worker_id: str
    tenant: str
    block_hashes: tuple[int, ...]
    hit_density: float = 0.0


def find_shared_prefixes(chains: Iterable[SessionChain], min_sessions: int,
                         protected_until: Mapping[str, float]) -> list[SharedPrefix]:
    """The longest prefix per (worker, tenant) that ``min_sessions`` sessions share, in
    (worker, tenant) order. ``protected_until`` is :attr:`SharedPrefixRetains.until`."""
    counts: dict[tuple[str, str, int], int] = {}
    densities: dict[tuple[str, str, int], float] = {}
    prefixes_by_key: dict[tuple[str, str, int], tuple[int, ...]] = {}
    for chain in chains:
        hashes = chain.block_hashes
        length = 1
        while length <= len(hashes):
            key = (chain.worker_id, chain.tenant, hashes[length - 1])
            counts[key] = counts.get(key, 0) + 1
            densities[key] = densities.get(key, 0.0) + chain.hit_density
            prefixes_by_key.setdefault(key, hashes[:length])
            length *= 2
    best: dict[tuple[str, str], tuple[int, int]] = {}  # (worker, tenant) -> (blocks, hash)
    for (worker, tenant, last), sessions in counts.items():
        if sessions < min_sessions:
            continue
        blocks = len(prefixes_by_key[(worker, tenant, last)])
        if blocks > best.get((worker, tenant), (0, 0))[0]:
            best[(worker, tenant)] = (blocks, last)
    prefixes = []
    for (worker, tenant), (_blocks, last) in sorted(best.items()):
        key = f"{tenant}:{last:016x}"
        prefixes.append(SharedPrefix(
            worker_id=worker, key=key, block_hashes=prefixes_by_key[(worker, tenant, last)],
            sessions=counts[(worker, tenant, last)], tenant=tenant,
            protected_until=protected_until.get(_protection_key(worker, key)),
            hit_density=densities[(worker, tenant, last)]))
    return prefixes


class SharedPrefixRetains:
    """The caller's record of its shared-prefix scans: when the next one is due and until
    when each prefix's retain (as sent) lasts. Plain bookkeeping, no I/O."""

    def __init__(self) -> None:
        self._until: dict[str, float] = {}  # "<worker>:<prefix key>" -> retain end
        self._next_scan = 0.0

    @property
    def until(self) -> Mapping[str, float]:
        return self._until

    def scan_due(self, now: float, every_s: float) -> bool:
        """True (and the next scan set ``every_s`` later) when a scan is due at ``now``."""
        if now < self._next_scan:
            return False
        self._next_scan = now + every_s
        return True

    def sent(self, actions: Sequence[PlannedAction]) -> None:
        """Record the shared-prefix retains just sent (other actions are ignored)."""
        for action in actions:
            if action.scope.startswith(PREFIX_SCOPE):
                key = _protection_key(action.worker_id, action.scope[len(PREFIX_SCOPE):])
                self._until[key] = action.expires_at

    def expire(self, now: float) -> None:
        """Forget retains that have ended (a prefix no longer shared would stay forever)."""
        for key in [k for k, until in self._until.items() if until <= now]:
            del self._until[key]


def _protection_key(worker_id: str, prefix_key: str) -> str:
    return f"{worker_id}:{prefix_key}"
