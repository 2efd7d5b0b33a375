"""SessionPrefixIndex: membership, eviction, parent-only nodes, duplicates, replay, bounds."""

from __future__ import annotations

import random

import pytest

from kvhint.engine_plugin.index_events import Cleared, Hit, Removed, Stored
from kvhint.engine_plugin.session_index import SessionPrefixIndex


def chain(index: SessionPrefixIndex, keys: list[int], parent: int | None = None,
          session: str | None = None) -> None:
    index.on_stored(keys, parent, session)


def test_stored_chain_makes_the_session_own_it() -> None:
    index = SessionPrefixIndex()
    chain(index, [1, 2, 3], session="s")
    chain(index, [4, 5], parent=3, session="s")
    assert index.session_blocks("s") == [1, 2, 3, 4, 5]
    assert index.frontiers("s") == [5]  # extending the frontier replaces it
    assert index.chain(5) == [1, 2, 3, 4, 5]
    index.check_invariants()


def test_prefix_hit_establishes_membership_without_stored_events() -> None:
    index = SessionPrefixIndex()
    chain(index, [1, 2, 3, 4], session="a")
    index.on_hit("b", [1, 2, 3])  # b reused a's first three blocks; vLLM emits nothing
    assert index.session_blocks("b") == [1, 2, 3]
    chain(index, [9], parent=3, session="b")  # b's own continuation replaces the hit frontier
    assert index.frontiers("b") == [9]
    assert index.session_blocks("b") == [1, 2, 3, 9]
    assert index.session_blocks("a") == [1, 2, 3, 4]
    index.check_invariants()


def test_branches_keep_several_frontiers_and_shared_ancestors_once() -> None:
    index = SessionPrefixIndex()
    chain(index, [1, 2, 3], session="s")
    chain(index, [7, 8], parent=2, session="s")  # a second branch from block 2
    assert sorted(index.frontiers("s")) == [3, 8]
    assert index.session_blocks("s") == [1, 2, 3, 7, 8] or \
        index.session_blocks("s") == [1, 2, 7, 3, 8]
    assert len(index) == 5


def test_eviction_moves_frontier_to_nearest_resident_ancestor_then_drops_branch() -> None:
    index = SessionPrefixIndex()
    chain(index, [1, 2, 3], session="s")
    index.on_removed([3])
    assert index.frontiers("s") == [2]
    index.on_removed([2])
    index.on_removed([1])
    assert not index.has_session("s")
    assert len(index) == 0
    index.check_invariants()


def test_parent_only_nodes_stay_while_they_connect_resident_descendants() -> None:
    index = SessionPrefixIndex()
    chain(index, [1, 2, 3, 4], session="s")
    index.on_removed([2])  # a middle block goes first (possible with duplicates / resets)
    assert 2 in index and not index.is_resident(2)
    assert index.chain(4) == [1, 2, 3, 4]
    assert index.session_blocks("s") == [1, 3, 4]  # resident only
    index.on_removed([4])
    index.on_removed([3])
    assert 2 not in index and 3 not in index  # nothing below 2 is resident any more
    assert index.frontiers("s") == [1]
    index.check_invariants()


def test_duplicate_physical_copies_need_as_many_removals() -> None:
    index = SessionPrefixIndex()
    chain(index, [1, 2], session="s")
    chain(index, [1, 2], session="t")  # vLLM cached a second physical copy of both
    index.on_removed([2])
    assert index.is_resident(2)  # one copy left
    index.on_removed([2])
    assert not index.is_resident(2)
    assert index.frontiers("s") == [1] and index.frontiers("t") == [1]
    index.check_invariants()


def test_tiers_are_tracked_separately() -> None:
    index = SessionPrefixIndex()
    chain(index, [1, 2], session="s")
    index.on_stored([1, 2], None, None, "CPU")
    index.on_removed([1, 2], "GPU")
    assert not index.is_resident(2, "GPU") and index.is_resident(2, "CPU")
    assert index.frontiers("s") == [2]  # still resident in some tier
    index.on_cleared("CPU")
    assert len(index) == 0 and not index.has_session("s")


def test_cleared_drops_everything() -> None:
    index = SessionPrefixIndex()
    chain(index, [1, 2, 3], session="s")
    index.on_cleared()
    assert len(index) == 0 and index.num_sessions == 0 and index.num_resident_gpu == 0


def test_unknown_removals_and_hits_are_counted_not_fatal() -> None:
    index = SessionPrefixIndex()
    index.on_removed([42])
    index.on_hit("s", [7])
    assert index.counters.unknown_removed == 1 and index.counters.unknown_hits == 1
    assert len(index) == 0


def test_session_prefix_follows_the_latest_branch() -> None:
    index = SessionPrefixIndex()
    chain(index, [1, 2, 3], session="s")
    chain(index, [5, 6], parent=1, session="s")
    assert index.session_prefix("s", 2) == [1, 5]
    assert index.session_prefix("s", 10) == [1, 5, 6]


def test_sessions_and_frontiers_are_bounded() -> None:
    index = SessionPrefixIndex(max_sessions=3, max_frontiers_per_session=2)
    for s in range(5):
        chain(index, [100 + s], session=f"s{s}")
    assert index.num_sessions == 3 and index.counters.sessions_evicted == 2
    assert not index.has_session("s0") and index.has_session("s4")
    chain(index, [1], session="x")
    chain(index, [2], session="x")
    chain(index, [3], session="x")
    assert index.frontiers("x") == [2, 3] and index.counters.frontiers_dropped == 1
    index.check_invariants()


def _random_events(seed: int, steps: int) -> list:
    """A vLLM-like stream: chains stored per session (branching off earlier ones),
    hits on resident prefixes, leaf-first evictions, an occasional clear."""
    rng = random.Random(seed)
    resident: dict[int, int] = {}  # key -> copies
    parents: dict[int, int | None] = {}
    events: list = []
    next_key = 1
    for _ in range(steps):
        roll = rng.random()
        if roll < 0.45 or not resident:
            keys = list(resident)
            parent = rng.choice(keys) if keys and rng.random() < 0.7 else None
            new = []
            for _ in range(rng.randint(1, 4)):
                if rng.random() < 0.1 and keys:
                    key = rng.choice(keys)  # a duplicate copy of a known hash
                    if parents.get(key, "x") != (new[-1] if new else parent):
                        continue
                else:
                    key = next_key
                    next_key += 1
                parents[key] = new[-1] if new else parent
                new.append(key)
                resident[key] = resident.get(key, 0) + 1
            if new:
                events.append(Stored(tuple(new), parent, f"s{rng.randint(0, 30)}"))
        elif roll < 0.65:
            key = rng.choice(list(resident))
            path = []
            cur: int | None = key
            while cur is not None and cur in resident:
                path.append(cur)
                cur = parents[cur]
            if cur is None:
                events.append(Hit(f"s{rng.randint(0, 30)}", tuple(reversed(path))))
        elif roll < 0.995:
            key = rng.choice(list(resident))
            resident[key] -= 1
            if resident[key] == 0:
                del resident[key]
            events.append(Removed((key,)))
        else:
            resident.clear()
            events.append(Cleared())
    return events


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_streams_keep_invariants_and_replay_to_the_same_state(seed: int) -> None:
    events = _random_events(seed, 3000)
    live = SessionPrefixIndex(max_sessions=20, max_frontiers_per_session=4)
    for i, event in enumerate(events):
        live.apply(event)
        if i % 250 == 0:
            live.check_invariants()
    live.check_invariants()
    replayed = SessionPrefixIndex(max_sessions=20, max_frontiers_per_session=4)
    replayed.replay(events)
    assert replayed.state() == live.state()


def test_memory_is_bounded_by_residency_under_leaf_first_churn() -> None:
    """Stream 20k blocks through a 500-block LRU that behaves like vLLM's free queue (a
    request touches its cached prefix, then frees its whole chain leaf first): the index
    never holds more than the resident blocks plus the request in flight."""
    index = SessionPrefixIndex(max_sessions=1000)
    lru: list[int] = []  # eviction order, first evicted first
    next_key = 1
    peak = 0
    for request in range(5000):
        path: list[int] = []
        if lru and request % 3:
            parent = lru[-1 - (request % min(len(lru), 20))]
            path = index.chain(parent)
            for key in path:
                lru.remove(key)
        keys = list(range(next_key, next_key + 4))
        next_key += 4
        index.on_stored(keys, path[-1] if path else None, f"s{request % 200}")
        lru.extend(reversed(path + keys))
        peak = max(peak, len(index))
        while len(lru) > 500:
            index.on_removed([lru.pop(0)])
    index.check_invariants()
    assert index.num_resident_gpu == 500 and len(index) == 500
    assert peak <= 500 + 4


def test_snapshot_lists_parents_before_children() -> None:
    index = SessionPrefixIndex()
    chain(index, [1, 2, 3], session="s")
    chain(index, [4], parent=2, session="t")
    blocks = index.snapshot_blocks()
    order = [b[0] for b in blocks]
    for key, parent, medium in blocks:
        assert medium == "GPU"
        if parent is not None:
            assert order.index(parent) < order.index(key)
    assert dict(index.snapshot_sessions()) == {"s": [3], "t": [4]}


def test_exclusive_blocks_stop_where_another_session_or_branch_shares() -> None:
    index = SessionPrefixIndex()
    chain(index, [1, 2], session="sys")           # a shared system prompt
    chain(index, [3, 4, 5], parent=2, session="a")
    chain(index, [6, 7], parent=2, session="b")   # b forks off at block 2
    assert index.exclusive_blocks("a") == [5, 4, 3]
    assert index.exclusive_blocks("b") == [7, 6]
    assert index.exclusive_blocks("sys") == []    # 2 has two children
    index.on_hit("c", [1, 2, 3, 4])               # c's frontier now sits inside a's chain
    assert index.exclusive_blocks("a") == [5]
    index.on_removed([5])                         # a's frontier moves up to 4, shared with c
    assert index.exclusive_blocks("a") == []
    assert index.exclusive_blocks("nobody") == []
