"""Holds with EAGLE (or MTP) speculative decoding on, against vLLM's real KVCacheManager
built with ``use_eagle=True`` (what the Scheduler passes for an EAGLE speculative config:
a CPU headless Scheduler cannot load a draft model).

With EAGLE vLLM's prefix hit drops the last matched block (the full-attention finder's
``drop_eagle_block``; a sliding window needs one more contiguous block for it): a cached
chain of N blocks gives a hit of N - 1, in plain vLLM too. A hold of the N positions keeps
that hit (block N is what the N - 1 hit matches before dropping it), so the Pin's reach
with EAGLE is the N - 1 plain vLLM gives, not one short of it; no hold of the target can
give N (block N + 1 is never cached). A Mamba group's state is looked up at the shorter
length, N - 1, which is where vLLM caches it with EAGLE (``GroupNeed.lag``); before, the
hold took the state at N (none: the claim was clipped to N - 1 positions, the state at
N - 1) and after other traffic the hit, needing block N to drop, was 0.

The Mamba layout's prefills stop where vLLM's Scheduler would stop them (the Bench's
``admit``).
"""

from __future__ import annotations

import pytest
from hybrid_fixtures import BLOCK, GEMMA, MAMBA, Bench

from kvhint.engine_plugin.block_cache import GroupNeed

N = 4  # the session's cached chain: its prompt's 4 full blocks


def _pin(bench: Bench):
    return bench.hint("kv.pin", {"target": {"session_id": "s"}, "ttl_s": 600})


def _ref_counts(bench: Bench, group_id: int) -> list[int | None]:
    adapter = bench.core.adapter
    return [None if (b := adapter.side_block(p, group_id)) is None else b.blocks[0].ref_cnt
            for p in bench.positions()]


@pytest.mark.parametrize("layout", ["FF", GEMMA])
def test_a_pin_keeps_the_hit_vllm_gives_with_eagle(layout: str) -> None:
    """One group (two full-attention layers) and Gemma's windows: the Pin holds the N
    positions (with EAGLE's window one block longer: cdiv(32 - 1, 16) + 1), and after
    traffic the next turn hits N - 1 blocks, what it hits with nothing evicted."""
    bench = Bench(layout, use_eagle=True, pin_budget_fraction=0.5)
    assert bench.next_turn_hit() == (N - 1) * BLOCK  # plain vLLM, nothing evicted
    outcome = _pin(bench)
    assert outcome.status.value == "accepted" and outcome.applied.blocks == N
    tails = [n.tail for n in bench.core.adapter.hit_groups]
    assert tails == ([] if layout == "FF" else [3] * 5)
    assert bench.core.executor.pinned_blocks == N + sum(tails)
    bench.traffic()
    assert bench.next_turn_hit() == (N - 1) * BLOCK


def test_without_eagle_the_same_pin_keeps_all_n() -> None:
    bench = Bench("FF", pin_budget_fraction=0.5)
    assert _pin(bench).applied.blocks == N
    bench.traffic()
    assert bench.next_turn_hit() == N * BLOCK


def test_a_mamba_pin_with_eagle_holds_the_state_where_the_hit_reads_it() -> None:
    """vLLM cached the Mamba states at N - 1 only (its EAGLE checkpoint). The Pin holds
    the N full-attention blocks and each Mamba group's state at N - 1, and the next turn
    after traffic hits N - 1 (before: clipped to N - 1 positions holding the state there,
    block N left to eviction, and a hit of 0)."""
    bench = Bench(MAMBA, use_eagle=True, pin_budget_fraction=0.5)
    mamba = [n for n in bench.core.adapter.hit_groups if n.tail is not None]
    assert _ref_counts(bench, 0) == [None, None, 0, None]
    outcome = _pin(bench)
    bench.traffic()
    assert bench.next_turn_hit() == (N - 1) * BLOCK  # before: 0
    assert outcome.status.value == "accepted", outcome
    assert outcome.applied.blocks == N
    for need in mamba:
        assert _ref_counts(bench, need.group_id) == [None, None, 1, None]
    assert bench.core.executor.pinned_blocks == N + len(mamba)
    assert mamba == [GroupNeed(g, 1, 1) for g in (0, 1, 2)]


def test_a_mamba_pin_without_eagle_holds_the_state_at_the_hit_point() -> None:
    bench = Bench(MAMBA, pin_budget_fraction=0.5)
    assert bench.core.adapter.hit_groups[0] == GroupNeed(0, 1, 0)
    assert _ref_counts(bench, 0) == [None, None, None, 0]
    assert _pin(bench).applied.blocks == N
    assert _ref_counts(bench, 0) == [None, None, None, 1]
    bench.traffic()
    assert bench.next_turn_hit() == N * BLOCK


def test_a_short_budget_keeps_the_mamba_state_a_shorter_hit_reads() -> None:
    """The budget clip (``_Shape.clip``) with EAGLE's lag: with room for 7 pool blocks,
    the N positions and the 3 states at N - 1; with 5, the only shorter hit point is
    position 1 (a hit of 0 with EAGLE, needing no state: no state is held), not N - 1
    positions with their states (the states at N - 2, which that hit would read, are not
    cached)."""
    bench = Bench(MAMBA, use_eagle=True, pin_budget_fraction=7 / 59)
    assert bench.core.executor.max_pinned_blocks == 7
    outcome = _pin(bench)
    assert outcome.applied.blocks == N and bench.core.executor.pinned_blocks == 7
    short = Bench(MAMBA, use_eagle=True, pin_budget_fraction=5 / 59)
    assert short.core.executor.max_pinned_blocks == 5
    outcome = _pin(short)
    assert outcome.status.value == "clipped" and outcome.applied.blocks == 1
    assert short.core.executor.pinned_blocks == 1


def test_a_hybrid_clip_with_eagle_reports_the_positions_held_and_the_router_reads_so(
        ) -> None:
    """A window block of the last position gone (``evict_blocks``): the Pin's hit point is
    3 positions, and with EAGLE vLLM's hit at that point is 2 blocks. The clip says "a
    prefix hit reaches 3" (``schemas.outcomes.CLIPPED_HIT_REACH``): positions held, as
    ``applied`` counts them, not the hit; the router's pin feedback divides ``applied`` by
    it (a clip for residency alone leaves ``pin_ask_scale`` as it is) and reads it as no
    hit length."""
    from kvhint.router.policy.feedback import FeedbackConfig, WorkerFeedback, apply_outcome
    from kvhint.schemas.outcomes import clipped_hit_reach

    bench = Bench(GEMMA, use_eagle=True, pin_budget_fraction=0.5)
    adapter = bench.core.adapter
    last = bench.positions()[3]
    group = adapter.hit_groups[0].group_id
    # Every cached copy (with EAGLE the Bench's second turn recomputed block N anew).
    while (gone := adapter.side_block(last, group)) is not None:
        bench.manager.block_pool.evict_blocks({gone.block_id})
        bench.core.sync()
    outcome = _pin(bench)
    assert outcome.status.value == "clipped", outcome
    assert clipped_hit_reach(outcome.reason) == outcome.applied.blocks == N - 1
    bench.traffic()
    assert bench.next_turn_hit() == (N - 2) * BLOCK  # EAGLE: the hit is X - 1
    feedback = apply_outcome(WorkerFeedback("w0"), outcome, FeedbackConfig())
    assert feedback.pin_ask_scale == 1.0
