"""The token bucket behind ``tenants[].api_calls`` (tenant_call_rate.py), on a clock the
test moves: a burst, then one call per 1 / ``per_s``, with the ``Retry-After`` a refused
call is told; a tenant's bucket is its own; a global admin's calls are ``default``'s."""

from __future__ import annotations

from kvhint.router.service.metrics import RouterMetrics
from kvhint.router.service.settings import RouterSettings, TenantConfig
from kvhint.router.service.tenancy import TenantDirectory
from kvhint.router.service.tenant_call_rate import TenantCallRate


def test_a_burst_then_the_refill_rate_with_the_wait_told() -> None:
    directory = TenantDirectory(RouterSettings(tenants=[
        TenantConfig(name="a", api_keys=["ka"], api_calls={"per_s": 0.25, "burst": 2}),
        TenantConfig(name="b", api_keys=["kb"])]))
    metrics = RouterMetrics()
    now = [100.0]
    rate = TenantCallRate(directory, metrics, clock=lambda: now[0])
    a, b = directory.get("a"), directory.get("b")
    assert rate.take(a) is None and rate.take(a) is None  # the burst
    over = rate.take(a)
    assert over is not None and over.retry_after_s == 4  # one token per 4 s
    assert "tenants[].api_calls: 0.25 per second, bursts of 2" in over.message
    now[0] += 3.0
    assert rate.take(a).retry_after_s == 1  # 3 of the 4 s gone
    now[0] += 1.0
    assert rate.take(a) is None and rate.take(a) is not None
    now[0] += 1000.0  # refilled up to the burst, no more
    assert rate.take(a) is None and rate.take(a) is None and rate.take(a) is not None
    # Another tenant's bucket, and a global admin's (default's), are their own.
    assert all(rate.take(b) is None for _ in range(1000))
    assert rate.take(None) is None
    assert metrics.registry.get_sample_value("kvhint_router_gateway_rejections_total", {
        "tenant": "a", "reason": "over_call_rate"}) == 4
