"""A shared prefix's Retain and the sessions' Retains over it count its blocks once
against the tenant's retain budget: in the holdings ledger (and so in the sessions API's
check, ``HoldingsLedger.added``) and in the planner's plan of the prefix's Retain
(``PlannerContext.tenant_retain_added``, the ledger's own count)."""

from __future__ import annotations

from dataclasses import replace

from planner_fixtures import make_ctx

from kvhint.router.policy import (
    Holdings,
    HoldingsLedger,
    PlannerContext,
    SharedPrefix,
    plan_shared_prefixes,
)

SYSTEM = (101, 102, 103, 104)  # the system prompt every session of tenant "t" starts with


def _ledger_with_sessions(sessions: int = 3) -> HoldingsLedger:
    """The planner's Retains of ``sessions`` sessions of tenant "t" on w0, each over the
    system prompt and 2 blocks of its own, as the live router records them (named by
    the session's last prompt's block hashes)."""
    ledger = HoldingsLedger()
    for n in range(sessions):
        ledger.record(action_id=f"r{n}", worker_id="w0", tenant="t", scope=f"t/s{n}",
                      action_type="kv.retain", blocks=6, expires_at=1000.0,
                      keys=(*SYSTEM, 1000 + n, 2000 + n))
    return ledger


def _prefix(blocks: tuple[int, ...] = SYSTEM, key: str = "sys") -> SharedPrefix:
    return SharedPrefix("w0", key, blocks, sessions=3, tenant="t", hit_density=3 / 60.0)


def _ctx(ledger: HoldingsLedger, cap: int) -> PlannerContext:
    """The planning context the live router builds for tenant "t" (HintDispatcher.context)."""
    ctx = make_ctx()
    return replace(ctx, config=replace(ctx.config, tenant_max_retained_blocks=cap),
                   tenant_held={"t": ledger.tenant("t")},
                   tenant_retain_added=ledger.tenant_retain_added)


def test_the_ledger_counts_a_prefix_the_sessions_retain_too_once() -> None:
    ledger = _ledger_with_sessions()
    assert ledger.tenant("t") == Holdings(0, 4 + 3 * 2)
    # The prefix's Retain (block-hash target) would add nothing, the API's check says so...
    assert ledger.added("w0", "t", "kv.retain", 4, SYSTEM, "prefix:sys")[1] == 0
    assert ledger.tenant_retain_added("t", "w0", SYSTEM) == 0
    ledger.record(action_id="p", worker_id="w0", tenant="t", scope="prefix:sys",
                  action_type="kv.retain", blocks=4, expires_at=1000.0, keys=SYSTEM)
    # ...and, recorded, adds nothing: each block counted once, as the worker holds it.
    assert ledger.tenant("t") == Holdings(0, 10)
    # A session's later Retain over the held prefix adds only its own blocks.
    assert ledger.added("w0", "t", "kv.retain", 6, (*SYSTEM, 7, 8), "t/s9")[1] == 2
    # Another tenant's holdings are not this one's.
    assert ledger.tenant_retain_added("u", "w0", SYSTEM) == 4


def test_a_prefix_the_sessions_already_retain_fits_a_tenant_at_its_cap() -> None:
    """Before: the planner charged the prefix's 4 blocks on top of the sessions' 10, which
    already count them (10 + 4 > 12), and refused the Retain of the shared system
    prompt (the tenant's most valuable blocks) though it adds no block to the tenant."""
    ledger = _ledger_with_sessions()
    ctx = _ctx(ledger, cap=10)  # the sessions fill the cap exactly
    (planned,) = plan_shared_prefixes(ctx, [_prefix()])
    assert planned.scope == "prefix:sys" and planned.blocks == 4
    # Charged what it adds: a prefix one block longer than the sessions hold needs room
    # for that block only.
    longer = (*SYSTEM, 1000)  # session 0's next block: held by its Retain
    assert len(plan_shared_prefixes(ctx, [_prefix(longer)])) == 1
    unheld = (*SYSTEM, 555)
    assert plan_shared_prefixes(ctx, [_prefix(unheld)]) == ()
    assert len(plan_shared_prefixes(_ctx(ledger, cap=11), [_prefix(unheld)])) == 1
    # Two prefixes in one plan count together: the second's new block no longer fits.
    assert [p.scope for p in plan_shared_prefixes(
        _ctx(ledger, cap=11), [_prefix(unheld), _prefix((*SYSTEM, 556), "sys2")])] == [
            "prefix:sys"]


def test_a_prefix_retained_again_is_not_charged_over_its_own_retain() -> None:
    """Renewed before its Retain ends (within half the horizon), the prefix's blocks are
    held by that Retain, which the new one supersedes: it adds nothing."""
    ledger = HoldingsLedger()
    ledger.record(action_id="p", worker_id="w0", tenant="t", scope="prefix:sys",
                  action_type="kv.retain", blocks=4, expires_at=1000.0, keys=SYSTEM)
    ctx = _ctx(ledger, cap=4)
    assert len(plan_shared_prefixes(ctx, [_prefix()])) == 1
    # Without the ledger's count (a caller that gives none), every block counts: refused.
    assert plan_shared_prefixes(replace(ctx, tenant_retain_added=None), [_prefix()]) == ()
