"""Each tenant's requests in flight, against its ``max_in_flight`` (``TenantConfig``).

Contract: :meth:`TenantSlots.take` admits a request (taking one of its tenant's slots,
whether the tenant has a cap or not) or answers the 429 itself, counted; the forwarder
gives an admitted request's slot back exactly once, in its accounting, which every way a
request ends runs (answered, failed, a stream's end, a client gone, a cancellation). A
streamed ``GET /v1/responses/{id}`` holds one too while it streams (:meth:`admit`;
responses_api.py gives it back once, however the stream ends).
What is held is exported as it changes, ``kvhint_router_tenant_in_flight{tenant}``: the
very count the cap is checked against. Tenants are the configured ones and ``default``
(bounded). Single event loop.
"""

from __future__ import annotations

from starlette.responses import Response

from kvhint.router.service.inbound import InboundRequest, error_response
from kvhint.router.service.metrics import RouterMetrics
from kvhint.router.service.tenancy import Tenant

RETRY_AFTER_S = 1


class TenantSlots:
    def __init__(self, metrics: RouterMetrics) -> None:
        self._metrics = metrics
        # Tenant name -> requests in flight (the configured tenants and default: bounded).
        self._held: dict[str, int] = {}

    def held(self, tenant: str) -> int:
        """Requests of ``tenant`` in flight (admitted, not given back yet)."""
        return self._held.get(tenant, 0)

    def take(self, inbound: InboundRequest) -> Response | None:
        """None: admitted (a slot taken; give it back with :meth:`give_back`). Else the
        429 to answer: nothing was sent, nothing of the session changed; counted."""
        if self.admit(inbound.tenant):
            return None
        self._metrics.record_request(inbound.endpoint.value, "none", 429)
        return over_in_flight_answer(inbound.tenant)

    def admit(self, tenant: Tenant) -> bool:
        """:meth:`take` for a caller that answers and counts its own refusal (a streamed
        ``GET /v1/responses/{id}``: responses_api.py): True, a slot taken; False, the
        tenant's ``max_in_flight`` is held, counted as ``over_in_flight``."""
        limit = tenant.max_in_flight
        held = self._held.get(tenant.name, 0)
        if limit is None or held < limit:
            self._set(tenant.name, held + 1)
            return True
        self._metrics.gateway_rejections.labels(tenant.name, "over_in_flight").inc()
        return False

    def give_back(self, tenant: str) -> None:
        self._set(tenant, max(self._held.get(tenant, 0) - 1, 0))

    def _set(self, tenant: str, held: int) -> None:
        self._held[tenant] = held
        self._metrics.tenant_in_flight.labels(tenant).set(held)


def over_in_flight_answer(tenant: Tenant) -> Response:
    """The 429 for a request of ``tenant`` past its ``max_in_flight``: the router's own
    error answer (``nosniff`` as every one), with ``Retry-After``."""
    return error_response(
        f"tenant {tenant.name!r} has {tenant.max_in_flight} requests in flight, its "
        "max_in_flight: retry once one finishes", 429,
        headers={"retry-after": str(RETRY_AFTER_S)})
