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

import json
import random

import pytest

from kvhint.engine_plugin.config import PluginConfig
from kvhint.engine_plugin.core import PluginCore
from kvhint.engine_plugin.headless import _block_hasher, _request_factory

BLOCK = 16


def _hybrid_manager(full_first: bool, num_blocks: int = 60):
    """vLLM's KVCacheManager over the groups vLLM forms for 12 layers, every sixth full
    attention and the rest a 32-token sliding window (Gemma 3's 5:1 pattern; or with
    layer 0 full, its group first)."""
    import torch
    from vllm.v1.core import kv_cache_utils as kcu
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, SlidingWindowSpec

    full = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=8,
                             dtype=torch.float32)
    window = SlidingWindowSpec(block_size=BLOCK, num_kv_heads=2, head_size=8,
                               dtype=torch.float32, sliding_window=2 * BLOCK)
    first_full = 0 if full_first else 5
    layers = {f"model.layers.{i}.self_attn.attn": full if i % 6 == first_full else window
              for i in range(12)}
    groups = kcu._get_kv_cache_groups_uniform_page_size(layers)
    config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)
    config.hash_block_size = BLOCK
    return KVCacheManager(kv_cache_config=config, max_model_len=num_blocks * BLOCK,
                          scheduler_block_size=BLOCK, hash_block_size=BLOCK,
                          enable_caching=True, log_stats=False, enable_kv_cache_events=True)


class _Bench:
    """A hybrid manager with the plugin attached, session ``s`` cached (4 blocks of
    prompt, its 5th partial), and unrelated traffic to evict what is not held."""

    def __init__(self, full_first: bool = False, num_blocks: int = 60, **config) -> None:
        self.manager = _hybrid_manager(full_first, num_blocks)
        self.core = PluginCore.attach(self.manager, PluginConfig(worker_id="w0", **config))
        self.make_request = _request_factory(_block_hasher(BLOCK))
        self.rng = random.Random(1)
        self.prefix = [self.rng.randrange(1, 500) for _ in range(4 * BLOCK)]
        self.admit(self.prefix + [1, 2, 3], "s")
        assert self.admit(self.prefix + [9, 9, 9]) == 4 * BLOCK  # hybrid caching works

    def admit(self, prompt: list[int], session: str | None = None) -> int:
        manager = self.manager
        request = self.make_request(prompt, session_id=session)
        blocks, hit, _ = manager.get_computed_blocks(request)
        assert manager.allocate_slots(request, request.num_tokens - hit,
                                      num_new_computed_tokens=hit,
                                      new_computed_blocks=blocks) is not None
        request.num_computed_tokens = request.num_tokens
        manager.free(request)
        self.core.sync()
        return hit

    def hint(self, action_type: str, payload: dict):
        (outcome,) = self.core.apply_hints(json.dumps({
            "protocol_version": "1", "message_id": "m1", "actions": [{
                "action_id": "a1", "action_type": action_type, "action_version": "1.0",
                "payload": payload}]}).encode())
        return outcome

    def traffic(self) -> None:
        for _ in range(30):  # enough to evict every unheld block
            self.admit([self.rng.randrange(1, 500) for _ in range(3 * BLOCK + 2)])

    def next_turn_hit(self) -> int:
        _, hit, _ = self.manager.get_computed_blocks(self.make_request(self.prefix + [5, 5]))
        return hit


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
    the Pin holds the window of position 3 and says so (``clipped``), its 4 positions
    still applied."""
    bench = _Bench(pin_budget_fraction=0.5)
    manager, adapter = bench.manager, bench.core.adapter
    (last,) = [adapter.lookup(k) for k in bench.core.index.session_prefix("s", 4)[3:]]
    window_group = adapter.hit_groups[2].group_id
    gone = adapter.side_block(last, window_group)
    manager.block_pool.evict_blocks({gone.block_id})
    bench.core.sync()
    outcome = bench.hint("kv.pin", {"target": {"session_id": "s"}, "ttl_s": 600})
    assert outcome.status.value == "clipped" and outcome.applied.blocks == 4
    assert "resident for 3 of 4 target blocks" in outcome.reason
    bench.traffic()
    assert bench.core.executor.pinned_blocks == 4 + 5 * 2  # positions 2 and 3's windows
    assert bench.next_turn_hit() == 3 * BLOCK


def test_a_held_window_block_vllm_drops_from_its_cache_is_given_back() -> None:
    """``evict_blocks`` (vLLM's path after a failed KV load) on a held sliding-window
    block: its hold protects nothing any more, so it is given back and counted
    (``held_blocks_gone``); the claim's positions stay held, so nothing is reported."""
    bench = _Bench(pin_budget_fraction=0.5)
    adapter = bench.core.adapter
    bench.hint("kv.pin", {"target": {"session_id": "s"}, "ttl_s": 600})
    (last,) = [adapter.lookup(k) for k in bench.core.index.session_prefix("s", 4)[3:]]
    held = adapter.side_block(last, adapter.hit_groups[0].group_id)
    assert bench.core.executor.holds.is_pinned(held.block_id)
    bench.manager.block_pool.evict_blocks({held.block_id})
    bench.core.sync()
    assert not bench.core.executor.holds.is_held(held.block_id)
    assert bench.core.executor.pinned_blocks == HELD - 1
    assert bench.core.executor.holds.counters.released_gone == 1
    assert bench.core.executor.take_releases() == []
