"""The shared-prefix scan both the live lifecycle and the simulator run, and the
planner's retains of what it finds."""

from __future__ import annotations

from dataclasses import replace

from planner_fixtures import finish, make_ctx, session_after_turn, typed

from kvhint.router.policy import (
    USER_GAP,
    FinishReason,
    GapObserved,
    Holdings,
    LearnedStats,
    PlannedAction,
    ReturnObserved,
    SessionChain,
    SharedPrefix,
    SharedPrefixRetains,
    find_shared_prefixes,
    plan_shared_prefixes,
    session_chain,
    session_hit_density,
)
from kvhint.router.policy.priority import priority_density, retain_priority
from kvhint.schemas.hints import RetainPayload, Target, make_action

SYSTEM = (101, 102, 103, 104)  # four blocks every session of tenant "t" starts with
ONCE_A_MINUTE = 1 / 60.0


def _chains() -> list[SessionChain]:
    chains = [SessionChain("w0", "t", (*SYSTEM, 1000 + n, 2000 + n), ONCE_A_MINUTE)
              for n in range(4)]
    # Another tenant: never pooled. Another worker: counted there.
    chains.append(SessionChain("w0", "other", SYSTEM, ONCE_A_MINUTE))
    chains.append(SessionChain("w1", "t", (*SYSTEM, 7), ONCE_A_MINUTE))
    # Sessions the planner values at nothing (left to LRU) do not count.
    chains += [SessionChain("w1", "t", (*SYSTEM, 8 + n), 0.0) for n in range(5)]
    return chains


def test_the_longest_prefix_enough_sessions_share_is_found_per_worker_and_tenant() -> None:
    found = find_shared_prefixes(_chains(), min_sessions=3, protected_until={})
    assert len(found) == 1
    (prefix,) = found
    assert prefix.worker_id == "w0" and prefix.tenant == "t"
    assert prefix.block_hashes == SYSTEM and prefix.sessions == 4
    assert prefix.hit_density == 4 * ONCE_A_MINUTE
    assert prefix.protected_until is None
    assert prefix.key == f"t:{SYSTEM[-1]:016x}"
    # Prefixes are counted at power-of-two lengths, then extended to where the sessions
    # part: five sessions on blocks (1, 2, 3) share a 3-block prefix, found at 2.
    short = [SessionChain("w0", "t", (1, 2, 3, 1000 + n), ONCE_A_MINUTE) for n in range(5)]
    assert [p.block_hashes for p in find_shared_prefixes(short, 5, {})] == [(1, 2, 3)]
    assert find_shared_prefixes(short, 6, {}) == []
    # The extension stops at the first block one of the prefix's sessions does not have
    # (a session whose prompt is the bare system prompt, or one that parted at block 3).
    bare = [*short, SessionChain("w0", "t", (1, 2), ONCE_A_MINUTE)]
    assert [p.block_hashes for p in find_shared_prefixes(bare, 5, {})] == [(1, 2)]
    parted = [*short, SessionChain("w0", "t", (1, 2, 9, 9), ONCE_A_MINUTE)]
    (prefix,) = find_shared_prefixes(parted, 5, {})
    assert prefix.block_hashes == (1, 2) and prefix.sessions == 6


def _retain(worker: str, scope: str, expires_at: float) -> PlannedAction:
    action = make_action("kvh-1", RetainPayload(target=Target(block_hashes=[1]), priority=90,
                                                ttl_s=100.0))
    return PlannedAction(worker, action, scope, "t", 1, expires_at, "shared_prefix")


def test_retains_sent_are_remembered_until_they_end_and_scans_come_on_schedule() -> None:
    retains = SharedPrefixRetains()
    assert retains.scan_due(0.0, 10.0)
    assert not retains.scan_due(9.9, 10.0)
    assert retains.scan_due(10.0, 10.0)
    # The wall clock stepped back an hour: a scan is due at once, then on schedule.
    assert retains.scan_due(10.0 - 3600.0, 10.0)
    assert not retains.scan_due(15.0 - 3600.0, 10.0)
    assert retains.scan_due(20.0, 10.0)
    (prefix,) = find_shared_prefixes(_chains(), 3, retains.until)
    retains.sent([_retain("w0", f"prefix:{prefix.key}", 110.0),
                  _retain("w0", "t/s1", 500.0)])  # a session's action: not a prefix
    assert dict(retains.until) == {f"w0:{prefix.key}": 110.0}
    (again,) = find_shared_prefixes(_chains(), 3, retains.until)
    assert again.protected_until == 110.0
    retains.expire(109.0)
    assert len(retains.until) == 1
    retains.expire(110.0)
    assert dict(retains.until) == {}


def test_shared_prefixes_used_by_many_sessions_are_retained_by_hash() -> None:
    ctx = make_ctx()
    busy = 5 / 60.0  # five sessions each expected back about once a minute
    prefixes = [SharedPrefix("w0", "sys-a", (1, 2, 3), sessions=5, hit_density=busy),
                SharedPrefix("w0", "rare", (4,), sessions=1, hit_density=busy),
                SharedPrefix("w0", "fresh", (5, 6), sessions=9, protected_until=10_000.0,
                             hit_density=busy),
                # Shared, but by sessions not expected back: left to LRU.
                SharedPrefix("w0", "gone", (7, 8), sessions=6, hit_density=1 / 86_400)]
    (planned,) = plan_shared_prefixes(ctx, prefixes)
    action = typed(planned)
    assert action.payload.target.block_hashes == [1, 2, 3]
    assert planned.scope == "prefix:sys-a"
    # Worth what its sessions' next turns are worth together: their summed density.
    assert action.payload.priority == retain_priority(busy) == 82


def test_a_session_is_worth_what_the_planner_last_valued_it_at() -> None:
    """What a session adds to a shared prefix's worth: its retain priority read back as a
    hit density (O(1) per session), its start-of-gap value while a turn is in flight,
    nothing once left to LRU or ended."""
    stats = LearnedStats()
    for depth in (1, 2):
        for _ in range(10):
            stats.apply(ReturnObserved(depth, True))
            stats.apply(GapObserved(USER_GAP, depth, 30.0))
    ctx = make_ctx(now=100.0, stats=stats)
    in_flight = session_after_turn(ctx, at=90.0)
    assert session_hit_density(ctx, in_flight) == stats.hit_density(USER_GAP, 1, 0.0,
                                                                    ctx.config.horizon_s)
    waiting = finish(ctx, in_flight, FinishReason.STOP, at=95.0).session
    priority = waiting.protection.priority
    assert 0 < priority <= 100
    assert session_hit_density(ctx, waiting) == priority_density(priority)
    assert retain_priority(priority_density(priority)) == priority
    assert session_hit_density(ctx, replace(waiting, protection=None)) == 0.0
    assert session_hit_density(ctx, replace(waiting, ended=True)) == 0.0
    # What a scan gets: the chain with that worth, nothing for a session worth nothing or
    # not yet placed.
    chain = session_chain(ctx, waiting, "w0", (1, 2))
    assert chain is not None and chain.hit_density == priority_density(priority)
    assert (chain.worker_id, chain.tenant, chain.block_hashes) == ("w0", "t", (1, 2))
    assert session_chain(ctx, replace(waiting, protection=None), "w0", (1, 2)) is None
    assert session_chain(ctx, waiting, None, (1, 2)) is None
    assert session_chain(ctx, waiting, "w0", ()) is None


def test_shared_prefixes_are_retained_when_session_retains_fill_the_worker_budget() -> None:
    """Retains are soft (the worker displaces lower priorities), so a worker whose budget
    the planner's session retains already fill still gets its shared system prompt
    retained; only the tenant's budget stops it."""
    full = make_ctx()
    worker = full.workers["w0"]
    limit = worker.budgets.max_retained_blocks
    assert limit is not None
    busy = replace(worker, held=Holdings(retained_blocks=limit))
    ctx = replace(full, workers={**full.workers, "w0": busy})
    prefixes = [SharedPrefix("w0", "sys-a", (1, 2, 3), sessions=5, tenant="t",
                             hit_density=5 / 60.0)]
    (planned,) = plan_shared_prefixes(ctx, prefixes)
    assert typed(planned).payload.priority == 82

    capped = replace(ctx, config=replace(ctx.config, tenant_max_retained_blocks=4),
                     tenant_held={"t": Holdings(retained_blocks=2)})
    assert plan_shared_prefixes(capped, prefixes) == ()
    # Two prefixes of one tenant count together against its budget.
    roomy = replace(capped, tenant_held={})
    two = prefixes + [SharedPrefix("w0", "sys-b", (7, 8), sessions=4, tenant="t",
                                   hit_density=5 / 60.0)]
    assert [p.scope for p in plan_shared_prefixes(roomy, two)] == ["prefix:sys-a"]
