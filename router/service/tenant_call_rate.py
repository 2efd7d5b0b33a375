"""Each tenant's calls to the router's session and admin endpoints, against its
``api_calls`` token bucket (``TenantConfig.api_calls``).

Contract: :meth:`TenantCallRate.take` admits a call (taking one of its tenant's tokens)
or answers why not, counted in ``kvhint_router_gateway_rejections_total{tenant,
reason="over_call_rate"}`` (the endpoint's own refusal counter counts it too, by its
caller). Callers take it after the key and the cross-site check, before the call reads
its body or the store: a DELETE or hints call of a session id not in memory reads the
store, an end or a hints call sends to a worker, an admin view reads the store. The
hints' actions-per-minute budget counts only the actions sent, not the calls refused
after their read, and ends and admin reads had no per-tenant bound at all. A plain
``GET /v1/responses/{id}`` and a cancel take one too (responses_api.py: a streamed GET
takes an in-flight slot instead, tenant_slots.py).

A call is charged to its key's tenant (a tenant's client or admin key); a global admin
key's, and every call in dev mode, to ``default`` (the global admin's own traffic: a
configured ``default``'s ``api_calls``, else the defaults), whichever tenant it names,
so a fleet admin's tools never use up a tenant's calls. The buckets are the configured
tenants' and ``default``'s (bounded). Single event loop.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from starlette.responses import Response

from kvhint.router.service.inbound import error_response
from kvhint.router.service.metrics import RouterMetrics
from kvhint.router.service.tenancy import Tenant, TenantDirectory

# kvhint_router_gateway_rejections_total{reason} (metric_labels.GATEWAY_REJECTIONS), and the
# session and admin endpoints' own refusal counters' reason.
CALL_RATE_REJECTION = "over_call_rate"


@dataclass(frozen=True, slots=True)
class OverCallRate:
    """A call refused: the 429's message and its ``Retry-After`` (whole seconds, >= 1).
    Every endpoint answers it alike: :meth:`answer`, or (one that builds its own error
    answers) :attr:`message` with :attr:`STATUS` and :attr:`headers`."""

    message: str
    retry_after_s: int

    STATUS = 429

    @property
    def headers(self) -> dict[str, str]:
        """The headers the 429 carries besides the router's own error answer's."""
        return {"retry-after": str(self.retry_after_s)}

    def answer(self) -> Response:
        """The 429, in the router's own error answer (:func:`.inbound.error_response`)."""
        return error_response(self.message, self.STATUS, headers=self.headers)


class TenantCallRate:
    def __init__(self, directory: TenantDirectory, metrics: RouterMetrics,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._directory = directory
        self._metrics = metrics
        self._clock = clock
        # Tenant name -> (tokens left, when they were counted).
        self._buckets: dict[str, tuple[float, float]] = {}

    def take(self, tenant: Tenant | None) -> OverCallRate | None:
        """A call of a key of ``tenant`` (None: a global admin's, or dev mode's). None:
        admitted (one token taken). Else why not, counted; nothing was done."""
        tenant = self._directory.charged(tenant)
        rate = tenant.api_calls
        now = self._clock()
        tokens, at = self._buckets.get(tenant.name, (float(rate.burst), now))
        tokens = min(float(rate.burst), tokens + (now - at) * rate.per_s)
        if tokens >= 1.0:
            self._buckets[tenant.name] = (tokens - 1.0, now)
            return None
        self._buckets[tenant.name] = (tokens, now)
        self._metrics.gateway_rejections.labels(tenant.name, CALL_RATE_REJECTION).inc()
        return OverCallRate(
            f"tenant {tenant.name!r} is over its rate of calls to the session and admin "
            f"endpoints (ends, hints calls, /admin, a stored response's GET or cancel; "
            f"tenants[].api_calls: {rate.per_s:g} per "
            f"second, bursts of {rate.burst}): nothing was done; retry after Retry-After "
            "seconds", max(math.ceil((1.0 - tokens) / rate.per_s), 1))
