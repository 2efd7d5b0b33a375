"""Randomized: the hold ledger's bookkeeping never drifts from vLLM's real BlockPool
reference counts, under action ids that collide every way they can (re-sent after the
idempotency memory forgot them, named twice in one envelope, reused by another action
type, shared by a donor advice, under a Prefetch still waiting), with requests admitted
(relief under pressure), freed, TTLs and deadlines passing and prefix-cache resets."""

from __future__ import annotations

import json
import random
from collections import Counter
from typing import Any

import pytest

from kvhint.engine_plugin.config import PluginConfig
from kvhint.engine_plugin.core import PluginCore
from kvhint.engine_plugin.headless import HeadlessCache, build_kv_cache_manager
from kvhint.schemas import HintOutcome, OutcomeStatus

BS = 16
NUM_BLOCKS = 48
IDS = [f"a{i}" for i in range(6)]  # few ids: they collide all the time
SESSIONS = [f"s{i}" for i in range(4)]


def _hints(actions: list[tuple[str, str, dict]], message_id: str) -> bytes:
    return json.dumps({"protocol_version": "1", "message_id": message_id, "actions": [
        {"action_id": aid, "action_type": type_, "action_version": "1.0", "payload": payload}
        for aid, type_, payload in actions]}).encode()


def _random_action(rng: random.Random, core: PluginCore) -> tuple[str, str, dict]:
    session = rng.choice(SESSIONS)
    if rng.random() < 0.3:
        keys = core.index.session_blocks(session) + [rng.getrandbits(63) for _ in range(2)]
        target: dict[str, Any] = {"block_hashes": rng.sample(keys, rng.randint(1, len(keys)))}
    elif rng.random() < 0.3:
        target = {"session_id": session, "prefix_tokens": BS * rng.randint(1, 4)}
    else:
        target = {"session_id": session}
    kind = rng.choice(["kv.pin", "kv.retain", "kv.retain", "kv.prefetch"])
    if kind == "kv.pin":
        payload: dict[str, Any] = {"target": target, "ttl_s": rng.choice([1, 5, 30])}
    elif kind == "kv.retain":
        payload = {"target": target, "priority": rng.choice([0, 10, 50, 90]),
                   "ttl_s": rng.choice([2, 20, 200])}
    else:
        payload = {"target": target, "deadline_s": rng.choice([1, 5, 20])}
    return rng.choice(IDS), kind, payload


def _check(hc: HeadlessCache, core: PluginCore) -> None:
    pool, holds = hc.block_pool, core.executor.holds
    manager = hc.manager.coordinator.single_type_managers[0]
    used = Counter(b.block_id for blocks in manager.req_to_blocks.values() for b in blocks
                   if b.block_id != 0)
    for block in pool.blocks[1:]:
        expected = used[block.block_id] + holds.is_held(block.block_id)
        assert block.ref_cnt == expected, (block.block_id, block.ref_cnt, expected)
    assert pool.get_num_free_blocks() == sum(b.ref_cnt == 0 for b in pool.blocks[1:])
    live = holds._holds
    assert holds.pinned == sum(bool(h.pins) for h in live.values())
    assert holds.retained == sum(not h.pins and bool(h.retains) for h in live.values())
    assert all(h.pins or h.retains for h in live.values())
    claims = holds._claims
    for block_id, hold in live.items():
        for action_id in (*hold.pins, *hold.retains):
            assert block_id in claims[action_id].block_ids, (block_id, action_id)
    for action_id, claim in claims.items():
        for block_id in claim.block_ids:
            hold = live[block_id]
            assert action_id in (hold.pins if claim.kind == "pin" else hold.retains)
    assert holds.pinned <= holds.max_pinned


def _one_terminal_per_id(outcomes: list[HintOutcome]) -> None:
    ids = Counter(o.action_id for o in outcomes if o.status is not OutcomeStatus.DEFERRED)
    assert all(n == 1 for n in ids.values()), ids


@pytest.mark.parametrize("seed", range(4))
def test_holds_match_vllm_ref_counts_under_colliding_action_ids(seed: int) -> None:
    rng = random.Random(seed)
    now = [1_000.0]
    hc = build_kv_cache_manager(block_size=BS, num_blocks=NUM_BLOCKS)
    core = PluginCore.attach(hc.manager, PluginConfig(
        worker_id="w0", max_remembered_actions=2, pin_budget_fraction=0.3,
        retain_budget_fraction=0.5, prefetch_budget_fraction=0.25),
        clock=lambda: now[0])
    running: list[Any] = []
    seen: Counter = Counter()  # outcome statuses: what the run exercised
    prompts: dict[str, list[int]] = {s: [] for s in SESSIONS}
    for step in range(400):
        roll = rng.random()
        if roll < 0.3:
            session = rng.choice(SESSIONS)
            prompt = prompts[session] + [rng.randint(1, 50_000)
                                         for _ in range(rng.randint(1, 3 * BS))]
            request = hc.make_request(prompt, session_id=session)
            if hc.admit(request) is not None:
                running.append(request)
                prompts[session] = prompt if len(prompt) < 10 * BS else []
        elif roll < 0.45 and running:
            hc.finish(running.pop(rng.randrange(len(running))))
        elif roll < 0.8:
            actions = [_random_action(rng, core) for _ in range(rng.randint(1, 3))]
            if rng.random() < 0.2:
                actions.append((actions[0][0], *_random_action(rng, core)[1:]))
            outcomes = core.apply_hints(_hints(actions, f"m{step}"))
            _one_terminal_per_id(outcomes)
            seen.update(o.status for o in outcomes)
        elif roll < 0.87:
            session = rng.choice(SESSIONS)
            keys = core.index.session_blocks(session)
            if keys:
                seen[core.apply_advice(json.dumps({
                    "advice_id": rng.choice(IDS), "session_id": session,
                    "namespace": core.cache_namespace, "donor_block_hashes": keys,
                    "similarity": 0.5, "ttl_s": 5, "at": now[0]}).encode()).status] += 1
        elif roll < 0.97:
            now[0] += rng.choice([0.5, 2, 10])
            _one_terminal_per_id(core.advance())
        elif not running:
            hc.manager.reset_prefix_cache()
        core.sync()
        core.take_releases()
        _check(hc, core)
    for request in running:
        hc.finish(request)
    core.sync()
    core.executor.release_all()
    _check(hc, core)
    assert hc.block_pool.get_num_free_blocks() == NUM_BLOCKS
    assert seen[OutcomeStatus.ACCEPTED] and seen[OutcomeStatus.DEFERRED]
    assert core.executor.counters.duplicates > 0
