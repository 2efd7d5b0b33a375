"""What an agent runtime may send through the sessions API: its tenant's rate and
holdings budgets, and the worker's advertised pin budget.

:class:`ApiBudgetGate` is the dispatcher's (``HintDispatcher.api_rate_wait_s`` and
``api_budget_problem`` delegate to it). It reads the holdings ledger the dispatcher keeps
(so an action counts once it is sent, recorded before its publish: :mod:`.hint_send`,
and stops counting when its outcome or TTL says so) and keeps only each tenant's send
times of the last minute.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

from kvhint.router.policy import HoldingsLedger, PlannedAction, target_keys
from kvhint.router.policy.claim_cost import added_pool_blocks, held_pool_blocks
from kvhint.router.service.settings import TenantBudget
from kvhint.router.service.workers import WorkerRegistry
from kvhint.schemas import ActionType


class ApiBudgetGate:
    def __init__(self, holdings: HoldingsLedger, workers: WorkerRegistry,
                 block_size: Callable[[str], int]) -> None:
        """``holdings``: the dispatcher's ledger (read, never written here);
        ``block_size(worker_id)``: the worker's block size from its heartbeat."""
        self._holdings = holdings
        self._workers = workers
        self._block_size = block_size
        self._times: dict[str, deque[float]] = {}

    def rate_wait_s(self, tenant: str, actions: int, budget: TenantBudget,
                    now: float) -> float | None:
        """Seconds until ``actions`` more API actions fit ``tenant``'s per-minute rate
        (0: they fit now; None: never, more than the rate in one call)."""
        if actions > budget.max_actions_per_minute:
            return None
        times = self._times.get(tenant, ())
        over = len(times) + actions - budget.max_actions_per_minute
        if over <= 0:
            return 0.0
        return max(60.0 - (now - times[over - 1]), 0.0)

    def refund(self, tenant: str, at: float, actions: int) -> None:
        """``actions`` that :meth:`problem` counted at ``at`` never left the router (NATS
        refused their publish): they do not count against the rate. An agent retrying
        after a NATS outage is not throttled for what never reached a worker (the
        failure is counted: ``hints_total{outcome="failed"}``)."""
        times = self._times.get(tenant)
        for _ in range(actions):
            if not times or at not in times:
                return  # gone meanwhile (older than the minute)
            times.remove(at)

    def rate_problem(self, tenant: str, actions: int, budget: TenantBudget,
                     now: float) -> str | None:
        """Why ``actions`` more API actions do not fit ``tenant``'s per-minute rate now
        (its sends of the last minute), or None. Counts nothing: :meth:`problem` does.
        Needs no session: the sessions API asks it before the session's store read."""
        times = self._times.setdefault(tenant, deque())
        while times and now - times[0] > 60.0:
            times.popleft()
        if len(times) + actions > budget.max_actions_per_minute:
            return (f"tenant {tenant!r} may send {budget.max_actions_per_minute} hint actions "
                    "per minute")
        return None

    def problem(self, tenant: str, budget: TenantBudget, worker_id: str,
                planned: Sequence[PlannedAction], now: float,
                chain: Sequence[int] = (), worker_share: float = 1.0) -> str | None:
        """Why API actions must not be sent (tenant rate and holdings, the worker's
        advertised budgets, the tenant's ``worker_share`` of them), or None; a None
        answer counts them against the rate. ``chain``: the session's last prompt's block
        hashes on the worker, so that blocks already held the same way (a shared system
        prompt) are not counted again. The answer goes to the tenant's caller: it names
        the tenant's own holdings, never what the worker holds for everyone (before, "worker
        w0 would hold 56 pinned blocks" told a tenant what every other tenant pinned
        there): only that the worker's shared budget has no room for these."""
        if (over := self.rate_problem(tenant, len(planned), budget, now)) is not None:
            return over
        block_size = self._block_size(worker_id)
        # Blocks added: on the worker, on the tenant, by the tenant's API on the worker.
        pins, retains = [0, 0, 0], [0, 0, 0]
        # A Prefetch holds too: the worker retains what it brought into G1 until the
        # Prefetch's deadline, and the ledger counts that as retained (before, a tenant
        # over its retained cap could still Prefetch without limit).
        added = {ActionType.PIN.value: pins, ActionType.RETAIN.value: retains,
                 ActionType.PREFETCH.value: retains}
        for action in planned:
            if (totals := added.get(action.action_type)) is not None:
                keys = target_keys(action.action_type, action.action.payload, block_size, chain)
                for i, blocks in enumerate(self._holdings.added(
                        worker_id, tenant, action.action_type, action.blocks, keys,
                        action.scope)):
                    totals[i] += blocks
        held = self._holdings.tenant(tenant)
        # (who, kind, held now, added, limit, whether "held now" is every tenant's)
        checks = [(f"tenant {tenant!r}", "pinned", held.pinned_blocks, pins[1],
                   budget.max_pinned_blocks, False),
                  (f"tenant {tenant!r}", "retained", held.retained_blocks, retains[1],
                   budget.max_retained_blocks, False)]
        worker = self._workers.get(worker_id)
        if worker is not None and worker.status is not None:
            # The worker's budgets are pool blocks: on a hybrid model (status 1.3
            # claim_cost) each claim takes more than its positions (held: the ledger's
            # positions and live claims, over-counted; router.policy.claim_cost).
            cost = worker.status.claim_cost or None
            new_pins = [a.blocks for a in planned if a.action_type == ActionType.PIN.value]
            new_retains = [a.blocks for a in planned if a.action_type in (
                ActionType.RETAIN.value, ActionType.PREFETCH.value)]
            # Pins only: a worker's retain budget is soft (a higher priority displaces a
            # lower one, an overflow is clipped), which the planner relies on too.
            checks.append((f"worker {worker_id}", "pinned", held_pool_blocks(
                self._holdings.worker(worker_id).pinned_blocks,
                self._holdings.claims(worker_id)[0], cost),
                added_pool_blocks(pins[0], new_pins, cost),
                worker.status.budgets.max_pinned_blocks, True))
            if worker_share < 1.0:
                # A worker's budgets are every tenant's: one tenant's agents may take
                # only its share (retains too: an agent's Retain displaces every planner
                # claim and other agents' of lower priority, another tenant's included).
                budgets, api_held = worker.status.budgets, self._holdings.api_on_worker(
                    tenant, worker_id)
                api_pins, api_retains = self._holdings.claims(worker_id, tenant)
                who = f"tenant {tenant!r} on worker {worker_id} (share {worker_share:g})"
                checks += [(who, "pinned",
                            held_pool_blocks(api_held.pinned_blocks, api_pins, cost),
                            added_pool_blocks(pins[2], new_pins, cost),
                            int(budgets.max_pinned_blocks * worker_share), False),
                           (who, "retained",
                            held_pool_blocks(api_held.retained_blocks, api_retains, cost),
                            added_pool_blocks(retains[2], new_retains, cost),
                            int(budgets.max_retained_blocks * worker_share), False)]
        for who, kind, current, asked, limit, everyones in checks:
            if asked and limit is not None and current + asked > limit:
                if everyones:
                    return (f"{who} has no room for these {kind} blocks (its limit {limit} "
                            "is shared by every tenant)")
                return f"{who} would hold {current + asked} {kind} blocks (limit {limit})"
        self._times[tenant].extend([now] * len(planned))
        return None
