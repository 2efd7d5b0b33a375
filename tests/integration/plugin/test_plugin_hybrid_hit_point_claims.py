"""A hybrid model's claim holds no position past its hit point, on vLLM's real Scheduler
at vLLM's default ``--prefix-cache-retention-interval`` (0).

At 0 a sliding-window group never caches a response's window blocks, so a Pin or Retain
over a session's whole chain (prompt and response: what the router sends) keeps a hit of
the previous prompt's full blocks only (X = 4 of N = 6 here;
``test_plugin_hybrid_response_window.py``). Before, the claim still held the
full-attention group's blocks at positions X..N, which no hit can use, reported all N in
``applied`` and counted them in the pin/retain budgets and gauges; the router counted N
protected. Now it holds positions 1..X with the window blocks of X, is ``clipped`` and
says how far a hit reaches, and ``applied`` is X: the router's ledger counts X, and its
pin feedback reads the clip as residency, not as a pin budget too small.
"""

from __future__ import annotations

import json
import random

import pytest

from kvhint.engine_plugin.headless import HeadlessSchedulerSpec, build_scheduler
from kvhint.router.policy import HoldingsLedger
from kvhint.router.policy.feedback import WorkerFeedback, apply_outcome
from kvhint.schemas import Amount, HintOutcome, OutcomeStatus
from kvhint.schemas.outcomes import clipped_hit_reach

BS = 32
PROMPT = 4 * BS + 3  # 4 full blocks, the 5th partial
OUTPUT = 2 * BS  # the chain: 6 full blocks; a next turn hits the prompt's 4 at retention 0
REACH, CHAIN = 4, 6


class _Turn:
    """One session turn on a hybrid Scheduler (a 64-token sliding-window layer beside a
    full-attention one) at retention 0, and the plugin's view of its chain."""

    def __init__(self, pin_budget_fraction: float = 0.5) -> None:
        self.h = build_scheduler(HeadlessSchedulerSpec(
            block_size=BS, num_blocks=40, max_model_len=16 * BS, max_num_batched_tokens=256,
            connector_module="kvhint.engine_plugin.connector",
            connector_extra_config={"worker_id": "w0",
                                    "pin_budget_fraction": pin_budget_fraction,
                                    "retain_budget_fraction": 0.5},
            sliding_window=2 * BS, prefix_cache_retention_interval=0))
        self.core = self.h.connector.core
        self.rng = random.Random(3)
        turn = self.h.run(self.h.make_request(
            [self.rng.randrange(1, 500) for _ in range(PROMPT)], session_id="s",
            max_tokens=OUTPUT))
        self.chain = list(turn.prompt_token_ids) + list(turn.output_token_ids)
        self.keys = self.core.index.session_blocks("s")
        assert len(self.keys) == CHAIN
        adapter = self.core.adapter
        self.positions = [adapter.lookup(k) for k in self.keys]
        (self.window,) = [n for n in adapter.hit_groups if n.tail is not None]
        assert self.window.tail == 2  # cdiv(64 - 1, 32)

    def hint(self, action_type: str, payload: dict, action_id: str = "a1"):
        (outcome,) = self.core.apply_hints(json.dumps({
            "protocol_version": "1", "message_id": f"m-{action_id}", "actions": [{
                "action_id": action_id, "action_type": action_type, "action_version": "1.0",
                "payload": {"target": {"session_id": "s"}, **payload}}]}
        ).encode())
        return outcome

    def ref_counts(self) -> tuple[list[int], list[int | None]]:
        """The full-attention group's block ref counts at the chain's positions, and the
        sliding-window group's (None: not cached)."""
        adapter = self.core.adapter
        sides = [adapter.side_block(p, self.window.group_id) for p in self.positions]
        return ([p.blocks[0].ref_cnt for p in self.positions],
                [None if s is None else s.blocks[0].ref_cnt for s in sides])

    def next_turn_hit_after_traffic(self) -> int:
        h = self.h
        for _ in range(20):  # unrelated traffic: evicts every block nothing holds
            h.run(h.make_request([self.rng.randrange(1, 500) for _ in range(3 * BS + 2)]))
        request = h.add(h.make_request(self.chain + [5, 5, 5], session_id="s"))
        hits: list[int] = []
        h.step(lambda _: hits.append(request.prefill_stats.num_local_cached_tokens))
        return hits[0]


@pytest.mark.parametrize("kind", ["pin", "retain"])
def test_a_claim_over_the_whole_chain_holds_only_what_keeps_the_hit(kind: str) -> None:
    turn = _Turn()
    full, window = turn.ref_counts()
    assert full == [0] * CHAIN  # cached, free: nothing running holds them
    # vLLM cached the window before the prompt's end only (positions 3 and 4).
    assert window == [None, None, 0, 0, None, None]
    outcome = turn.hint(f"kv.{kind}", {"ttl_s": 600, **({} if kind == "pin" else {"priority": 50})})
    assert outcome.status.value == "clipped", outcome
    assert (outcome.requested.blocks, outcome.applied.blocks) == (CHAIN, REACH)
    assert outcome.applied.tokens == REACH * BS
    assert "resident for 4 of 6" in outcome.reason
    assert clipped_hit_reach(outcome.reason) == REACH
    # Held: the full-attention blocks of positions 1..4 and the window of position 4;
    # positions 5 and 6 stay free (before: held, ref count 1, and applied 6).
    full, window = turn.ref_counts()
    assert full == [1, 1, 1, 1, 0, 0]
    assert window == [None, None, 1, 1, None, None]
    executor = turn.core.executor
    gauge = executor.pinned_blocks if kind == "pin" else executor.retained_blocks
    assert gauge == REACH + 2  # the budget counts pool blocks held: before, 6 + 2
    assert turn.next_turn_hit_after_traffic() == REACH * BS


def test_a_prefetch_of_the_chain_retains_the_hit_point_and_says_why() -> None:
    """A Prefetch whose chain is in G1 retains it until its deadline: to the hit point,
    and its reason says no hit reaches further, not that the retain budget had no room
    (before: accepted, all 6 retained and applied)."""
    turn = _Turn()
    outcome = turn.hint("kv.prefetch", {"deadline_s": 600})
    assert outcome.status.value == "clipped", outcome
    assert (outcome.requested.blocks, outcome.applied.blocks) == (CHAIN, REACH)
    assert "no prefix hit reaches further" in outcome.reason
    assert "retain budget" not in outcome.reason
    assert turn.core.executor.retained_blocks == REACH + 2
    assert turn.next_turn_hit_after_traffic() == REACH * BS


def test_the_router_counts_the_hit_point_and_learns_no_pin_budget_from_it() -> None:
    turn = _Turn()
    ledger = HoldingsLedger()
    ledger.record(action_id="a1", worker_id="w0", tenant="t", scope="s",
                  action_type="kv.pin", blocks=CHAIN, expires_at=1e12, keys=turn.keys)
    assert ledger.worker("w0").pinned_blocks == CHAIN
    outcome = turn.hint("kv.pin", {"ttl_s": 600})
    assert outcome.status.value == "clipped"
    ledger.settle(outcome)
    assert ledger.worker("w0").pinned_blocks == REACH  # before: 6, two no hit used
    assert ledger.tenant("t").pinned_blocks == REACH
    # A clip for residency alone says nothing of the worker's pin room.
    assert apply_outcome(WorkerFeedback("w0"), outcome).pin_ask_scale == 1.0


def test_a_pin_budget_short_of_the_hit_point_still_lowers_the_ask_scale() -> None:
    """3 pool blocks of pin budget: the hit point's 6 do not fit, and no shorter prefix
    has its window cached at retention 0, so the Pin holds nothing (before, it held the
    first 3 positions, which keep no hit, and applied 3); that is the budget's clip,
    learnt as before (a fraction of the hit point)."""
    turn = _Turn(pin_budget_fraction=0.08)
    executor = turn.core.executor
    assert executor.max_pinned_blocks == 3
    outcome = turn.hint("kv.pin", {"ttl_s": 600})
    assert outcome.status.value == "clipped" and outcome.applied.blocks == 0
    assert "pin budget" in outcome.reason and clipped_hit_reach(outcome.reason) == REACH
    assert executor.pinned_blocks == 0 and turn.ref_counts()[0] == [0] * CHAIN
    assert apply_outcome(WorkerFeedback("w0"), outcome).pin_ask_scale == 0.125


def test_a_clip_that_names_no_hit_point_is_learnt_as_before() -> None:
    """A one-group model's clipped Pin (no hit-point phrase): the applied fraction of
    what it asked for, unchanged."""
    outcome = HintOutcome(message_id="m", action_id="a", action_type="kv.pin",
                          worker_id="w0", status=OutcomeStatus.CLIPPED,
                          reason="3 of 6 target blocks resident", requested=Amount(blocks=6),
                          applied=Amount(blocks=3), at=0.0)
    assert clipped_hit_reach(outcome.reason) is None
    assert apply_outcome(WorkerFeedback("w0"), outcome).pin_ask_scale == 0.5
