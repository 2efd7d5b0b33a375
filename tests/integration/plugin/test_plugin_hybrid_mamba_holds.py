"""Holds on a hybrid model with a Mamba layer beside full attention (Jamba's, Granite 4's
kind), on vLLM's real Scheduler in its "align" Mamba cache mode (what vLLM sets for a
Mamba model when prefix caching is on: the state cached at block boundaries, the state's
block size attention's; ``HeadlessSchedulerSpec.mamba``).

vLLM's ``MambaManager.find_longest_cache_hit`` accepts a hit of N blocks only with the
Mamba state block at position N cached (its search runs right to left, one block), so a
Pin or Retain holds, beside the full-attention blocks at positions 1..N, the Mamba state
block at N (``GroupNeed(tail=1)``, ``vllm_adapter/hit_groups.py``) and no other Mamba
block. Checked here: what is held (ref counts), the next turn's real hit after traffic
that evicts everything else, vLLM's default retention (0) where the state is cached at
the prompt's end only, and that an expiry and a block-hash release give the state back.
"""

from __future__ import annotations

import json
import random

import pytest

from kvhint.engine_plugin.block_cache import GroupNeed
from kvhint.engine_plugin.headless import HeadlessSchedulerSpec, build_scheduler

BS = 32
PROMPT = 4 * BS + 3  # 4 full blocks, the 5th partial
OUTPUT = 2 * BS  # the chain: 6 full blocks
CHAIN = 6


class _Turn:
    """One session turn on a Scheduler over a Mamba layer and a full-attention one."""

    def __init__(self, retention: int | None) -> None:
        self.h = build_scheduler(HeadlessSchedulerSpec(
            block_size=BS, num_blocks=40, max_model_len=16 * BS, max_num_batched_tokens=256,
            connector_module="kvhint.engine_plugin.connector",
            connector_extra_config={"worker_id": "w0", "pin_budget_fraction": 0.5,
                                    "retain_budget_fraction": 0.5},
            mamba=True, prefix_cache_retention_interval=retention))
        self.core = self.h.connector.core
        self.now = 1000.0
        self.core.use_clock(lambda: self.now)
        adapter = self.core.adapter
        assert adapter.hit_groups == (GroupNeed(0, 1),) and adapter.unheld_groups == ()
        self.rng = random.Random(3)
        turn = self.h.run(self.h.make_request(
            [self.rng.randrange(1, 500) for _ in range(PROMPT)], session_id="s",
            max_tokens=OUTPUT))
        self.chain = list(turn.prompt_token_ids) + list(turn.output_token_ids)
        self.keys = self.core.index.session_blocks("s")
        assert len(self.keys) == CHAIN
        self.positions = [adapter.lookup(k) for k in self.keys]

    def hint(self, action_type: str, payload: dict, action_id: str = "a1",
             target: dict | None = None):
        (outcome,) = self.core.apply_hints(json.dumps({
            "protocol_version": "1", "message_id": f"m-{action_id}", "actions": [{
                "action_id": action_id, "action_type": action_type, "action_version": "1.0",
                "payload": {"target": target or {"session_id": "s"}, **payload}}]}
        ).encode())
        return outcome

    def ref_counts(self) -> tuple[list[int], list[int | None]]:
        """The full-attention blocks' ref counts at the chain's positions, and the Mamba
        state blocks' (None: no state cached at that position)."""
        sides = [self.core.adapter.side_block(p, 0) for p in self.positions]
        return ([p.blocks[0].ref_cnt for p in self.positions],
                [None if s is None else s.blocks[0].ref_cnt for s in sides])

    def traffic(self) -> None:
        h = self.h
        for _ in range(20):  # unrelated traffic: evicts every block nothing holds
            h.run(h.make_request([self.rng.randrange(1, 500) for _ in range(3 * BS + 2)]))

    def next_turn_hit(self) -> int:
        h = self.h
        request = h.add(h.make_request(self.chain + [5, 5, 5], session_id="s"))
        hits: list[int] = []
        h.step(lambda _: hits.append(request.prefill_stats.num_local_cached_tokens))
        return hits[0]


@pytest.mark.parametrize("kind", ["pin", "retain"])
def test_a_claim_holds_the_mamba_state_at_the_hit_point_and_keeps_the_hit(kind: str) -> None:
    """Dense retention: vLLM cached the state at positions 4, 5 and 6 (every block the
    scheduler's aligned chunks ended on). The claim holds the 6 full-attention blocks and
    the state at 6 only: one state is all a hit of 6 reads."""
    turn = _Turn(retention=None)
    assert turn.ref_counts() == ([0] * CHAIN, [None, None, None, 0, 0, 0])
    outcome = turn.hint(f"kv.{kind}", {"ttl_s": 600, **({} if kind == "pin" else {"priority": 50})})
    assert outcome.status.value == "accepted", outcome
    assert outcome.applied.blocks == CHAIN
    assert turn.ref_counts() == ([1] * CHAIN, [None, None, None, 0, 0, 1])
    executor = turn.core.executor
    assert (executor.pinned_blocks if kind == "pin" else executor.retained_blocks) == CHAIN + 1
    turn.traffic()
    assert turn.ref_counts() == ([1] * CHAIN, [None, None, None, None, None, 1])
    assert turn.next_turn_hit() == CHAIN * BS


def test_without_a_hold_traffic_leaves_no_hit() -> None:
    """The bench's traffic does evict the chain: what the claims above keep is theirs."""
    turn = _Turn(retention=None)
    turn.traffic()
    assert turn.next_turn_hit() == 0


def test_at_vllms_default_retention_the_hit_point_is_the_prompts_state() -> None:
    """Retention 0 (vLLM's default): the state is cached at the prompt's replay boundary
    only ((PROMPT - 1) // BS = 4), never in the response: a hit reaches 4 blocks, the
    claim is clipped there and holds the state at 4."""
    turn = _Turn(retention=0)
    assert turn.ref_counts() == ([0] * CHAIN, [None, None, None, 0, None, None])
    outcome = turn.hint("kv.pin", {"ttl_s": 600})
    assert outcome.status.value == "clipped", outcome
    assert outcome.applied.blocks == 4 and "resident for 4 of 6" in outcome.reason
    assert turn.ref_counts() == ([1, 1, 1, 1, 0, 0], [None, None, None, 1, None, None])
    assert turn.core.executor.pinned_blocks == 5
    turn.traffic()
    assert turn.next_turn_hit() == 4 * BS


def test_an_expired_pin_and_a_block_hash_release_give_the_state_back() -> None:
    turn = _Turn(retention=None)
    executor = turn.core.executor
    turn.hint("kv.pin", {"ttl_s": 60})
    assert turn.ref_counts()[1][-1] == 1
    turn.now += 61
    executor.advance()
    assert executor.pinned_blocks == 0
    assert turn.ref_counts() == ([0] * CHAIN, [None, None, None, 0, 0, 0])
    # A session-less Retain on the chain; releasing its last two positions by block
    # hashes (``Retain{priority: 0}``) takes the state at 6 with them. The claim keeps
    # positions 1..4 without the state at 4 (resident, not held: a cut adds no block).
    retain = turn.hint("kv.retain", {"priority": 50, "ttl_s": 600}, "r1",
                       {"block_hashes": turn.keys})
    assert retain.applied.blocks == CHAIN and executor.retained_blocks == CHAIN + 1
    release = turn.hint("kv.retain", {"priority": 0, "ttl_s": 600}, "r0",
                        {"block_hashes": turn.keys[4:]})
    assert release.status.value == "accepted", release
    assert turn.ref_counts() == ([1, 1, 1, 1, 0, 0], [None, None, None, 0, 0, 0])
    assert executor.retained_blocks == 4
