"""Action ids that collide, on vLLM's real KVCacheManager and block pool: an envelope
naming one id twice gets one answer for it and applies none of its actions, and a
Prefetch still waiting never settles over a newer action sent under its id."""

from __future__ import annotations

from typing import Any

from core_fixtures import cached_blocks, hints_message

from kvhint.engine_plugin.config import PluginConfig
from kvhint.engine_plugin.core import PluginCore
from kvhint.engine_plugin.headless import HeadlessCache, build_kv_cache_manager
from kvhint.engine_plugin.transport_inbound import deferred_outcomes
from kvhint.engine_plugin.mailbox import Inbound
from kvhint.engine_plugin.vllm_adapter.cache import digest_to_int
from kvhint.schemas import InvalidAction, OutcomeStatus, ParsedAction, decode_hints
from kvhint.schemas.hints import DUPLICATE_ACTION_ID

BS = 16


def _plugin(clock: list[float], **extra: Any) -> tuple[HeadlessCache, PluginCore]:
    cache = build_kv_cache_manager(block_size=BS, num_blocks=64)
    core = PluginCore.attach(cache.manager, PluginConfig(worker_id="w0", **extra),
                             clock=lambda: clock[0])
    return cache, core


def test_decoding_answers_an_id_named_twice_once_and_keeps_empty_ids_apart() -> None:
    decoded = decode_hints(hints_message(
        ("a", "kv.pin", {"target": {"session_id": "s"}, "ttl_s": 5}),
        ("b", "kv.retain", {"target": {"session_id": "s"}, "priority": 5}),
        ("a", "kv.retain", {"target": {"session_id": "s"}, "priority": 5}),
        ("", "kv.pin", {"target": {"session_id": "s"}, "ttl_s": 5}),
        ("", "kv.pin", {"target": {"session_id": "s"}, "ttl_s": 5})))
    assert [a.action_id for a in decoded.actions] == ["a", "b", "", ""]
    first = decoded.actions[0]
    assert isinstance(first, InvalidAction) and first.action_type == "kv.pin"
    assert first.reason.startswith(DUPLICATE_ACTION_ID) and "2 times" in first.reason
    assert isinstance(decoded.actions[1], ParsedAction)
    # The transport's early answer: no deferred for an id that will be rejected.
    item = Inbound("hints", b"", 0.0, decoded=decoded)
    assert [o.action_id for o in deferred_outcomes(item, "w0", 0.02)] == ["b"]


def test_an_envelope_naming_an_id_twice_applies_neither_and_answers_it_once() -> None:
    # Before, the first copy was applied (a Pin here) and the second answered the Pin's
    # outcome again under the same id: two outcomes for one id, one of them about an
    # action (a Retain) that was never applied; the router keys outcomes by id.
    now = [1_000.0]
    cache, core = _plugin(now)
    cached_blocks(cache, core, "s", 1)
    message = hints_message(("a", "kv.pin", {"target": {"session_id": "s"}, "ttl_s": 30}),
                     ("a", "kv.retain", {"target": {"session_id": "s"}, "priority": 50}),
                     ("b", "kv.retain", {"target": {"session_id": "s"}, "priority": 40}))
    outcomes = core.apply_hints(message)
    assert [(o.action_id, o.status) for o in outcomes] == [
        ("a", OutcomeStatus.REJECTED), ("b", OutcomeStatus.ACCEPTED)]
    assert outcomes[0].reason.startswith(DUPLICATE_ACTION_ID)
    executor = core.executor
    assert (executor.pinned_blocks, executor.retained_blocks) == (0, 4)
    # A redelivery is a repeat: the same answers, nothing applied again.
    assert core.apply_hints(message) == outcomes
    # An id answered before and now named twice is a repeat too: its answer once.
    (pinned,) = core.apply_hints(hints_message(
        ("c", "kv.pin", {"target": {"session_id": "s"}, "ttl_s": 30})))
    again = core.apply_hints(hints_message(
        ("c", "kv.pin", {"target": {"session_id": "s"}, "ttl_s": 30}),
        ("c", "kv.retain", {"target": {"session_id": "s"}, "priority": 5})))
    assert again == [pinned] and pinned.status is OutcomeStatus.ACCEPTED


def test_a_waiting_prefetch_never_settles_over_a_newer_action_under_its_id() -> None:
    # A Prefetch waits for blocks not in G1; the idempotency memory forgets it and a
    # Retain comes under the same id. Before, when the blocks arrived the Prefetch
    # settled: it retained them under the id, which ended the Retain's claim (its
    # priority and TTL replaced by the Prefetch's), and answered the id a second time.
    now = [1_000.0]
    cache, core = _plugin(now, max_remembered_actions=1, retain_budget_fraction=1.0)
    executor = core.executor
    resident = cached_blocks(cache, core, "s", 1)
    later = cache.make_request(list(range(500, 500 + 4 * BS + 1)), session_id="later")
    coming = [digest_to_int(h) for h in later.block_hashes]
    (deferred,) = core.apply_hints(hints_message(("x", "kv.prefetch", {
        "target": {"block_hashes": coming}, "deadline_s": 60})))
    assert deferred.status is OutcomeStatus.DEFERRED and executor.pending_actions == 1
    core.apply_hints(hints_message(("y", "kv.pin", {"target": {"block_hashes": [7]}, "ttl_s": 5})))
    (retained,) = core.apply_hints(hints_message(("x", "kv.retain", {
        "target": {"session_id": "s"}, "priority": 30, "ttl_s": 600})))
    assert retained.status is OutcomeStatus.ACCEPTED and retained.applied.blocks == 4
    assert cache.admit(later) is not None  # the Prefetch's blocks arrive
    cache.finish(later)
    core.sync()
    assert core.advance() == []  # no second answer for "x"
    holds = executor.holds
    assert executor.retained_blocks == 4
    for key in resident:
        hold = holds._holds[executor.cache.lookup(key).block_id]
        assert hold.retains == {"x": 30}
    assert all(not holds.is_held(executor.cache.lookup(k).block_id) for k in coming)
    assert executor.pending_actions == 0 and executor._prefetch_waiting == 0


def test_a_replaced_waiting_prefetch_is_counted_and_its_id_answered_by_the_newer_action(
        ) -> None:
    # Before, the waiting Prefetch a newer action replaced vanished uncounted, and the
    # newer action's outcome (the only answer the id ever gets) did not say it stood in
    # for the Prefetch. A sender keyed by id (the router) gets that outcome, terminal.
    from kvhint.engine_plugin.counter_exports import EXPORTS, read_counters
    from kvhint.engine_plugin.executor import ExecutorCounters

    now = [1_000.0]
    cache, core = _plugin(now, max_remembered_actions=1, retain_budget_fraction=1.0)
    executor = core.executor
    cached_blocks(cache, core, "s", 1)
    later = cache.make_request(list(range(500, 500 + 4 * BS + 1)), session_id="later")
    coming = [digest_to_int(h) for h in later.block_hashes]
    (deferred,) = core.apply_hints(hints_message(("x", "kv.prefetch", {
        "target": {"block_hashes": coming}, "deadline_s": 60})))
    assert deferred.status is OutcomeStatus.DEFERRED
    assert executor.counters.prefetches_replaced == 0
    core.apply_hints(hints_message(("y", "kv.pin", {"target": {"block_hashes": [7]}, "ttl_s": 5})))
    (retained,) = core.apply_hints(hints_message(("x", "kv.retain", {
        "target": {"session_id": "s"}, "priority": 30, "ttl_s": 600})))
    assert retained.status is OutcomeStatus.ACCEPTED and retained.status.is_terminal
    assert "replaced a Prefetch still waiting under this action_id" in retained.reason
    assert executor.counters.prefetches_replaced == 1
    stats = read_counters({cls: executor.counters if cls is ExecutorCounters else None
                           for cls in EXPORTS})
    assert stats["prefetches_replaced"] == 1  # kvhint:prefetches_replaced_total
    # A repeat of the Retain gets its answer again; nothing else is replaced or counted.
    assert core.apply_hints(hints_message(("x", "kv.retain", {
        "target": {"session_id": "s"}, "priority": 30, "ttl_s": 600}))) == [retained]
    now[0] += 61
    assert core.advance() == [] and executor.counters.prefetches_replaced == 1
    # A Prefetch that was not waiting (answered at once) is replaced by nothing.
    (at_once,) = core.apply_hints(hints_message(("z", "kv.prefetch", {
        "target": {"session_id": "s"}, "deadline_s": 5})))
    assert at_once.status is OutcomeStatus.ACCEPTED
    core.apply_hints(hints_message(("y2", "kv.pin", {"target": {"block_hashes": [7]}})))
    (again,) = core.apply_hints(hints_message(("z", "kv.retain", {
        "target": {"session_id": "s"}, "priority": 30})))
    assert "replaced" not in again.reason and executor.counters.prefetches_replaced == 1
