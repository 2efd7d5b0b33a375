"""What a tenant is shown of a hint action's outcome: its own action, not what the
worker's other holders hold.

A worker's pin, retain and prefetch budgets are every tenant's. The plugin's reason for
a clipped (or waiting) action names the whole worker's figures
(engine_plugin/holds.py, prefetch.py): "pin budget: 2 of 8 new blocks fit
(max_pinned_blocks=6)", "prefetch budget: 0 of 5 blocks may wait
(max_prefetch_blocks=6, 6 waiting)": the room left in the budget and, for Prefetch, the
blocks every other Prefetch on the worker waits for. Nothing a tenant holds or may hold
implies those: they say what the other tenants (and the planner's protection of their
sessions) hold there at that moment. So where a tenant's key reads an action (the
sessions API's answers, a tenant admin's admin views), each such clause is replaced by
:data:`REDACTED`; the status, and ``requested``/``applied`` (what the tenant's own
action asked and holds: its budgets and its agent's next step depend on them), stay. A
fleet admin, and the store, keep the worker's words.

What stays is inherent to sharing a budget: that an action was clipped, and ``applied``,
which is never more than the tenant asked (so says no more of the room left than its own
ask bounds). The hints API's refusal for the worker's pin budget says as little
(:mod:`.hint_api_budget`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from kvhint.router.service.tenancy import Principal

# A budget clause of the plugin's reasons: "<kind> budget: <n> of <m> <words> (<figures>)".
_BUDGET_CLAUSE = re.compile(r"\b(pin|retain|prefetch) budget: \d+ of \d+ [^();]*\([^()]*\)")
REDACTED = r"\1 budget: the worker's, shared by every tenant, had no room for the rest"


def tenant_reason(reason: str) -> str:
    """``reason`` less the worker-wide figures of its budget clauses (module doc)."""
    return _BUDGET_CLAUSE.sub(REDACTED, reason)


def rows_for(principal: Principal, rows: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Hint action rows as ``principal`` may read them: a tenant's key (client or admin)
    gets each ``reason`` through :func:`tenant_reason`; a fleet admin (or dev mode's
    open access) the rows as they are."""
    if principal.tenant is None:
        return list(rows)
    return [{**row, "reason": tenant_reason(row["reason"])}
            if isinstance(row.get("reason"), str) else row for row in rows]
