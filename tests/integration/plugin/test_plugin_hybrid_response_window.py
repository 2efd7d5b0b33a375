"""A Pin after a turn on a hybrid model, on vLLM's real Scheduler: what it holds is the hit
vLLM gives the session's next turn, at vLLM's default ``--prefix-cache-retention-interval``
(0) and with every block retained (None, or the block size).

At 0, vLLM's SlidingWindowManager caches only the window before each prompt's end (its
replay boundary, ``reachable_block_mask``), never a response's blocks: the next turn hits
at most the previous prompt's full blocks, in plain vLLM too. A Pin on the session's
whole chain (the response's blocks included, as the router sends it) is then answered
``clipped`` ("resident for 4 of 6", holding and applying those 4: found in the
simulator's hybrid run, where about half the Pins were, and checked there: each next
turn on the worker hit exactly the clip's hit point). This shows the clip is honest and the best a hold can do: the next
turn, after unrelated traffic, hits exactly that; and with every block retained the
same Pin is ``accepted`` and the next turn hits the whole chain.
"""

from __future__ import annotations

import json
import random

import pytest

from kvhint.engine_plugin.headless import HeadlessSchedulerSpec, build_scheduler

BS = 32
PROMPT = 4 * BS + 3  # 4 full blocks, the 5th partial
OUTPUT = 2 * BS  # computed: PROMPT + OUTPUT - 1 = 194 tokens, 6 full blocks


def _pin(core, action_id: str):
    (outcome,) = core.apply_hints(json.dumps({
        "protocol_version": "1", "message_id": f"m-{action_id}", "actions": [{
            "action_id": action_id, "action_type": "kv.pin", "action_version": "1.0",
            "payload": {"target": {"session_id": "s"}, "ttl_s": 600}}]}).encode())
    return outcome


@pytest.mark.parametrize("retention", [0, BS, None], ids=["vllm-default", "block", "dense"])
def test_a_pin_after_a_turn_holds_the_hit_vllm_gives_the_next_turn(retention) -> None:
    h = build_scheduler(HeadlessSchedulerSpec(
        block_size=BS, num_blocks=40, max_model_len=16 * BS, max_num_batched_tokens=256,
        connector_module="kvhint.engine_plugin.connector",
        connector_extra_config={"worker_id": "w0", "pin_budget_fraction": 0.5},
        sliding_window=2 * BS, prefix_cache_retention_interval=retention))
    core = h.connector.core
    rng = random.Random(3)
    turn = h.run(h.make_request([rng.randrange(1, 500) for _ in range(PROMPT)],
                                session_id="s", max_tokens=OUTPUT))
    assert len(turn.output_token_ids) == OUTPUT
    chain = list(turn.prompt_token_ids) + list(turn.output_token_ids)

    def next_turn():
        return h.make_request(chain + [5, 5, 5], session_id="s")

    # vLLM's own best for the next turn, nothing evicted yet: 4 blocks at 0, else all 6.
    reach = 4 if retention == 0 else 6
    assert h.kv_cache_manager.get_computed_blocks(next_turn())[1] == reach * BS

    outcome = _pin(core, "p1")
    # Applied: the positions held, none past the hit point (before, all 6 at 0;
    # test_plugin_hybrid_hit_point_claims.py).
    assert (outcome.requested.blocks, outcome.applied.blocks) == (6, reach)
    if retention == 0:
        assert outcome.status.value == "clipped", outcome
        assert "resident for 4 of 6" in outcome.reason
        assert "a prefix hit reaches 4" in outcome.reason
    else:
        assert outcome.status.value == "accepted", outcome
    for _ in range(20):  # unrelated traffic: evicts every block nothing holds
        h.run(h.make_request([rng.randrange(1, 500) for _ in range(3 * BS + 2)]))
    request = h.add(next_turn())
    hits = []
    h.step(lambda _: hits.append(request.prefill_stats.num_local_cached_tokens))
    assert hits == [reach * BS]
