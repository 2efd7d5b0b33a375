"""Which prefixes many sessions share (system prompts, tool schemas), per worker and tenant;
:func:`plan_shared_prefixes` retains them.

The live router's lifecycle and the simulator both feed :func:`find_shared_prefixes` the
block hashes of each live session's last routed prompt, every
``PlannerConfig.shared_prefix_scan_s``, and keep a :class:`SharedPrefixRetains` of what they
sent, so the two run the same scan.

A prefix is identified by the hash of its last block (the chain hash covers everything
before it). For every session, prefixes at power-of-two lengths are counted; per worker and
tenant the longest prefix used by at least ``min_sessions`` sessions wins, extended to
where its sessions' prompts part (a 7-block system prompt is counted at 4 blocks and
retained whole, not as 4). Only one: with
several agent types' system prompts on a worker, retaining each of them measured worse on
the simulator's gen-agents workload (five seeds, 0.3-1.5% more recomputed tokens;
BENCHMARKS.md), the prompts in use staying resident anyway.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from kvhint.router.policy.holdings import room_left
from kvhint.router.policy.plan_types import PlannedAction, PlannerContext, SharedPrefix
from kvhint.router.policy.priority import priority_density, retain_priority
from kvhint.router.policy.session import SessionPlanState
from kvhint.router.policy.stats import USER_GAP
from kvhint.schemas.hints import ActionType, RetainPayload, Target

PREFIX_SCOPE = "prefix:"


@dataclass(frozen=True, slots=True)
class SessionChain:
    """A live session's last routed prompt on its worker, as block hashes, and the
    session's hit density (:func:`session_hit_density`)."""

    worker_id: str
    tenant: str
    block_hashes: tuple[int, ...]
    hit_density: float


def find_shared_prefixes(chains: Iterable[SessionChain], min_sessions: int,
                         protected_until: Mapping[str, float]) -> list[SharedPrefix]:
    """The longest prefix per (worker, tenant) that ``min_sessions`` sessions share, in
    (worker, tenant) order. Only sessions worth something count (``hit_density`` > 0: in
    flight, or protected by the planner), so a prefix of sessions long gone is not kept.
    ``protected_until`` is :attr:`SharedPrefixRetains.until`."""
    # Per (worker, tenant): prefix's last block hash -> [sessions, summed density (in
    # _DENSITY_UNITS), the first chain seen with it, the prefix's length] (sliced only for
    # the winners). Summed as integers: a float sum depends on the order of the sessions
    # (dict order: a restarted router reads them back in another), and with it which of
    # two equally long prefixes wins and the priority at a rounding edge.
    groups: dict[tuple[str, str], dict[int, list]] = {}
    counted: dict[tuple[str, str], list[tuple[int, ...]]] = {}
    for chain in chains:
        if not 0 < chain.hit_density < math.inf:  # worth nothing (or not a number)
            continue
        group = groups.setdefault((chain.worker_id, chain.tenant), {})
        counted.setdefault((chain.worker_id, chain.tenant), []).append(chain.block_hashes)
        hashes = chain.block_hashes
        units = round(chain.hit_density * _DENSITY_UNITS)
        length = 1
        while length <= len(hashes):
            entry = group.get(hashes[length - 1])
            if entry is None:
                group[hashes[length - 1]] = [1, units, hashes, length]
            else:
                entry[0] += 1
                entry[1] += units
            length *= 2
    prefixes = []
    for (worker, tenant), group in sorted(groups.items()):
        # The longest; among equally long ones, the one worth most.
        shared = [(entry[3], entry[1], last) for last, entry in group.items()
                  if entry[0] >= min_sessions]
        if not shared:
            continue
        length, _density, last = max(shared)
        sessions, density, hashes, _length = group[last]
        length = _common_length(hashes, length, counted[(worker, tenant)])
        key = f"{tenant}:{last:016x}"
        prefixes.append(SharedPrefix(
            worker_id=worker, key=key, block_hashes=hashes[:length], sessions=sessions,
            tenant=tenant, protected_until=protected_until.get(_protection_key(worker, key)),
            hit_density=density / _DENSITY_UNITS))
    return prefixes


# Fixed point of the summed densities (find_shared_prefixes): exact integer sums, read
# back to within a float's rounding.
_DENSITY_UNITS = 1 << 64


def _common_length(hashes: tuple[int, ...], length: int,
                   chains: Sequence[tuple[int, ...]]) -> int:
    """How far past ``length`` blocks every chain that shares ``hashes[:length]`` still
    shares ``hashes`` (the prefix's sessions part there): the counted length is a power
    of two, the prompt's is not. Chain hashes make one block's hash stand for all of the
    prefix before it."""
    last = hashes[length - 1]
    members = [c for c in chains if len(c) >= length and c[length - 1] == last]
    while length < len(hashes) and all(
            len(c) > length and c[length] == hashes[length] for c in members):
        length += 1
    return length


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
        """True (and the next scan set ``every_s`` later) when a scan is due at ``now``.
        A clock that stepped back by more than ``every_s`` makes one due at once (else
        scans would stop for as long as the step)."""
        if self._next_scan - every_s <= now < self._next_scan:
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


def session_hit_density(ctx: PlannerContext, session: SessionPlanState) -> float:
    """Expected next-turn hits per cache-second of ``session``, as the planner last valued
    it: while a turn is in flight (no gap open), the value at the start of a user gap;
    while it awaits a return, its protection's priority read back as a density (a pin is
    top priority), 0 with no protection (the planner left it to LRU) or once ended. O(1)
    for sessions awaiting a return, so a scan over every session stays cheap."""
    if session.ended:
        return 0.0
    if not session.awaiting_return:
        return ctx.stats.hit_density(USER_GAP, session.turns, 0.0, ctx.config.horizon_s)
    if session.protection is None:
        return 0.0
    return priority_density(session.protection.priority)


def session_chain(ctx: PlannerContext, session: SessionPlanState, worker_id: str | None,
                  block_hashes: tuple[int, ...]) -> SessionChain | None:
    """What ``session`` brings to a shared-prefix scan: the block hashes of its last prompt
    on ``worker_id`` with its :func:`session_hit_density`; None when it counts for nothing
    (no worker or prompt yet, or worth nothing). The live lifecycle and the simulator
    build their scans' input with it."""
    if worker_id is None or not block_hashes:
        return None
    density = session_hit_density(ctx, session)
    if density <= 0:
        return None
    return SessionChain(worker_id, session.tenant, block_hashes, density)


def plan_shared_prefixes(
    ctx: PlannerContext, prefixes: Sequence[SharedPrefix]
) -> tuple[PlannedAction, ...]:
    """Retain prefixes that at least ``shared_prefix_min_sessions`` sessions use, unless
    already retained for more than half the horizon. The priority comes from the sharing
    sessions' summed hit density: a prefix block is read by every one of their next turns,
    so it is worth their sum (sessions the planner left to LRU count for nothing, see
    :func:`session_chain`). Like a session's retain this is soft:
    the worker fits it into its retain budget by displacing lower priorities, so only the
    tenant's budget is checked here (checking the worker's budget against the planner's
    ledger, which session retains routinely fill, kept every prefix out). A prefix costs
    the tenant only its blocks no other holding of the tenant already counts
    (``ctx.tenant_retain_added``): the sessions whose Retains cover it, and its own
    earlier Retain, hold them already. Before, it cost all its blocks, counted twice
    with the sessions' (the ledger counts each block once), and a tenant near its cap
    was refused the prefix's Retain that added nothing."""
    config = ctx.config
    actions = []
    tenant_blocks = {t: h.retained_blocks for t, h in ctx.tenant_held.items()}
    for prefix in prefixes:
        worker = ctx.workers.get(prefix.worker_id)
        if worker is None or prefix.sessions < config.shared_prefix_min_sessions:
            continue
        if not prefix.block_hashes or not worker.can_send(ActionType.RETAIN, config):
            continue
        remaining = (prefix.protected_until or 0.0) - ctx.now
        if remaining > config.horizon_s / 2:
            continue
        priority = retain_priority(prefix.hit_density)
        if priority < config.min_retain_priority:
            continue
        ttl = min(config.horizon_s, worker.budgets.max_retain_ttl_s)
        blocks = len(prefix.block_hashes)
        held = tenant_blocks.get(prefix.tenant or "", 0)
        added = blocks
        if prefix.tenant is not None and ctx.tenant_retain_added is not None:
            added = ctx.tenant_retain_added(prefix.tenant, prefix.worker_id,
                                            prefix.block_hashes)
        if prefix.tenant is not None and added > room_left(
                held, config.tenant_max_retained_blocks):
            continue
        if prefix.tenant is not None:
            tenant_blocks[prefix.tenant] = held + added
        payload = RetainPayload(
            target=Target(block_hashes=list(prefix.block_hashes)),
            priority=priority,
            ttl_s=ttl,
        )
        actions.append(
            PlannedAction.make(ctx, worker.worker_id, payload, f"{PREFIX_SCOPE}{prefix.key}",
                               prefix.tenant, blocks, ctx.now + ttl, "shared_prefix")
        )
    return tuple(actions)
