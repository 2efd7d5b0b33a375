"""Holds on a hybrid model (sliding-window layers beside full attention: Gemma 3, gpt-oss)
against vLLM's real KVCacheManager.

vLLM's hybrid prefix hit needs, besides the full-attention group's blocks, every
sliding-window group's blocks of the last window before the hit point
(``SlidingWindowManager.find_longest_cache_hit``). A hold that took the full-attention
group's blocks alone (found in review) left those to eviction: after unrelated traffic
the session's next turn hit nothing although its Pin was answered ``accepted``. Holds
now take them too (``engine_plugin/group_holds.py``), budgets count pool blocks, and what
the router is told (``applied``, losses) stays in target positions.
"""

from __future__ import annotations

import pytest
from hybrid_fixtures import BLOCK, GEMMA, GEMMA_FULL_FIRST
from hybrid_fixtures import Bench as _HybridBench


def _Bench(full_first: bool = False, num_blocks: int = 60, **config) -> _HybridBench:
    return _HybridBench(GEMMA_FULL_FIRST if full_first else GEMMA, num_blocks, **config)


# Pool blocks a hold of the 4-block prefix takes: 4 positions' full-attention blocks, and
# each of the 5 sliding-window groups' blocks of the last cdiv(32 - 1, 16) = 2 positions.
HELD = 4 + 5 * 2


@pytest.mark.parametrize("full_first", [False, True])
def test_a_pinned_session_keeps_its_prefix_hit_on_a_hybrid_model(full_first: bool) -> None:
    bench = _Bench(full_first, pin_budget_fraction=0.5)
    outcome = bench.hint("kv.pin", {"target": {"session_id": "s"}, "ttl_s": 600})
    # ``applied`` stays in target positions (the router's unit).
    assert outcome.status.value == "accepted" and outcome.applied.blocks == 4
    assert outcome.applied.tokens == 4 * BLOCK
    bench.traffic()
    assert bench.core.executor.pinned_blocks == HELD  # the gauge counts pool blocks
    # What the Pin promised: the session's next turn hits its pinned prefix.
    assert bench.next_turn_hit() == 4 * BLOCK


@pytest.mark.parametrize("how", ["retain", "prefetch"])
def test_a_retained_session_keeps_its_prefix_hit_on_a_hybrid_model(how: str) -> None:
    """Retain and a Prefetch's retain (and so a donor's: the same claim path)."""
    bench = _Bench(retain_budget_fraction=0.5)
    if how == "retain":
        outcome = bench.hint("kv.retain", {"target": {"session_id": "s"}, "priority": 50,
                                           "ttl_s": 600})
    else:
        keys = bench.core.index.session_prefix("s", 4)
        outcome = bench.hint("kv.prefetch", {"target": {"block_hashes": keys},
                                             "deadline_s": 600})
    assert outcome.status.value == "accepted" and outcome.applied.blocks == 4
    bench.traffic()
    assert bench.core.executor.retained_blocks == HELD
    assert bench.next_turn_hit() == 4 * BLOCK


@pytest.mark.parametrize("kind", ["pin", "retain"])
def test_a_short_budget_keeps_a_shorter_prefix_with_its_window(kind: str) -> None:
    """12 pool blocks (int(0.21 * 59)) take 2 positions and their window, not the first
    12 blocks in list order (4 positions and 4 of the 5 groups' windows: no hit at all)."""
    bench = _Bench(**{f"{kind}_budget_fraction": 0.21})
    executor = bench.core.executor
    pin = kind == "pin"
    assert (executor.max_pinned_blocks if pin else executor.max_retained_blocks) == 12
    payload = {"target": {"session_id": "s"}, "ttl_s": 600, **({} if pin else {"priority": 50})}
    outcome = bench.hint(f"kv.{kind}", payload)
    assert outcome.status.value == "clipped" and outcome.applied.blocks == 2
    assert f"{kind} budget" in outcome.reason
    bench.traffic()
    held = executor.pinned_blocks if pin else executor.retained_blocks
    assert held == 2 + 5 * 2
    assert bench.next_turn_hit() == 2 * BLOCK


def test_losses_are_reported_in_target_positions_and_relief_frees_pool_blocks() -> None:
    bench = _Bench(num_blocks=40, retain_budget_fraction=0.9)
    outcome = bench.hint("kv.retain", {"target": {"session_id": "s"}, "priority": 50,
                                       "ttl_s": 600})
    assert outcome.applied.blocks == 4 and bench.core.executor.retained_blocks == HELD
    # 5 blocks per group in 6 groups: 30 of the 39; only relief of the retain makes room.
    assert bench.admit([bench.rng.randrange(1, 500) for _ in range(4 * BLOCK + 1)]) == 0
    counters = bench.core.executor.holds.counters
    assert counters.released_under_pressure > 0  # pool blocks, side ones among them
    (release,) = bench.core.executor.take_releases()
    assert release.reason.value == "pressure"
    assert release.released.blocks + release.held.blocks == 4  # positions, not pool blocks
    # A reset gives back the rest; the loss is in positions too.
    left = bench.core.executor.retained_blocks
    assert 0 < left < HELD and release.held.blocks > 0
    assert bench.core.executor.release_all() == left  # pool blocks
    (reset,) = bench.core.executor.take_releases()
    assert reset.reason.value == "reset" and reset.released.blocks == release.held.blocks
    assert reset.held.blocks == 0 and bench.core.executor.retained_blocks == 0


def test_a_hold_takes_the_furthest_hit_the_window_blocks_allow() -> None:
    """One sliding-window group's block of the last position gone from vLLM's cache
    (``evict_blocks``, vLLM's path after a failed KV load): a hit reaches 3 blocks, so
    the Pin holds 3 positions and the window of position 3 and says so (``clipped``,
    ``applied`` 3). Before, it held and applied all 4 positions, the 4th reaching no
    hit."""
    bench = _Bench(pin_budget_fraction=0.5)
    manager, adapter = bench.manager, bench.core.adapter
    (last,) = [adapter.lookup(k) for k in bench.core.index.session_prefix("s", 4)[3:]]
    window_group = adapter.hit_groups[2].group_id
    gone = adapter.side_block(last, window_group)
    manager.block_pool.evict_blocks({gone.block_id})
    bench.core.sync()
    outcome = bench.hint("kv.pin", {"target": {"session_id": "s"}, "ttl_s": 600})
    assert outcome.status.value == "clipped" and outcome.applied.blocks == 3
    assert "resident for 3 of 4 target blocks" in outcome.reason
    bench.traffic()
    assert bench.core.executor.pinned_blocks == 3 + 5 * 2  # positions 2 and 3's windows
    assert bench.next_turn_hit() == 3 * BLOCK


def test_a_held_window_block_vllm_drops_from_its_cache_is_given_back() -> None:
    """``evict_blocks`` (vLLM's path after a failed KV load) on a held sliding-window
    block of the last position: its hold protects nothing any more, so it is given back
    and counted (``held_blocks_gone``). No hit reaches the last position without it, so
    the Pin lets go of that position too, with its other windows' blocks, and the router
    hears it lost (``gone``) in positions. Before, the position stayed held and nothing
    was reported: the router counted 4 protected positions whose hit reached none."""
    bench = _Bench(pin_budget_fraction=0.5)
    adapter, executor = bench.core.adapter, bench.core.executor
    bench.hint("kv.pin", {"target": {"session_id": "s"}, "ttl_s": 600})
    last = bench.positions()[3]
    held = adapter.side_block(last, adapter.hit_groups[0].group_id)
    assert executor.holds.is_pinned(held.block_id)
    bench.manager.block_pool.evict_blocks({held.block_id})
    bench.core.sync()
    assert not executor.holds.is_held(held.block_id)
    assert not executor.holds.is_held(last.block_id)
    assert not any(executor.holds.is_held(adapter.side_block(last, n.group_id).block_id)
                   for n in adapter.hit_groups[1:])
    assert executor.pinned_blocks == HELD - 6  # the window block, the position, 4 windows
    assert executor.holds.counters.released_gone == 6
    (loss,) = executor.take_releases()
    assert (loss.action_id, loss.reason.value) == ("a1", "gone")
    assert (loss.released.blocks, loss.held.blocks) == (1, 3)  # positions
