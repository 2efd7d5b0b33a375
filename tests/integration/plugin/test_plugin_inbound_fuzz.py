"""Randomized hostile input to the plugin's inbound path, on vLLM's real KVCacheManager and
block pool, the way the NATS transport hands it over (decoded off the scheduler thread,
posted to a small inbox, turned away when full) and the scheduler thread takes it (pump):
bytes that are no JSON, JSON of the wrong shape, unknown protocol and action versions,
unknown action types (``kv.donor`` among them), duplicate and colliding ids, huge and
wrongly typed hash lists, NaN and out-of-range numbers, sessions of other tenants or that
never existed, donor advice for blocks not resident, prefix-cache resets in between.

Every message is answered, no exception reaches the scheduler (``internal_errors`` stays
0), no action id stays in flight once answered, and vLLM's block reference counts are
the requests' plus the plugin's holds after every step (``_check``)."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
from test_plugin_holds_refcount_random import _check

from kvhint.engine_plugin.config import PluginConfig
from kvhint.engine_plugin.core import MAX_INBOUND_ACTIONS_PER_STEP, PluginCore
from kvhint.engine_plugin.headless import HeadlessCache, build_kv_cache_manager
from kvhint.engine_plugin.inbound_checks import decode_hints_safely
from kvhint.engine_plugin.mailbox import Inbound, Mailbox, answer_key
from kvhint.engine_plugin.transport_counters import TransportCounters
from kvhint.engine_plugin.transport_inbound import (
    answer_full_inbox,
    answer_full_inbox_advice,
    decode_advice_or_reject,
)
from kvhint.schemas import DONOR_ACTION_TYPE
from kvhint.schemas.hints import MAX_MESSAGE_ID_CHARS

BS = 16
NUM_BLOCKS = 48
LIVE = ["s0", "s1", "s2"]
SESSIONS = [*LIVE, "tenant-b/s0", "ns2:s1", "never-seen"]
ODD = [None, -1, 0, 2**64, -(2**70), 1e308, float("nan"), float("inf"), "x", [], {}, True,
       3.5, "1", 10**30]
TYPES = ["kv.pin", "kv.retain", "kv.demote", "kv.prefetch", "kv.share", "kv.donor",
         "kv.bogus", "", None, 5]
VERSIONS = ["1.0", "1.1", "1.2", "1.3", "2.0", "", None]
IDS = [*(f"a{i}" for i in range(8)), "", None, 7]


def _target(rng: random.Random, core: PluginCore) -> Any:
    roll = rng.random()
    if roll < 0.2:
        return {"session_id": rng.choice(SESSIONS)}
    if roll < 0.35:
        return {"block_hashes": core.index.session_blocks(rng.choice(LIVE))
                + [rng.getrandbits(64)]}
    if roll < 0.45:
        return {"block_hashes": [rng.choice(ODD) for _ in range(3)]}
    if roll < 0.5:
        return {"block_hashes": list(range(10 * NUM_BLOCKS))}
    if roll < 0.7:
        return {"session_id": rng.choice(SESSIONS),
                "prefix_tokens": rng.choice([*ODD, BS, 2 * BS, 10**9])}
    return rng.choice([{"session_id": rng.choice(ODD)}, rng.choice(ODD)])


def _action(rng: random.Random, core: PluginCore) -> Any:
    payload: Any = {"target": _target(rng, core)}
    for key in ("ttl_s", "priority", "deadline_s", "expires_at", "evict_rest_first",
                "owner", "destination_worker", "unknown_field"):
        if rng.random() < 0.25:
            payload[key] = rng.choice([*ODD, 5, 50, "agent", "w1"])
    action = {"action_id": rng.choice(IDS), "action_type": rng.choice(TYPES),
              "action_version": rng.choice(VERSIONS),
              "payload": payload if rng.random() < 0.9 else rng.choice(ODD)}
    if rng.random() < 0.1:
        del action[rng.choice(list(action))]
    return action if rng.random() < 0.95 else rng.choice(ODD)


def _hints(rng: random.Random, core: PluginCore, n: int) -> bytes:
    roll = rng.random()
    if roll < 0.04:
        return rng.randbytes(rng.randint(0, 40))
    if roll < 0.06:
        return b"\x82\xa1a\x01\xa1b\x02"  # msgpack
    if roll < 0.08:
        return json.dumps(rng.choice(ODD)).encode()
    envelope: dict[str, Any] = {
        "protocol_version": rng.choice(["1", "1", "1", " 1", "2", "1.1", 1, None]),
        "message_id": rng.choice([f"m{n}", "", None, 5]),
        "actions": [_action(rng, core) for _ in range(rng.randint(0, 4))]}
    if rng.random() < 0.1:
        envelope["actions"] = rng.choice(ODD)
    if rng.random() < 0.1:
        del envelope[rng.choice(list(envelope))]
    return json.dumps(envelope).encode()


def _advice(rng: random.Random, core: PluginCore) -> bytes:
    if rng.random() < 0.1:
        return rng.randbytes(rng.randint(0, 30))
    keys = core.index.session_blocks(rng.choice(LIVE))
    advice = {"advice_id": rng.choice(IDS), "session_id": rng.choice(SESSIONS),
              "namespace": rng.choice([core.cache_namespace, "other", "", 5]),
              "donor_block_hashes": rng.choice([keys, [*keys, 2**64], [],
                                                [rng.getrandbits(64)],
                                                list(range(5 * NUM_BLOCKS)), ["x"], None]),
              "similarity": rng.choice([0.5, 2, -1, float("nan")]),
              "ttl_s": rng.choice([5, 0, -1, 1e9, float("nan")]),
              "at": rng.choice([1.0, "x", float("inf")])}
    if rng.random() < 0.1:
        del advice[rng.choice(list(advice))]
    return json.dumps(advice).encode()


def _post(kind: str, data: bytes, mailbox: Mailbox, counters: TransportCounters
          ) -> list[str]:
    """What the transport does with an inbound message (NatsTransport._post); the ids
    the message names (a hints message's action ids, or the advice's id)."""
    item = Inbound(kind, data, 0.0)
    if kind == "hints":
        item.decoded, failure = decode_hints_safely(data)
        assert failure is None, failure
        if not mailbox.post(item, [a.action_id for a in item.decoded.actions]):
            answer_full_inbox(mailbox, counters, "w0", item.decoded)
        return [a.action_id for a in item.decoded.actions]
    item.decoded = decode_advice_or_reject(data, mailbox, counters, "w0")
    if item.decoded is not None:
        if not mailbox.post(item, [answer_key(item.decoded.advice_id, DONOR_ACTION_TYPE)]
                            if item.decoded.advice_id else []):
            answer_full_inbox_advice(mailbox, counters, "w0", item.decoded)
        return [item.decoded.advice_id]
    return []


def _turn(rng: random.Random, hc: HeadlessCache, prompts: dict[str, list[int]],
          running: list[Any]) -> None:
    session = rng.choice(LIVE)
    prompt = prompts[session] + [rng.randint(1, 5000) for _ in range(rng.randint(1, 3 * BS))]
    request = hc.make_request(prompt, session_id=session)
    if hc.admit(request) is not None:
        running.append(request)
        prompts[session] = prompt if len(prompt) < 8 * BS else []


@pytest.mark.parametrize("seed", range(6))
def test_hostile_inbound_messages_are_answered_and_leave_no_trace(seed: int) -> None:
    rng = random.Random(seed)
    now = [1_000.0]
    hc = build_kv_cache_manager(block_size=BS, num_blocks=NUM_BLOCKS)
    # A small inbox and small memories: full-inbox answers and forgotten ids come often.
    mailbox = Mailbox(5, 100_000, 100, answered_limit=3)
    core = PluginCore.attach(hc.manager, PluginConfig(
        worker_id="w0", max_remembered_actions=3, pin_budget_fraction=0.3,
        retain_budget_fraction=0.5), mailbox=mailbox, clock=lambda: now[0])
    counters = TransportCounters()
    sent: set[str] = set()
    running: list[Any] = []
    prompts: dict[str, list[int]] = {s: [] for s in LIVE}
    for step in range(300):
        roll = rng.random()
        if roll < 0.2:
            _turn(rng, hc, prompts, running)
        elif roll < 0.3 and running:
            hc.finish(running.pop(rng.randrange(len(running))))
        elif roll < 0.65:
            sent.update(_post("hints", _hints(rng, core, step), mailbox, counters))
        elif roll < 0.75:
            sent.update(_post("advice", _advice(rng, core), mailbox, counters))
        elif roll < 0.9:
            core.sync()
            core.pump()
        elif roll < 0.97:
            now[0] += rng.choice([0.5, 3, 30])
        elif not running:
            assert hc.manager.reset_prefix_cache()
        core.sync()
        core.take_releases()
        _check(hc, core)
    for _ in range(3):
        core.pump()
    assert not mailbox.inbound
    assert core.counters.internal_errors == 0 and counters.internal_errors == 0
    assert mailbox.counters.outcomes_dropped == 0
    # Once answered, no id stays in flight (a repeat finding the inbox full would get
    # nothing): only the Prefetches and Demotes still waiting are.
    waiting = set(core.executor._pending) | set(core.executor._pending_demotes)
    assert [key for key in mailbox.in_flight if key not in waiting] == []
    answered = {o.action_id for o in mailbox.outcomes if o.status.is_terminal}
    assert sent - answered - waiting <= {""}
    for request in running:
        hc.finish(request)
    core.sync()
    core.executor.release_all()
    _check(hc, core)
    assert hc.block_pool.get_num_free_blocks() == NUM_BLOCKS


def test_a_step_applies_at_most_its_action_budget_of_one_message() -> None:
    """A step took 64 messages or 256 KiB, but a message whole: one 1 MB message of ~7k
    session Pins held the scheduler thread for ~50 s in one step. Now a step applies
    MAX_INBOUND_ACTIONS_PER_STEP actions at most; the rest of the message stays first in
    the inbox (taken: no early deferred) and the next steps apply it, in order, before
    the messages behind it."""
    hc = build_kv_cache_manager(block_size=BS, num_blocks=NUM_BLOCKS)
    mailbox = Mailbox(10, 100_000, 100)
    core = PluginCore.attach(hc.manager, PluginConfig(worker_id="w0", pin_budget_fraction=0.5),
                             mailbox=mailbox)
    request = hc.make_request(list(range(4 * BS + 1)), session_id="s0")
    assert hc.admit(request) is not None
    hc.finish(request)
    core.sync()
    n = 2 * MAX_INBOUND_ACTIONS_PER_STEP + 5
    big = json.dumps({"protocol_version": "1", "message_id": "big", "actions": [
        {"action_id": f"p{i}", "action_type": "kv.pin", "action_version": "1.0",
         "payload": {"target": {"session_id": "s0"}, "ttl_s": 60}} for i in range(n)]})
    counters = TransportCounters()
    _post("hints", big.encode(), mailbox, counters)
    _post("hints", json.dumps({"protocol_version": "1", "message_id": "next", "actions": [
        {"action_id": "after", "action_type": "kv.bogus", "action_version": "1.0",
         "payload": {}}]}).encode(), mailbox, counters)
    core.pump()
    assert [o.action_id for o in mailbox.outcomes] == [
        f"p{i}" for i in range(MAX_INBOUND_ACTIONS_PER_STEP)]
    rest = mailbox.inbound[0]
    assert rest.taken and len(rest.decoded.actions) == n - MAX_INBOUND_ACTIONS_PER_STEP
    assert core.has_pending_work()
    core.pump()
    core.pump()
    assert [o.action_id for o in mailbox.outcomes] == [f"p{i}" for i in range(n)] + ["after"]
    assert {o.message_id for o in mailbox.outcomes} == {"big", "next"}
    assert all(o.status.value == "accepted" for o in list(mailbox.outcomes)[:n])
    assert not mailbox.inbound and not mailbox.in_flight
    assert core.executor.pinned_blocks == 4 and core.counters.internal_errors == 0
    _check(hc, core)


def test_a_long_message_id_is_not_echoed_in_every_outcome() -> None:
    """Every outcome of a message echoes its message_id: a 1 MB message of a 500 KB
    message_id and ~6k actions made ~3 GB of outcomes for the transport to encode and
    publish. A message_id past MAX_MESSAGE_ID_CHARS is refused (each action rejected)
    and not echoed."""
    hc = build_kv_cache_manager(block_size=BS, num_blocks=NUM_BLOCKS)
    mailbox = Mailbox(10, 100_000, 100)
    core = PluginCore.attach(hc.manager, PluginConfig(worker_id="w0"), mailbox=mailbox)
    for message_id, reason in (("M" * (MAX_MESSAGE_ID_CHARS + 1), "message_id is longer"),
                               ("M" * MAX_MESSAGE_ID_CHARS, None)):
        ids = [f"{len(message_id)}-{i}" for i in range(100)]
        _post("hints", json.dumps({"protocol_version": "1", "message_id": message_id,
                                   "actions": [{"action_id": action_id, "action_type": "kv.pin",
                                                "action_version": "1.0", "payload": {
                                                    "target": {"session_id": "s0"}}}
                                               for action_id in ids]}).encode(),
              mailbox, TransportCounters())
        core.pump()
        core.pump()
        outcomes = list(mailbox.outcomes)
        mailbox.outcomes.clear()
        assert [o.action_id for o in outcomes] == ids
        if reason is None:  # applied (nothing cached: missing), the id echoed
            assert {(o.message_id, o.status.value) for o in outcomes} == {(message_id, "missing")}
        else:
            assert {(o.message_id, o.status.value) for o in outcomes} == {("", "rejected")}
            assert all(o.reason.startswith(reason) for o in outcomes)
    assert core.counters.internal_errors == 0
