"""Randomized, on vLLM's real Scheduler (not the manager alone, as
``test_plugin_holds_refcount_random`` is): every block's reference count is what the
scheduler's requests, its deferred frees and the plugin's holds explain, through chunked
prefills, aborts mid-generation, preemptions, relief under pressure, ``evict_rest_first``
reordering the free queue, and prefix-cache resets with and without running
requests; synchronous and async scheduling, the plugin as a KV producer and as a KV
consumer (vLLM then defers frees). No plugin error ever reaches a hook,
every held block stays cached under its key, and once the engine drains a reset gives
every block back."""

from __future__ import annotations

import json
import random
from collections import Counter
from typing import Any

import pytest

from kvhint.engine_plugin.headless import HeadlessScheduler, HeadlessSchedulerSpec, build_scheduler

BS = 32
NUM_BLOCKS = 40  # with vLLM's null block: tight, so relief and preemption happen
SESSIONS = [f"s{i}" for i in range(4)]
SETUPS = {
    "sync": {},
    "async": {"async_scheduling": True},
    "async kv_both": {"async_scheduling": True, "kv_role": "kv_both"},
    # A hybrid model (a sliding-window layer beside full attention): holds take the
    # window group's blocks a hit needs as well (engine_plugin/group_holds.py).
    "hybrid": {"sliding_window": 2 * BS, "max_model_len": 16 * BS},
}
# Not beside vLLM's OffloadingConnector: there a random run with aborts and preemptions
# trips an assertion in its scheduler side (offloading/scheduler.py, build_connector_meta:
# a preempted request's first transfer job is not a store) with no hint ever sent, so in
# no code of the plugin's (seen in review; not run with the plugin absent).


def _build(setup: str) -> tuple[HeadlessScheduler, Any]:
    h = build_scheduler(HeadlessSchedulerSpec(
        block_size=BS, num_blocks=NUM_BLOCKS, max_num_batched_tokens=256,
        long_prefill_token_threshold=64, connector_module="kvhint.engine_plugin.connector",
        connector_extra_config={"worker_id": "w0", "pin_budget_fraction": 0.3,
                                "retain_budget_fraction": 0.6},
        **SETUPS[setup]))
    return h, h.connector.core


def _check(h: HeadlessScheduler, core: Any) -> None:
    pool, scheduler, holds = h.block_pool, h.scheduler, core.executor.holds
    used: Counter = Counter()
    for manager in scheduler.kv_cache_manager.coordinator.single_type_managers:
        for blocks in manager.req_to_blocks.values():
            used.update(b.block_id for b in blocks if not b.is_null)
    for _, blocks in scheduler.deferred_frees:  # popped, returned after the step in flight
        used.update(b.block_id for b in blocks)
    for block in pool.blocks[1:]:
        expected = used[block.block_id] + holds.is_held(block.block_id)
        assert block.ref_cnt == expected, (block.block_id, block.ref_cnt, expected)
    assert pool.get_num_free_blocks() == sum(b.ref_cnt == 0 for b in pool.blocks[1:])
    for hold in holds._holds.values():
        assert core.adapter.is_cached(hold.handle), hold.handle
    # The ledger's own books: its counts, and each claim's blocks held for it (a hybrid
    # model's cuts, engine_plugin/hold_cuts.py, move both).
    assert holds.pinned == sum(bool(h.pins) for h in holds._holds.values())
    assert holds.retained == sum(bool(h.retains) and not h.pins for h in holds._holds.values())
    for action_id, claim in holds._claims.items():
        for block_id in claim.block_ids:
            hold = holds._holds[block_id]
            assert action_id in (hold.pins if claim.kind == "pin" else hold.retains)
        # A hybrid claim's other groups' blocks only at positions it holds (one it lost,
        # by relief too, takes them with it).
        positions = {holds._holds[b].handle.key for b in claim.block_ids
                     if not holds._holds[b].handle.side}
        assert all(holds._holds[b].handle.key in positions for b in claim.block_ids), action_id


def _hint(rng: random.Random, step: int) -> bytes:
    kind = rng.choice(["kv.pin", "kv.retain", "kv.retain"])
    payload: dict[str, Any] = {"target": {"session_id": rng.choice(SESSIONS)}}
    if kind == "kv.pin":
        payload["ttl_s"] = rng.choice([1, 30])
    elif kind == "kv.retain":
        payload.update(priority=rng.choice([0, 10, 90]), ttl_s=rng.choice([2, 200]))
    if rng.random() < 0.3:
        payload["evict_rest_first"] = True
    return json.dumps({"protocol_version": "1", "message_id": f"m{step}", "actions": [
        {"action_id": f"a{step}", "action_type": kind, "action_version": "1.1",
         "payload": payload}]}).encode()


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("setup", list(SETUPS))
def test_block_references_match_the_scheduler_and_the_holds(setup: str, seed: int) -> None:
    from vllm.v1.request import RequestStatus

    rng = random.Random(seed)
    h, core = _build(setup)
    scheduler = h.scheduler
    is_async = SETUPS[setup].get("async_scheduling", False)
    prompts: dict[str, list[int]] = {s: [] for s in SESSIONS}
    requests: list[Any] = []
    seen: Counter = Counter()
    in_flight = None
    for step in range(300):
        roll = rng.random()
        if roll < 0.25:
            session = rng.choice(SESSIONS)
            tokens = prompts[session] + [rng.randint(1, 30_000)
                                         for _ in range(rng.randint(5, 3 * BS))]
            prompts[session] = tokens = tokens if len(tokens) <= 8 * BS else tokens[-2 * BS:]
            requests.append(h.add(h.make_request(tokens, session_id=session,
                                                 max_tokens=rng.randint(1, 40))))
        elif roll < 0.32:
            live = [r for r in requests if r.request_id in scheduler.requests]
            if live:
                scheduler.finish_requests([rng.choice(live).request_id],
                                          RequestStatus.FINISHED_ABORTED)
        elif roll < 0.55:
            for outcome in core.apply_hints(_hint(rng, step)):
                seen[outcome.status.value] += 1
        elif roll < 0.57:
            try:
                seen[f"reset {scheduler.reset_prefix_cache(rng.random() < 0.5)}"] += 1
            except RuntimeError:
                # vLLM's own refusal: a reset of running requests while frees it deferred
                # for a step in flight are outstanding (a KV consumer with async scheduling)
                assert scheduler.deferred_frees
                seen["reset refused"] += 1
        if is_async:  # a step in flight while the next is scheduled
            out = scheduler.schedule()
            if in_flight is not None:
                h.complete(in_flight)
            in_flight = out
        else:
            h.step()
        core.advance()
        _check(h, core)
        seen["side holds"] += sum(h.handle.side for h in core.executor.holds._holds.values())
    if in_flight is not None:
        h.complete(in_flight)
    scheduler.finish_requests([r.request_id for r in requests if r.request_id in
                               scheduler.requests], RequestStatus.FINISHED_ABORTED)
    h.step()
    _check(h, core)
    assert core.counters.internal_errors == 0
    counters = core.executor.holds.counters
    print(f"\n{setup} {seed}: {dict(seen)}, relieved {counters.released_under_pressure}, "
          f"preempted {sum(r.num_preemptions for r in requests)}")
    assert seen["accepted"] > 0 and seen["reset True"] + seen["reset refused"] > 0, seen
    assert (seen["side holds"] > 0) == ("sliding_window" in SETUPS[setup]), seen
    # Drained: the reset gives back every hold and the pool is whole again.
    assert scheduler.reset_prefix_cache()
    assert h.block_pool.get_num_free_blocks() == NUM_BLOCKS - 1
    assert core.executor.pinned_blocks == core.executor.retained_blocks == 0
