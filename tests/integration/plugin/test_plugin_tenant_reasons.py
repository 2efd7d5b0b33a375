"""The real plugin's reasons, on vLLM's real scheduler, as the router reads them between
tenants: which rejections say what the worker cannot do (learnt for every tenant,
router/policy/tenant_feedback.py) and which a tenant's own action caused (learnt for it
alone); and the worker-wide budget figures a tenant is not shown
(router/service/tenant_reasons.py)."""

from __future__ import annotations

import re

from scheduler_fixtures import BS, hint, sched, turn

from kvhint.router.service.settings import TenantBudget
from kvhint.router.service.tenancy import Principal, Tenant
from kvhint.router.service.tenant_reasons import rows_for, tenant_reason
from kvhint.schemas import (
    DemotePayload,
    PinPayload,
    PrefetchPayload,
    RetainPayload,
    SharePayload,
    Target,
)
from kvhint.schemas.outcomes import is_capability_rejection


def test_the_plugins_rejections_read_as_the_workers_or_the_tenants() -> None:
    """No host tier on the CPU: Demote and Share are rejected for what the worker lacks
    (every tenant's). A target naming less than a block of the session, a Share to the
    worker itself, a target naming more hashes than the pool has blocks: the action's
    own doing (its tenant's)."""
    h = sched()
    turn(h, "t/s", [1, 2, 3, 4])
    session = Target(session_id="t/s")
    lacks = [hint(h, DemotePayload(target=session)),
             hint(h, SharePayload(target=session, destination_worker="w1", ttl_s=30))]
    own = [hint(h, RetainPayload(target=Target(session_id="t/s", prefix_tokens=BS // 2),
                                 priority=50, ttl_s=30)),
           hint(h, SharePayload(target=session, destination_worker="w0", ttl_s=30)),
           hint(h, PinPayload(target=Target(block_hashes=list(range(1, 1000))), ttl_s=30))]
    for outcome in lacks + own:
        assert outcome.status.value == "rejected", outcome
    assert all(is_capability_rejection(o.reason) for o in lacks), lacks
    assert not any(is_capability_rejection(o.reason) for o in own), own


def test_a_tenant_reads_no_worker_wide_budget_figure() -> None:
    """The pin, retain and prefetch budgets' clauses of real clipped (and waiting)
    outcomes: room left, the budget, what other Prefetches wait for. A tenant's key
    reads none of their figures; what its own action asked and holds stays; a fleet
    admin reads the worker's words."""
    h = sched(pin_budget_fraction=0.1, retain_budget_fraction=0.1,
              prefetch_budget_fraction=0.1)  # 63 blocks: 6 each
    turn(h, "t/s", [1, 2, 3, 4, 5, 6, 7, 8])
    keys = h.connector.core.index.session_blocks("t/s")
    pin = hint(h, PinPayload(target=Target(session_id="t/s"), ttl_s=30))
    turn(h, "t/r", [11, 12, 13, 14, 15, 16, 17, 18])
    retain = hint(h, RetainPayload(target=Target(session_id="t/r"), priority=50, ttl_s=30))
    hint(h, PrefetchPayload(target=Target(block_hashes=[901, 902, 903, 904, 905]),
                            deadline_s=30))  # another's: 5 of 6 wait
    waiting = hint(h, PrefetchPayload(target=Target(block_hashes=[*keys[:1], 911, 912]),
                                      deadline_s=30))
    full = hint(h, PrefetchPayload(target=Target(block_hashes=[*keys[:2], 921]),
                                   deadline_s=30))
    outcomes = {"pin": pin, "retain": retain, "prefetch": waiting, "prefetch ": full}
    for kind, outcome in outcomes.items():
        clause = re.search(rf"{kind.strip()} budget: [^;]*", outcome.reason)
        assert clause is not None, (kind, outcome)
        shown = tenant_reason(outcome.reason)
        assert clause.group(0) not in shown and f"{kind.strip()} budget" in shown, shown
        assert "max_" not in shown and "waiting)" not in shown, shown
    assert (pin.status.value, pin.requested.blocks, pin.applied.blocks) == ("clipped", 8, 6)
    row = {"reason": pin.reason, "applied_blocks": 6, "requested_blocks": 8}
    tenant = Principal(Tenant("t", "salt", TenantBudget()), is_admin=True)
    assert rows_for(tenant, [row]) == [{**row, "reason": tenant_reason(pin.reason)}]
    assert rows_for(Principal(None, is_admin=True), [row]) == [row]
