"""The shared-prefix scan both the live lifecycle and the simulator run."""

from __future__ import annotations

from kvhint.router.policy import (
    PlannedAction,
    SessionChain,
    SharedPrefixRetains,
    find_shared_prefixes,
)
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
