"""A tenant's equal share is one rule (1 / the configured tenants) for both things it
defaults: its share of each worker's budgets (``budget.max_worker_share``) and its share
of the sessions kept in memory (``max_sessions``)."""

from __future__ import annotations

import pytest

from kvhint.router.service.settings import RouterSettings
from kvhint.router.service.tenancy import TenantDirectory


@pytest.mark.parametrize("tenants", [0, 1, 3, 7])
def test_the_worker_share_and_the_session_cap_are_the_same_equal_share(tenants: int) -> None:
    """Every tenant without its own settings, and ``default`` (a global admin's traffic),
    gets the same share of both; one that names its own keeps it and still counts as
    one of the tenants sharing."""
    configs = [{"name": f"t{n}", "api_keys": [f"k{n}"]} for n in range(tenants)]
    if configs:
        configs[0] = {**configs[0], "max_sessions": 5,
                      "budget": {"max_worker_share": 0.9}}
    directory = TenantDirectory(RouterSettings(tenants=configs))
    sharing = max(tenants, 1)
    for total in (1, 7, 1000, 200_000):
        for tenant in directory.tenants:
            own = tenants and tenant.name == "t0"
            assert tenant.worker_share == (0.9 if own else pytest.approx(1 / sharing))
            assert directory.session_cap(tenant.name, total) == (
                5 if own else max(total // sharing, 1))
