"""TenantReadSlots: shared store-read slots, at most a few of them one tenant's
(session_reads.py waits for one; responses_sessions.py takes one only if free now)."""

from __future__ import annotations

import asyncio

import pytest

from kvhint.router.service.read_slots import TenantReadSlots


async def test_one_tenant_holds_at_most_its_share_and_entries_go_with_their_last() -> None:
    slots = TenantReadSlots(4, 3)
    assert [await slots.try_acquire("a") for _ in range(4)] == [True, True, True, False]
    assert await slots.try_acquire("b") and not await slots.try_acquire("c")
    assert (slots.held, slots.tenants) == (4, 2)
    for tenant in ("a", "a", "a", "b"):
        slots.release(tenant)
    assert (slots.held, slots.tenants) == (0, 0)


async def test_a_waiter_given_up_on_holds_nothing() -> None:
    slots = TenantReadSlots(3, 2)
    await slots.acquire("a")
    await slots.acquire("a")
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.05):
            await slots.acquire("a")  # a's own two are taken: it waits
    await asyncio.wait_for(slots.acquire("b"), 1)  # b's is free at once
    assert (slots.held, slots.tenants) == (3, 2)
    for tenant in ("a", "a", "b"):
        slots.release(tenant)
    assert (slots.held, slots.tenants) == (0, 0)


def test_a_share_above_the_total_is_refused() -> None:
    with pytest.raises(ValueError):
        TenantReadSlots(3, 4)
