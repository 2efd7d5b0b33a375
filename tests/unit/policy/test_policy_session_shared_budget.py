"""A session's Pin/Retain costs its tenant's retain or pin budget, and a Pin its worker's
pin budget, only the blocks it adds to the holdings ledger's counts (distinct blocks, as
the ledger, the sessions API and the worker count them): ``PlannerContext.chain`` (the
session's last prompt's block hashes, what its target names) and
``PlannerContext.holding_change`` (the ledger's ``replacing``), as the live router's
``HintDispatcher.context`` and the simulator pass them. Before, a session's first
protection was charged its whole chain, a system prompt a shared prefix's Retain or its
other sessions already held included. Real ledger throughout."""

from __future__ import annotations

import copy
import random
from dataclasses import replace

from msgspec import structs
from planner_fixtures import BS, BUDGETS, NO_HOST, fast_search, finish, make_ctx, typed

from kvhint.router.policy import (
    FinishReason,
    Holdings,
    HoldingsLedger,
    PlannedAction,
    PlannerConfig,
    PlannerContext,
    SessionPlanState,
    TurnRouted,
    WorkerPlanView,
    plan_turn_routed,
    target_keys,
)

SYSTEM = (101, 102, 103, 104)  # the system prompt every session of tenant "t" starts with
CHAIN = (*SYSTEM, 201, 202, 203, 204)  # session t/s's last prompt: 8 blocks


def _ledger() -> HoldingsLedger:
    """Tenant "t" on w0: a shared prefix's Retain of the system prompt and two other
    sessions' Retains over it and 2 blocks of their own: 4 + 2 x 2 = 8 retained."""
    ledger = HoldingsLedger()
    ledger.record(action_id="p", worker_id="w0", tenant="t", scope="prefix:t:sys",
                  action_type="kv.retain", blocks=4, expires_at=1000.0, keys=SYSTEM)
    for n in range(2):
        ledger.record(action_id=f"o{n}", worker_id="w0", tenant="t", scope=f"t/o{n}",
                      action_type="kv.retain", blocks=6, expires_at=1000.0,
                      keys=(*SYSTEM, 300 + n, 400 + n))
    assert ledger.tenant("t") == Holdings(0, 8)
    return ledger


def _live_ctx(ledger: HoldingsLedger, config: PlannerConfig, chain: tuple[int, ...] = CHAIN,
              **kwargs) -> PlannerContext:
    """Tenant "t"'s context planning session t/s, as HintDispatcher.context builds it."""
    ctx = make_ctx(config=config, **kwargs)
    return replace(ctx, tenant_held={"t": ledger.tenant("t")},
                   tenant_retain_added=ledger.tenant_retain_added, chain=chain,
                   holding_change=ledger.replacing)


def _record(ledger: HoldingsLedger, planned: PlannedAction, chain: tuple[int, ...]) -> None:
    """As the live router's sender records a planned action (hint_send._hold)."""
    ledger.record(action_id=planned.action.action_id, worker_id=planned.worker_id,
                  tenant=planned.tenant, scope=planned.scope,
                  action_type=planned.action_type, blocks=planned.blocks,
                  expires_at=planned.expires_at,
                  keys=target_keys(planned.action_type, planned.action.payload, BS, chain))


def _retains(actions: tuple[PlannedAction, ...]) -> list[PlannedAction]:
    return [a for a in actions if a.action_type == "kv.retain" and typed(a).payload.priority]


def _session(ctx: PlannerContext, prompt: int = 8 * BS) -> SessionPlanState:
    return plan_turn_routed(ctx, None, TurnRouted("t/s", "t", "w0", prompt, 0.0)).session


def test_a_new_sessions_retain_over_a_held_system_prompt_costs_its_own_blocks() -> None:
    """Near its cap (8 held, 12 allowed), the tenant's new session (8 blocks, 4 of them the
    system prompt the prefix's Retain holds) is retained: it adds 4. Before: charged 8,
    refused (8 + 8 > 12), the session left to LRU."""
    ledger = _ledger()
    config = PlannerConfig(tenant_max_retained_blocks=12)
    ctx = _live_ctx(ledger, config)
    (retain,) = _retains(finish(ctx, _session(ctx), FinishReason.STOP).actions)
    assert retain.blocks == 8 and typed(retain).payload.target.prefix_tokens == 8 * BS
    _record(ledger, retain, CHAIN)
    assert ledger.tenant("t") == Holdings(0, 12)  # the ledger agrees: at the cap, not past
    # One block less room: refused, as the ledger would then count 12 > 11.
    tight = _live_ctx(_ledger(), replace(config, tenant_max_retained_blocks=11))
    assert _retains(finish(tight, _session(tight), FinishReason.STOP).actions) == []
    # Without the ledger's count (a caller that passes none), the whole chain is charged.
    blind = replace(ctx, tenant_held={"t": Holdings(0, 8)}, holding_change=None)
    assert _retains(finish(blind, _session(blind), FinishReason.STOP).actions) == []


def test_a_re_retain_frees_only_what_its_old_retain_alone_held() -> None:
    """The session's chain grows 8 -> 10 blocks: its old Retain frees its 4 own blocks
    (the system prompt stays, held by the others) and the new one adds 6: +2, as the
    ledger counts it. Freeing all 8 would let it past the cap."""
    ledger = _ledger()
    ctx = _live_ctx(ledger, PlannerConfig(tenant_max_retained_blocks=12))
    first = finish(ctx, _session(ctx), FinishReason.STOP)
    (retain,) = _retains(first.actions)
    _record(ledger, retain, CHAIN)
    longer = (*CHAIN, 205, 206)
    for cap, fits in ((14, True), (13, False)):
        grown = _live_ctx(ledger, PlannerConfig(tenant_max_retained_blocks=cap), longer,
                          now=2.0)
        routed = plan_turn_routed(grown, first.session,
                                  TurnRouted("t/s", "t", "w0", 10 * BS, 2.0)).session
        result = finish(grown, routed, FinishReason.STOP, at=3.0, prompt=10 * BS)
        assert bool(_retains(result.actions)) is fits, cap
        if fits:
            after = copy.deepcopy(ledger)
            _record(after, _retains(result.actions)[0], longer)
            assert after.tenant("t") == Holdings(0, 14)


def test_a_first_pin_over_a_system_prompt_other_pins_hold_fits_the_worker_room() -> None:
    """Another session's Pin holds the system prompt on w0 (6 pinned of 10): the new
    session's tool-gap Pin adds its 4 own blocks, as the worker counts its pin budget
    (engine_plugin/holds.py: only blocks not pinned yet take room). Before: charged 8 of
    4 left, retained at top priority instead."""
    ledger = HoldingsLedger()
    ledger.record(action_id="x", worker_id="w0", tenant="t", scope="t/o", action_type="kv.pin",
                  blocks=6, expires_at=1000.0, keys=(*SYSTEM, 300, 400))
    for budget, pinned in ((10, True), (9, False)):
        view = WorkerPlanView("w0", BS, structs.replace(BUDGETS, max_pinned_blocks=budget), NO_HOST,
                              held=ledger.worker("w0"),
                              pinned_claims=ledger.claims("w0")[0])
        ctx = _live_ctx(ledger, PlannerConfig(tenant_max_pinned_blocks=14),
                        stats=fast_search(), w0=view)
        (action,) = finish(ctx, _session(ctx), FinishReason.TOOL_CALLS, ("search",)).actions
        assert (action.action_type == "kv.pin") is pinned, budget
        if pinned:
            # The tenant's pin budget counts the same way: 6 held + 4 added fit a cap of
            # 10 (before: 6 + 8 did not).
            tenant_tight = _live_ctx(ledger, PlannerConfig(tenant_max_pinned_blocks=10),
                                     stats=fast_search(), w0=view)
            (again,) = finish(tenant_tight, _session(tenant_tight), FinishReason.TOOL_CALLS,
                              ("search",)).actions
            assert again.action_type == "kv.pin"
            after = copy.deepcopy(ledger)
            _record(after, action, CHAIN)
            assert after.worker("w0").pinned_blocks == 10
            assert after.tenant("t").pinned_blocks == 10


def _random_ledger(rng: random.Random) -> HoldingsLedger:
    """Holdings of tenants t and u on w0 (and one on w1) over prefixes of a few chains
    sharing the system prompt, some with unnamed blocks past their names; session t/s's
    own earlier holding among them at times."""
    chains = [CHAIN, (*CHAIN, 205, 206), (*SYSTEM, 301, 302, 303), (*SYSTEM[:2], 501, 502)]
    ledger = HoldingsLedger()
    scopes = ["t/s", "t/a", "t/b", "u/c", "prefix:t:sys", "t/d"]
    for n in range(rng.randint(0, 6)):
        keys = rng.choice(chains)[:rng.randint(1, 8)]
        ledger.record(action_id=f"h{n}", worker_id=rng.choice(["w0", "w0", "w0", "w1"]),
                      tenant=rng.choice(["t", "t", "u"]), scope=rng.choice(scopes),
                      action_type=rng.choice(["kv.pin", "kv.retain"]),
                      blocks=len(keys) + rng.choice([0, 0, 1, 2]), expires_at=1000.0,
                      keys=keys)
    return ledger


def _count(ledger: HoldingsLedger, pin: bool, tenant: str | None = "t") -> int:
    held = ledger.tenant(tenant) if tenant is not None else ledger.worker("w0")
    return held.pinned_blocks if pin else held.retained_blocks


def test_the_planner_charges_exactly_what_the_ledger_then_counts() -> None:
    """Random holdings: the session's Retain fits the tenant's retain cap, and its Pin the
    worker's and the tenant's pin budgets, exactly when recording it leaves the ledger's
    count within them (budgets chosen held within, before and with the session's own
    earlier holding gone)."""
    rng = random.Random(7)
    fitted = 0
    for _ in range(400):
        ledger = _random_ledger(rng)
        without_own = copy.deepcopy(ledger)
        without_own.release_scope("w0", "t/s")
        pin = rng.random() < 0.5
        kind = "kv.pin" if pin else "kv.retain"
        cap = max(_count(ledger, pin), _count(without_own, pin)) + rng.randint(0, 9)
        worker_budget = 10_000
        if pin:
            worker_budget = max(_count(ledger, True, None),
                                _count(without_own, True, None)) + rng.randint(0, 9)
        config = PlannerConfig(tenant_max_pinned_blocks=cap if pin else None,
                               tenant_max_retained_blocks=None if pin else cap)
        view = WorkerPlanView("w0", BS, structs.replace(BUDGETS, max_pinned_blocks=worker_budget),
                              NO_HOST, held=ledger.worker("w0"),
                              pinned_claims=ledger.claims("w0")[0])
        ctx = _live_ctx(ledger, config, stats=fast_search(), w0=view)
        reason = FinishReason.TOOL_CALLS if pin else FinishReason.STOP
        result = finish(ctx, _session(ctx), reason, ("search",) if pin else ())
        sent = [a for a in result.actions
                if a.action_type == kind and (pin or typed(a).payload.priority)]
        # What the ledger counts once the session's 8 blocks are held so.
        probe = copy.deepcopy(ledger)
        probe.record(action_id="new", worker_id="w0", tenant="t", scope="t/s",
                     action_type=kind, blocks=8, expires_at=1000.0, keys=CHAIN)
        fits = _count(probe, pin) <= cap and _count(probe, True, None) <= worker_budget
        assert bool(sent) is fits, (kind, cap, worker_budget, _count(probe, pin))
        assert all(a.blocks == 8 for a in sent)
        fitted += fits
    assert 50 < fitted < 350  # both outcomes well exercised


def test_the_ledgers_replacing_is_what_recording_then_changes() -> None:
    """``HoldingsLedger.replacing`` (the planner's ``holding_change``): freed + added is
    exactly the change :meth:`record` then makes to the worker's and the tenant's counts,
    pinned and retained, whatever the scope held (a Pin, a Retain, another tenant's,
    unnamed blocks) and whatever the new holding is."""
    rng = random.Random(11)
    for _ in range(600):
        ledger = _random_ledger(rng)
        kind = rng.choice(["kv.pin", "kv.retain", "kv.prefetch"])
        scope = rng.choice(["t/s", "t/a", "u/c", "t/new"])
        tenant = rng.choice(["t", "u"])
        keys = rng.choice([CHAIN, (*SYSTEM, 301, 302), ()])[:rng.randint(0, 8)]
        blocks = len(keys) + rng.choice([0, 1, 3])
        if blocks == 0:
            continue
        on_worker, of_tenant = ledger.replacing("w0", tenant, scope, kind, blocks, keys)
        before_worker, before_tenant = ledger.worker("w0"), ledger.tenant(tenant)
        ledger.record(action_id="new", worker_id="w0", tenant=tenant, scope=scope,
                      action_type=kind, blocks=blocks, expires_at=1000.0, keys=keys)
        for before, change, after in ((before_worker, on_worker, ledger.worker("w0")),
                                      (before_tenant, of_tenant, ledger.tenant(tenant))):
            assert after.pinned_blocks == (before.pinned_blocks - change.freed.pinned_blocks
                                           + change.added.pinned_blocks)
            assert after.retained_blocks == (before.retained_blocks
                                             - change.freed.retained_blocks
                                             + change.added.retained_blocks)
