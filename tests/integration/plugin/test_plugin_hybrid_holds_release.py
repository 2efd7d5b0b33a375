"""What a hybrid model's holds let go of, against vLLM's real KVCacheManager: a Demote
naming blocks (``HoldLedger.unretain``) and a block-hash release give back the claim's
other groups' blocks its cut positions needed, the ``displaced`` counter counts what the
releases report as displaced, a block vLLM drops from any other group's cache (another
full-attention group's too) is given back, and losing another group's block cuts the
claim's positions whose hit needed it (``engine_plugin/hold_cuts.py``).

The host tier is the simulator's (``router.sim.host_tier``: vLLM's CPUOffloadingManager
bookkeeping, copies modelled): vLLM's offloading worker needs CUDA.
"""

from __future__ import annotations

from hybrid_fixtures import BLOCK, GEMMA, GEMMA_FULL_FIRST, TWO_FULL, Bench

from kvhint.router.sim.host_tier import SimHostTier

# The Gemma layout's hold of the 4-block prefix: 4 positions, and each of the 5
# sliding-window groups' blocks of the last 2 positions (cdiv(32 - 1, 16)).
HELD = 4 + 5 * 2


def test_a_block_hash_demote_lets_go_of_the_window_blocks_of_the_positions_it_cuts() -> None:
    """Before, the Demote dropped the retains on positions 3 and 4 only: the claim kept
    the 10 window blocks of those positions (no position it still held needed them), out
    of the free queue and against the retain budget until the claim ended, and
    ``retained_displaced`` counted none of the 12 pool blocks the releases reported."""
    bench = Bench(GEMMA, host_tier=SimHostTier(40), retain_budget_fraction=0.5)
    executor = bench.core.executor
    keys = bench.core.index.session_prefix("s", 4)
    outcome = bench.hint("kv.retain", {"target": {"session_id": "s"}, "priority": 50,
                                       "ttl_s": 600})
    assert outcome.applied.blocks == 4 and executor.retained_blocks == HELD
    demote = bench.hint("kv.demote", {"target": {"block_hashes": keys[2:]}}, "d1")
    assert demote.status.value == "accepted" and demote.applied.blocks == 2
    assert executor.retained_blocks == 2  # positions 1 and 2; their windows were never held
    held = {h.block_id for h in executor.holds.handles()}
    assert held == {h.block_id for h in bench.positions()[:2]}
    assert executor.holds.counters.displaced == HELD - 2  # pool blocks, as relief counts
    (release,) = executor.take_releases()
    assert (release.action_id, release.reason.value) == ("a1", "displaced")
    assert (release.released.blocks, release.held.blocks) == (2, 2)  # positions


def test_a_block_hash_release_counts_what_it_reports_displaced() -> None:
    """A ``Retain{priority: 0}`` by block hashes cuts the Prefetch's claim on them and
    reports it as ``displaced``; the counter counts those blocks too (before: none)."""
    bench = Bench(GEMMA, retain_budget_fraction=0.5)
    executor = bench.core.executor
    keys = bench.core.index.session_prefix("s", 4)
    prefetch = bench.hint("kv.prefetch", {"target": {"block_hashes": keys},
                                          "deadline_s": 600})
    assert prefetch.applied.blocks == 4 and executor.retained_blocks == HELD
    release = bench.hint("kv.retain", {"target": {"block_hashes": keys[2:]},
                                       "priority": 0, "ttl_s": 600}, "r0")
    assert release.status.value == "accepted"
    assert executor.retained_blocks == 2
    assert executor.holds.counters.displaced == HELD - 2
    (loss,) = executor.take_releases()
    assert (loss.action_id, loss.reason.value, loss.released.blocks) == ("a1", "displaced", 2)


def test_a_block_of_another_full_attention_group_vllm_drops_is_given_back() -> None:
    """Two full-attention groups (and a window one): vLLM's BlockRemoved for the second
    full-attention group's held block (``evict_blocks``) gives its hold back, as the
    followed group's and a window group's are (``side_removed``)."""
    bench = Bench(TWO_FULL, pin_budget_fraction=0.5)
    executor, adapter = bench.core.executor, bench.core.adapter
    (other_full,) = [n.group_id for n in adapter.hit_groups if n.tail is None]
    bench.hint("kv.pin", {"target": {"session_id": "s"}, "ttl_s": 600})
    assert executor.pinned_blocks == 4 + 4 + 2  # both full groups' positions, one window
    held = adapter.side_block(bench.positions()[1], other_full)
    assert executor.holds.is_pinned(held.block_id)
    bench.manager.block_pool.evict_blocks({held.block_id})
    bench.core.sync()
    assert not executor.holds.is_held(held.block_id)
    # No hit reaches past position 2 now: positions 2-4 go with their other groups'
    # blocks (positions 3 and 4's, and the window's), reported lost in positions.
    assert executor.pinned_blocks == 2  # position 1 in both full-attention groups
    assert executor.holds.counters.released_gone == 1 + 3 + 2 + 2
    (loss,) = executor.take_releases()
    assert (loss.reason.value, loss.released.blocks, loss.held.blocks) == ("gone", 3, 1)


def test_relief_of_a_window_block_lets_go_of_the_positions_it_served() -> None:
    """Relief takes a retained window block of the last position (the allocating
    request's own hits kept: here the position's block): no hit reaches that position
    without it, so the Retain lets it go too, with its other windows' blocks, all freed
    under pressure, and reports the position lost. Before, relief freed the one block,
    the position stayed retained and nothing was reported."""
    bench = Bench(GEMMA, retain_budget_fraction=0.5)
    executor = bench.core.executor
    bench.hint("kv.retain", {"target": {"session_id": "s"}, "priority": 50, "ttl_s": 600})
    last = bench.positions()[3]
    assert executor.holds.relieve(1, keep=frozenset({last.block_id})) == 6
    assert executor.retained_blocks == HELD - 6
    assert not executor.holds.is_held(last.block_id)
    assert executor.holds.counters.released_under_pressure == 6
    (loss,) = executor.take_releases()
    assert (loss.reason.value, loss.released.blocks, loss.held.blocks) == ("pressure", 1, 3)


def test_relief_of_a_position_lets_go_of_its_window_blocks() -> None:
    """Relief takes the last position's own block (the full-attention group first, so
    its block ids come first in pressure order): the window blocks held at that position
    served only hits through it, so they go with it, freed under pressure. Before, the
    claim kept them (5 pool blocks against the retain budget, off the free queue) until
    it ended, while reporting 3 positions held."""
    bench = Bench(GEMMA_FULL_FIRST, retain_budget_fraction=0.5)
    executor = bench.core.executor
    bench.hint("kv.retain", {"target": {"session_id": "s"}, "priority": 50, "ttl_s": 600})
    last = bench.positions()[3]
    assert executor.retained_blocks == HELD
    assert executor.holds.relieve(1) == 6
    assert not executor.holds.is_held(last.block_id)
    assert executor.retained_blocks == HELD - 6
    assert not any(h.handle.depth == 3 for h in executor.holds._holds.values())
    assert executor.holds.counters.released_under_pressure == 6
    (loss,) = executor.take_releases()
    assert (loss.reason.value, loss.released.blocks, loss.held.blocks) == ("pressure", 1, 3)


def test_a_pinned_position_vllm_drops_takes_its_window_blocks_with_it() -> None:
    """vLLM drops the last position's held block from its cache (``evict_blocks``): the
    Pin's window blocks at that position go back too (before, they stayed pinned)."""
    bench = Bench(GEMMA_FULL_FIRST, pin_budget_fraction=0.5)
    executor = bench.core.executor
    bench.hint("kv.pin", {"target": {"session_id": "s"}, "ttl_s": 600})
    last = bench.positions()[3]
    assert executor.pinned_blocks == HELD
    bench.manager.block_pool.evict_blocks({last.block_id})
    bench.core.sync()
    assert executor.pinned_blocks == HELD - 6
    assert executor.holds.counters.released_gone == 6
    (loss,) = executor.take_releases()
    assert (loss.reason.value, loss.released.blocks, loss.held.blocks) == ("gone", 1, 3)


def test_a_cut_that_releases_the_displacing_retains_own_positions_displaces_on() -> None:
    """A block-hash Retain at priority 10 holds positions 1-2 and the window blocks of
    their hit (depths 0-1); the session's Retain at priority 90 wants positions 1-4 and
    the windows of depths 2-3: 12 new blocks, 6 of room. Displacing the low claim's depth-1
    window block cuts that claim from depth 1 (:mod:`.hold_cuts`), releasing position 2
    too, one of the displacing Retain's own targets: released, but it makes no room (the
    Retain takes it back). Before, it counted as room made: displacement stopped after
    6 releases with 5 of room made, and the Retain was clipped to 3 positions (its reason
    blaming priorities of 90 or more, while priority 10 still held 6 blocks), its next
    turn hitting 3 blocks, not 4."""
    bench = Bench(GEMMA, retain_budget_fraction=0.31)
    executor = bench.core.executor
    assert executor.holds.max_retained == 18
    keys = bench.core.index.session_prefix("s", 4)
    low = bench.hint("kv.retain", {"target": {"block_hashes": keys[:2]}, "priority": 10,
                                   "ttl_s": 600}, "low")
    assert low.applied.blocks == 2 and executor.retained_blocks == 2 + 5 * 2
    high = bench.hint("kv.retain", {"target": {"session_id": "s"}, "priority": 90,
                                    "ttl_s": 600}, "high")
    assert (high.status.value, high.applied.blocks) == ("accepted", 4), high.reason
    assert executor.retained_blocks == HELD  # the low claim is all gone
    (loss,) = executor.take_releases()
    assert (loss.action_id, loss.reason.value, loss.released.blocks, loss.held.blocks) == (
        "low", "displaced", 2, 0)
    bench.traffic()
    assert bench.next_turn_hit() == 4 * BLOCK


def test_relief_counts_only_blocks_that_make_room() -> None:
    """Relief for 6 blocks, the allocating request's hit being the last position: the
    first window block relieved cuts the Retain from depth 3, releasing that position
    too, which the request reads back (vLLM counts a free hit block as one to allocate).
    Before, relief stopped there: 6 released, 5 of them room."""
    bench = Bench(GEMMA, retain_budget_fraction=0.5)
    executor, pool = bench.core.executor, bench.manager.block_pool
    bench.hint("kv.retain", {"target": {"session_id": "s"}, "priority": 50, "ttl_s": 600})
    last = bench.positions()[3]
    free = pool.get_num_free_blocks()
    assert executor.holds.relieve(6, keep=frozenset({last.block_id})) == 12  # depths 2-3
    assert pool.get_num_free_blocks() - free - 1 >= 6  # less the request's own hit
