"""BlockCounts against a recount from scratch: random holdings (pins and retains of
overlapping key runs, owners sharing workers and keys) added and let go in any order.
Guards its per-block bookkeeping (reference counts kept per owner and worker, state
changes inlined for speed): the totals and ``counted`` must always be what counting the
live holdings' distinct blocks again gives, and nothing may stay counted once all go."""

from __future__ import annotations

import random

from kvhint.router.policy.block_counts import PINNED, RETAINED, BlockCounts

_OWNERS = ("w0", "w1", ("tenant-a", "w0"), "tenant-a")
_WORKERS = ("w0", "w1")


def _recount(live: list[tuple[object, str, tuple[int, ...], int]], owner: object
             ) -> tuple[list[int], dict[tuple[str, int], int]]:
    """(totals, state per (worker, key)) of ``owner`` from its live holdings."""
    state: dict[tuple[str, int], int] = {}
    for held_owner, worker, keys, slot in live:
        if held_owner != owner:
            continue
        for key in keys:
            state[(worker, key)] = min(state.get((worker, key), RETAINED), slot)
    totals = [0, 0]
    for value in state.values():
        totals[value] += 1
    return totals, state


def test_block_counts_match_a_recount_of_the_live_holdings() -> None:
    rng = random.Random(7)
    counts = BlockCounts()
    live: list[tuple[object, str, tuple[int, ...], int]] = []
    for step in range(3000):
        if live and (rng.random() < 0.45 or len(live) > 40):
            owner, worker, keys, slot = live.pop(rng.randrange(len(live)))
            counts.named(owner, worker, keys, slot, -1)
        else:
            start = rng.randrange(30)
            keys = tuple(range(start, start + rng.randrange(0, 12)))
            held = (rng.choice(_OWNERS), rng.choice(_WORKERS), keys,
                    rng.choice((PINNED, RETAINED)))
            counts.named(*held, +1)
            live.append(held)
        for owner in _OWNERS:
            totals, state = _recount(live, owner)
            assert counts.totals.get(owner, [0, 0]) == totals, step
            probe_worker = rng.choice(_WORKERS)
            probe = tuple(range(rng.randrange(30), 35))
            for slot in (PINNED, RETAINED):
                expected = sum(1 for key in probe if (probe_worker, key) in state and (
                    slot == RETAINED or state[(probe_worker, key)] == PINNED))
                assert counts.counted(owner, probe_worker, probe, slot) == expected
    for owner, worker, keys, slot in live:
        counts.named(owner, worker, keys, slot, -1)
    assert all(totals == [0, 0] for totals in counts.totals.values())
    assert all(counts.counted(owner, worker, tuple(range(50)), RETAINED) == 0
               for owner in _OWNERS for worker in _WORKERS)
