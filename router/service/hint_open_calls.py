"""Each tenant's hints calls open at once (``POST /v1/sessions/{id}/hints``), against
``hints.api_max_open_calls``.

A hints call stays open until its actions' outcomes come or its ``wait_s`` (up to 60 s)
passes, holding a connection (one of the router's ``http_max_concurrency``) and a task.
Its other bounds do not bound how many wait at once: the call rate (``api_calls``: 100
a second, bursts of 1,000) counts calls, not how long each stays, and the actions per
minute (``budget.max_actions_per_minute``, 600) let one tenant hold some 600 calls
waiting on a worker slow to answer, whatever its ``max_in_flight``. One more than the
cap is a 429 with ``Retry-After``, before anything is read or sent, counted in
``kvhint_router_gateway_rejections_total{tenant, reason="over_open_hints"}`` (and the
hints' own rejections counter, by its caller).

A call is charged to its key's tenant, a global admin key's (and dev mode's) to
``default``, as the call rate charges it (tenant_call_rate.py). The counts are the
configured tenants' and ``default``'s (bounded); an entry goes when its count is 0.
Single event loop.
"""

from __future__ import annotations

from kvhint.router.service.metrics import RouterMetrics

# kvhint_router_gateway_rejections_total{reason} and hint_api_rejections_total{reason}.
OPEN_HINTS_REJECTION = "over_open_hints"
# A waiting call ends within its wait_s, most far sooner (an outcome comes in ms).
RETRY_AFTER_S = 1


class HintOpenCalls:
    def __init__(self) -> None:
        # Tenant name -> hints calls open now (admitted, not answered yet).
        self._open: dict[str, int] = {}

    def open(self, tenant: str) -> int:
        return self._open.get(tenant, 0)

    def enter(self, tenant: str, limit: int, metrics: RouterMetrics) -> str | None:
        """None: admitted (leave with :meth:`leave` once answered). Else the 429's
        message, counted; nothing was done."""
        held = self._open.get(tenant, 0)
        if held < limit:
            self._open[tenant] = held + 1
            return None
        metrics.gateway_rejections.labels(tenant, OPEN_HINTS_REJECTION).inc()
        return (f"tenant {tenant!r} has {limit} hints calls open (hints.api_max_open_calls; "
                "each stays open until its actions' outcomes come or its wait_s passes): "
                "nothing was sent; retry once one is answered, or send a shorter wait_s")

    def leave(self, tenant: str) -> None:
        held = self._open.get(tenant, 0) - 1
        if held > 0:
            self._open[tenant] = held
        else:
            self._open.pop(tenant, None)
