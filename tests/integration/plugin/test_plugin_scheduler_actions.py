"""Each hint action against vLLM's real Scheduler and block pool (no model).

The connector is loaded by module path, exactly as a server loads it; hints are applied
through the connector's PluginCore (the NATS path has its own tests; retains under budget
and memory pressure, and the releases reported of them, are in test_plugin_scheduler_holds).
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from scheduler_fixtures import (
    BS,
    cached_tokens,
    empty_blocks_first,
    flood,
    hint,
    prompt,
    sched,
    turn,
    turn_hit,
)

from kvhint.engine_plugin.core_inbound import MAX_LATENCY_SAMPLES
from kvhint.engine_plugin.headless import (
    HeadlessScheduler,
    HeadlessSchedulerSpec,
    build_scheduler,
)
from kvhint.engine_plugin.mailbox import Inbound
from kvhint.engine_plugin.metrics import COUNTERS, LABELLED_COUNTERS, LATENCY_KEY
from kvhint.schemas import (
    DemotePayload,
    HintOutcome,
    HintOwner,
    PinPayload,
    PrefetchPayload,
    RetainPayload,
    SharePayload,
    Target,
)


def test_pinned_session_survives_pressure_that_evicts_the_control() -> None:
    h = sched(pin_budget_fraction=0.2)
    turn(h, "pinned", [1, 2, 3, 4])
    turn(h, "control", [5, 6, 7, 8])
    assert cached_tokens(h, [1, 2, 3, 4]) == 4 * BS and cached_tokens(h, [5, 6, 7, 8]) == 4 * BS
    outcome = hint(h, PinPayload(target=Target(session_id="pinned"), ttl_s=60))
    assert outcome.status.value == "accepted" and outcome.applied.blocks == 4
    assert h.connector.core.executor.pinned_blocks == 4
    flood(h, 40)  # 160 blocks through a 63-block pool
    assert cached_tokens(h, [1, 2, 3, 4]) == 4 * BS
    assert cached_tokens(h, [5, 6, 7, 8]) == 0
    # The next turn of the pinned session really reuses the cache.
    assert turn_hit(h, "pinned", [1, 2, 3, 4, 9]) == 4 * BS
    assert h.connector.core.counters.internal_errors == 0


def _workload(h: HeadlessScheduler) -> list[Any]:
    """A long decode running while a big prompt arrives that needs nearly the whole pool."""
    running = h.add(h.make_request(prompt([900, 901]), session_id="runner", max_tokens=40))
    h.step()
    big = h.add(h.make_request(prompt(list(range(500, 550))), session_id="big"))
    h.run_until_done()
    return [running, big]


def test_retain_orders_eviction_by_priority_and_never_preempts() -> None:
    # Plain vLLM first: the same workload, no hints, no plugin.
    plain = build_scheduler(HeadlessSchedulerSpec(block_size=BS, num_blocks=64))
    for session, ids in (("lo", [1, 2, 3, 4]), ("mid", [5, 6, 7, 8]), ("hi", [11, 12, 13, 14])):
        turn(plain, session, ids)
    plain_reqs = _workload(plain)
    plain_steps = plain.steps

    h = sched()
    for session, ids in (("lo", [1, 2, 3, 4]), ("mid", [5, 6, 7, 8]), ("hi", [11, 12, 13, 14])):
        turn(h, session, ids)
    for session, priority in (("lo", 10), ("mid", 50), ("hi", 90)):
        outcome = hint(h, RetainPayload(target=Target(session_id=session), priority=priority))
        assert outcome.status.value == "accepted" and outcome.applied.blocks == 4
    executor = h.connector.core.executor
    assert executor.retained_blocks == 12
    reqs = _workload(h)

    # Retention cost vLLM nothing: same steps, no preemption, everything finished.
    assert [r.num_preemptions for r in reqs] == [r.num_preemptions for r in plain_reqs] == [0, 0]
    assert all(r.is_finished() for r in reqs)
    assert h.steps - 3 == plain_steps - 3  # (the 3 warm-up turns took the same steps too)
    # The big prompt needed retained blocks: the lowest priority went first, leaf first.
    assert executor.holds.counters.released_under_pressure > 0
    assert cached_tokens(h, [11, 12, 13, 14]) == 4 * BS
    assert cached_tokens(h, [1, 2, 3, 4]) < cached_tokens(h, [11, 12, 13, 14])
    assert executor.retained_blocks + executor.holds.counters.released_under_pressure == 12


def test_retain_with_priority_zero_releases_a_session_to_plain_lru() -> None:
    h = sched()
    turn(h, "s", [1, 2, 3, 4])
    hint(h, RetainPayload(target=Target(session_id="s"), priority=70))
    assert h.connector.core.executor.retained_blocks == 4
    free_before = h.block_pool.get_num_free_blocks()
    outcome = hint(h, RetainPayload(target=Target(session_id="s"), priority=0, ttl_s=1))
    assert outcome.status.value == "accepted" and "priority 0" in outcome.reason
    assert h.connector.core.executor.retained_blocks == 0
    assert h.block_pool.get_num_free_blocks() == free_before + 4


def test_retain_with_priority_zero_by_block_hashes_releases_that_owners_hash_retains() -> None:
    """A shared prefix retained by block hashes is released the same way (the planner's
    shared-prefix Retains target hashes); a session's claim or another owner's on those
    blocks keeps them."""
    h = sched()
    turn(h, "s", [1, 2, 3, 4])
    turn(h, "t", [1, 2, 7, 8])
    executor = h.connector.core.executor
    keys = h.connector.core.index.session_blocks("s")
    assert hint(h, RetainPayload(target=Target(block_hashes=keys), priority=70)).applied.blocks == 4
    hint(h, RetainPayload(target=Target(session_id="t"), priority=40))  # blocks 1, 2, 7, 8
    hint(h, RetainPayload(target=Target(block_hashes=keys[3:]), priority=50,
                          owner=HintOwner.AGENT))
    assert executor.retained_blocks == 6
    free_before = h.block_pool.get_num_free_blocks()
    outcome = hint(h, RetainPayload(target=Target(block_hashes=keys), priority=0, ttl_s=1))
    assert (outcome.status.value, outcome.applied.blocks) == ("accepted", 0)
    assert "on 4 blocks (1 back in the free queue" in outcome.reason, outcome.reason
    # Block 3 went back; 1 and 2 stay under t's Retain, 4 under the agent's.
    assert executor.retained_blocks == 5
    assert h.block_pool.get_num_free_blocks() == free_before + 1
    assert executor.holds.counters.superseded_claims == 1  # the planner's hash Retain ended
    again = hint(h, RetainPayload(target=Target(block_hashes=keys), priority=0, ttl_s=1))
    assert "on 0 blocks" in again.reason
    done = hint(h, RetainPayload(target=Target(block_hashes=keys), priority=0, ttl_s=1,
                                 owner=HintOwner.AGENT))
    assert "on 1 blocks (1 back in the free queue" in done.reason
    assert executor.retained_blocks == 4


def test_released_session_is_evicted_before_older_untouched_sessions() -> None:
    # Plain LRU would evict "older" first (finished first); a release (Retain priority 0)
    # of "ended" puts its own blocks at the head, while the system prompt it shares with
    # "live" (blocks 1, 2) stays where LRU has it.
    h = sched()
    turn(h, "older", [40, 41, 42, 43])
    turn(h, "live", [1, 2, 30, 31])
    turn(h, "ended", [1, 2, 20, 21, 22])
    outcome = hint(h, RetainPayload(target=Target(session_id="ended"), priority=0, ttl_s=1))
    assert outcome.status.value == "accepted"
    assert "3 free blocks only this session used now go first" in outcome.reason, outcome.reason
    # The empty blocks and three more of pressure: exactly what "ended" alone gave up.
    turn(h, "new", list(range(600, 602 + empty_blocks_first(h.block_pool))))
    assert cached_tokens(h, [1, 2, 20, 21, 22]) == 2 * BS
    assert cached_tokens(h, [40, 41, 42, 43]) == 4 * BS
    assert cached_tokens(h, [1, 2, 30, 31]) == 4 * BS


def test_a_release_never_gives_up_cached_blocks_while_empty_ones_are_free() -> None:
    """Released blocks go first among the *cached* free blocks, behind those that hold
    nothing: with room left, a new request takes the empty ones and the released session
    stays cached. Before, they went to the very head of vLLM's free queue and the next
    allocation evicted them with empty blocks still free (kvhint lost hits plain LRU
    kept whenever the pool was not full)."""
    h = sched()
    turn(h, "ended", [1, 2, 3])
    outcome = hint(h, RetainPayload(target=Target(session_id="ended"), priority=0, ttl_s=1))
    assert "3 free blocks only this session used now go first" in outcome.reason
    assert empty_blocks_first(h.block_pool) > 10
    turn(h, "new", list(range(600, 608)))
    assert cached_tokens(h, [1, 2, 3]) == 3 * BS


def test_a_newer_session_hint_supersedes_the_older_one() -> None:
    h = sched(pin_budget_fraction=0.2)
    turn(h, "s", [1, 2, 3, 4])
    hint(h, PinPayload(target=Target(session_id="s"), ttl_s=60))
    hint(h, RetainPayload(target=Target(session_id="s"), priority=30))
    executor = h.connector.core.executor
    assert executor.pinned_blocks == 0 and executor.retained_blocks == 4
    assert executor.holds.counters.superseded_claims == 1


def test_an_agents_pin_outlives_the_planners_retains_and_release() -> None:
    """Owners' claims on a session are kept apart: the router's planner re-plans every
    session (a Retain each idle review, a release when it expects no return) and must not
    undo a Pin an agent runtime asked for; the agent's own release ends it."""
    h = sched(pin_budget_fraction=0.2)
    turn(h, "s", [1, 2, 3, 4])
    executor = h.connector.core.executor
    pin = hint(h, PinPayload(target=Target(session_id="s"), ttl_s=60, owner=HintOwner.AGENT))
    assert (pin.status.value, pin.applied.blocks) == ("accepted", 4)
    retain = hint(h, RetainPayload(target=Target(session_id="s"), priority=30))
    assert retain.status.value == "accepted"
    assert executor.pinned_blocks == 4 and executor.retained_blocks == 0
    release = hint(h, RetainPayload(target=Target(session_id="s"), priority=0, ttl_s=1))
    assert "0 free blocks only this session used now go first" in release.reason
    assert executor.pinned_blocks == 4
    assert executor.holds.counters.superseded_claims == 1  # the planner's retain only
    flood(h, 40)
    assert cached_tokens(h, [1, 2, 3, 4]) == 4 * BS
    # The agent's own release ends its pin; the planner's next Retain would not have.
    done = hint(h, RetainPayload(target=Target(session_id="s"), priority=0, ttl_s=1,
                                 owner=HintOwner.AGENT))
    assert done.status.value == "accepted"
    assert executor.pinned_blocks == 0 and executor.retained_blocks == 0


def test_pin_budget_and_ttl_clip() -> None:
    h = sched(pin_budget_fraction=0.1, max_pin_ttl_s=30)  # 63 blocks -> 6 pinnable
    turn(h, "s", [1, 2, 3, 4, 5, 6, 7, 8])
    outcome = hint(h, PinPayload(target=Target(session_id="s"), ttl_s=600))
    assert outcome.status.value == "clipped"
    assert outcome.requested.blocks == 8 and outcome.applied.blocks == 6
    assert "pin budget" in outcome.reason and "ttl clipped to max_pin_ttl_s=30" in outcome.reason
    # Root-most blocks are the ones kept: a prefix hit needs them.
    assert cached_tokens(h, [1, 2, 3, 4, 5, 6]) == 6 * BS
    flood(h, 40)
    assert cached_tokens(h, [1, 2, 3, 4, 5, 6, 7, 8]) == 6 * BS
    turn(h, "t", [21, 22])
    full = hint(h, PinPayload(target=Target(session_id="t"), ttl_s=10))
    assert full.status.value == "clipped" and full.applied.blocks == 0


def test_ttl_expiry_releases_blocks_at_the_next_step() -> None:
    h = sched(pin_budget_fraction=0.2)
    core = h.connector.core
    now = [1_000.0]
    core.use_clock(lambda: now[0])
    turn(h, "s", [1, 2, 3])
    free = h.block_pool.get_num_free_blocks()
    hint(h, PinPayload(target=Target(session_id="s"), ttl_s=5))
    hint(h, RetainPayload(target=Target(block_hashes=core.index.session_blocks("s")),
                          priority=40, ttl_s=8))
    assert h.block_pool.get_num_free_blocks() == free - 3
    now[0] += 6
    assert core.has_pending_work()  # has_pending_push_work keeps an idle engine stepping
    h.step()  # an empty step: build_connector_meta -> pump -> expiry
    assert core.executor.pinned_blocks == 0 and core.executor.retained_blocks == 3
    now[0] += 3
    h.step()
    assert core.executor.retained_blocks == 0 and not core.has_pending_work()
    assert h.block_pool.get_num_free_blocks() == free
    assert core.executor.holds.counters.expired_claims == 2


def test_duplicate_action_ids_answer_the_same_outcome() -> None:
    h = sched(pin_budget_fraction=0.2)
    turn(h, "s", [1, 2, 3])
    first = hint(h, PinPayload(target=Target(session_id="s"), ttl_s=60), action_id="dup")
    free = h.block_pool.get_num_free_blocks()
    second = hint(h, PinPayload(target=Target(session_id="s"), ttl_s=5), action_id="dup")
    assert second == first
    assert h.block_pool.get_num_free_blocks() == free
    assert h.connector.core.executor.counters.duplicates == 1
    assert h.connector._read_stats()["hint_duplicates"] == 1  # kvhint:hint_duplicates


def test_the_idempotency_memory_is_bounded_and_what_it_forgets_is_counted() -> None:
    """Past max_remembered_actions the oldest answered id is forgotten (a repeat of it
    is then applied again); before, uncounted."""
    h = sched(pin_budget_fraction=0.2, max_remembered_actions=2)
    turn(h, "s", [1, 2, 3])
    for action_id in ("r1", "r2", "r3"):
        hint(h, PinPayload(target=Target(session_id="s"), ttl_s=60), action_id=action_id)
    stats = h.connector._read_stats()
    assert stats["applied_ids_forgotten"] == 1  # kvhint:applied_ids_forgotten
    assert stats["hint_duplicates"] == 0
    # Every plugin counter is read, with or without NATS.
    assert set(COUNTERS) | set(LABELLED_COUNTERS) <= set(stats)


def test_latency_samples_past_the_interval_bound_are_counted() -> None:
    """Samples past MAX_LATENCY_SAMPLES in one stats interval were discarded uncounted,
    so kvhint:hint_apply_seconds undercounted without saying so."""
    h = sched()
    core = h.connector.core
    core.counters.apply_latencies_s = [0.001] * MAX_LATENCY_SAMPLES
    advice = b'{"advice_id": "d1"}'  # rejected (malformed), still timed
    core._handle(Inbound("advice", advice, time.monotonic()))
    stats = h.connector._read_stats()
    assert stats["hint_apply_samples_dropped"] == 1
    assert len(stats[LATENCY_KEY]) == MAX_LATENCY_SAMPLES
    core._handle(Inbound("advice", advice, time.monotonic()))  # a new interval: kept
    stats = h.connector._read_stats()
    assert stats["hint_apply_samples_dropped"] == 1 and len(stats[LATENCY_KEY]) == 1


def test_prefix_cache_reset_works_with_pins_held() -> None:
    h = sched(pin_budget_fraction=0.2)
    turn(h, "s", [1, 2, 3])
    hint(h, PinPayload(target=Target(session_id="s"), ttl_s=60))
    # A running request holds blocks: vLLM's own reset fails, and the pins stay.
    running = h.add(h.make_request(prompt([40, 41]), session_id="r", max_tokens=20))
    h.step()
    assert h.scheduler.reset_prefix_cache() is False
    assert h.connector.core.executor.pinned_blocks == 3
    h.run_until_done()
    assert running.is_finished()
    # Idle: the pins are all that stands in the way; they are released and the reset works.
    assert h.scheduler.reset_prefix_cache() is True
    assert h.connector.core.executor.pinned_blocks == 0
    assert h.connector._read_stats()["held_released_on_reset"] == 3
    assert cached_tokens(h, [1, 2, 3]) == 0
    turn(h, "s", [1, 2, 3])  # the step drains AllBlocksCleared into the index
    assert h.connector.core.index.session_blocks("s") == \
        h.connector.core.index.chain(h.connector.core.index.frontiers("s")[0])
    # reset_running_requests=True preempts runners, then our wrapper releases the pins.
    hint(h, PinPayload(target=Target(session_id="s"), ttl_s=60))
    h.add(h.make_request(prompt([50, 51]), session_id="r2", max_tokens=20))
    h.step()
    assert h.scheduler.reset_prefix_cache(reset_running_requests=True) is True


@pytest.mark.parametrize(("raw", "reason"), [
    (b"{not json", "malformed hints message"),
    (b'{"protocol_version": "9", "message_id": "m", "actions": '
     b'[{"action_id": "x", "action_type": "kv.pin", "action_version": "1.0", '
     b'"payload": {"target": {"session_id": "s"}}}]}', "unsupported protocol_version"),
    (b'{"protocol_version": "1", "message_id": "m", "actions": '
     b'[{"action_id": "x", "action_type": "kv.nope", "action_version": "1.0", "payload": {}}]}',
     "unsupported action_type"),
    (b'{"protocol_version": "1", "message_id": "m", "actions": '
     b'[{"action_id": "x", "action_type": "kv.retain", "action_version": "1.0", '
     b'"payload": {"target": {"session_id": "s"}, "priority": 101}}]}', "priority"),
    (b'{"protocol_version": "1", "message_id": "m", "actions": '
     b'[{"action_id": "x", "action_type": "kv.pin", "action_version": "2.0", '
     b'"payload": {"target": {"session_id": "s"}}}]}', "unsupported action_version"),
])
def test_malformed_messages_are_rejected_and_change_nothing(raw: bytes, reason: str) -> None:
    h = sched(pin_budget_fraction=0.2)
    turn(h, "s", [1, 2, 3])
    free = h.block_pool.get_num_free_blocks()
    outcomes = h.connector.core.apply_hints(raw)
    assert len(outcomes) == 1 and outcomes[0].status.value == "rejected"
    assert reason in outcomes[0].reason
    assert h.block_pool.get_num_free_blocks() == free
    # The engine keeps going.
    assert turn_hit(h, "s", [1, 2, 3, 4]) == 3 * BS


def test_one_bad_action_does_not_sink_the_others() -> None:
    h = sched(pin_budget_fraction=0.2)
    turn(h, "s", [1, 2, 3])
    raw = (b'{"protocol_version": "1", "message_id": "m", "actions": ['
           b'{"action_id": "bad", "action_type": "kv.pin", "action_version": "1.0", '
           b'"payload": {"target": {}}},'
           b'{"action_id": "good", "action_type": "kv.pin", "action_version": "1.0", '
           b'"payload": {"target": {"session_id": "s"}, "ttl_s": 30}}]}')
    bad, good = h.connector.core.apply_hints(raw)
    assert (bad.action_id, bad.status.value) == ("bad", "rejected")
    assert (good.action_id, good.status.value) == ("good", "accepted")


def test_unknown_session_and_evicted_blocks_are_missing() -> None:
    h = sched()
    assert hint(h, PinPayload(target=Target(session_id="ghost"))).status.value == "missing"
    turn(h, "s", [1, 2, 3])
    blocks = h.connector.core.index.session_blocks("s")
    flood(h, 30)
    outcome = hint(h, RetainPayload(target=Target(block_hashes=blocks), priority=50))
    assert outcome.status.value == "missing" and outcome.requested.blocks == 3
    part = hint(h, PinPayload(target=Target(session_id="s", prefix_tokens=100)))
    assert part.status.value == "missing"


def test_prefix_tokens_target_takes_whole_blocks_from_the_root() -> None:
    h = sched(pin_budget_fraction=0.2)
    turn(h, "s", [1, 2, 3, 4, 5])
    outcome = hint(h, PinPayload(target=Target(session_id="s", prefix_tokens=3 * BS + 7)))
    assert outcome.status.value == "accepted" and outcome.applied.blocks == 3
    assert outcome.applied.tokens == 3 * BS
    tiny = hint(h, PinPayload(target=Target(session_id="s", prefix_tokens=BS - 1)))
    assert tiny.status.value == "rejected" and "less than one block" in tiny.reason


def test_demote_share_and_prefetch_answer_honestly_on_the_cpu_backend() -> None:
    h = sched()
    core = h.connector.core
    now = [1_000.0]
    core.use_clock(lambda: now[0])
    turn(h, "s", [1, 2, 3])
    free = h.block_pool.get_num_free_blocks()
    demote = hint(h, DemotePayload(target=Target(session_id="s")))
    assert demote.status.value == "rejected" and "no host tier" in demote.reason
    share = hint(h, SharePayload(target=Target(session_id="s"), destination_worker="w1"))
    assert share.status.value == "rejected" and "nothing changed" in share.reason
    assert h.block_pool.get_num_free_blocks() == free
    assert "kv.demote" not in core.supported_actions() and "kv.share" not in core.supported_actions()
    # Prefetch of resident blocks: nothing to load, kept resident until the deadline.
    ready = hint(h, PrefetchPayload(target=Target(session_id="s"), deadline_s=5))
    assert ready.status.value == "accepted" and core.executor.retained_blocks == 3
    # Prefetch of blocks that are gone: deferred at once, final when they come back.
    turn(h, "t", [7, 8])
    gone = core.index.session_blocks("t")
    flood(h, 30)
    deferred = hint(h, PrefetchPayload(target=Target(block_hashes=gone), deadline_s=5),
                    action_id="pf")
    assert deferred.status.value == "deferred" and "no host tier" in deferred.reason
    turn(h, "t", [7, 8])  # a request recomputes them; the step settles the prefetch
    # No mailbox to post it to: the step's outcome waits for an in-process advance().
    (by_step,) = core.advance()
    assert (by_step.action_id, by_step.status.value) == ("pf", "accepted")
    settled = hint(h, PrefetchPayload(target=Target(block_hashes=gone)), action_id="pf")
    assert settled == by_step and settled.applied.blocks == 2
    # Another one that never comes back ends at its deadline.
    late = hint(h, PrefetchPayload(target=Target(block_hashes=[123456789]), deadline_s=2),
                action_id="pf2")
    assert late.status.value == "deferred"
    now[0] += 3
    (final,) = core.advance()
    assert (final.action_id, final.status.value) == ("pf2", "missing")
    assert hint(h, PrefetchPayload(target=Target(block_hashes=[1])), action_id="pf2") == final


def test_prefetches_wait_within_the_prefetch_budget_and_the_excess_is_clipped() -> None:
    """Deferred Prefetches are re-checked every step until their deadline; before, any
    number could wait (an unbounded amount of prefetch work per worker). Now they wait
    for at most ``prefetch_budget_fraction`` of the blocks: one past it waits for its
    root-most blocks that fit and ends ``clipped``; with no room it is answered at once."""
    h = sched(prefetch_budget_fraction=0.1)  # 63 blocks: 6 may wait
    core = h.connector.core
    executor = core.executor
    now = [1_000.0]
    core.use_clock(lambda: now[0])
    turn(h, "s", [1, 2, 3])
    resident = core.index.session_blocks("s")

    def prefetch(action_id: str, keys: list[int]) -> HintOutcome:
        return hint(h, PrefetchPayload(target=Target(block_hashes=keys), deadline_s=5),
                    action_id=action_id)

    first = prefetch("pf1", [901, 902, 903, 904, 905])
    assert first.status.value == "deferred" and "budget" not in first.reason
    part = prefetch("pf2", [resident[0], 911, 912])  # 1 of 3 fits: waits for the root
    assert part.status.value == "deferred" and "prefetch budget: 1 of 3" in part.reason
    full = prefetch("pf3", [*resident, 921, 922])  # no room: settled at once
    assert (full.status.value, full.applied.blocks) == ("clipped", 3)
    assert "prefetch budget: 0 of 5" in full.reason
    assert executor.retained_blocks == 3  # what is in G1 is kept until the deadline
    assert executor.max_prefetch_blocks == 6
    none = prefetch("pf4", [931, 932])
    assert (none.status.value, none.applied.blocks) == ("clipped", 0)
    assert executor.counters.prefetch_clipped_blocks == 2 + 2 + 2
    assert h.connector._read_stats()["prefetch_clipped_blocks"] == 6
    assert executor.pending_actions == 2
    (settled,) = core.advance()  # pf2's one block is in G1
    assert (settled.action_id, settled.status.value, settled.applied.blocks) == (
        "pf2", "clipped", 1)
    assert "prefetch budget" in settled.reason
    now[0] += 6
    (ended,) = core.advance()
    assert (ended.action_id, ended.status.value) == ("pf1", "missing")
    again = prefetch("pf5", [941, 942])  # the budget is free again
    assert again.status.value == "deferred" and "budget" not in again.reason


def test_expired_hints_are_rejected() -> None:
    h = sched()
    core = h.connector.core
    core.use_clock(lambda: 5_000.0)
    turn(h, "s", [1, 2])
    outcome = hint(h, PinPayload(target=Target(session_id="s"), expires_at=4_999.0))
    assert outcome.status.value == "rejected" and "expired" in outcome.reason


def test_a_plugin_bug_is_counted_and_never_stops_the_engine(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Injected fault (a bug cannot be caused on purpose otherwise): every index update
    and every step's pump raise; vLLM still serves, exactly as without the plugin."""
    h = sched()
    core = h.connector.core

    def broken(*_: Any) -> None:
        raise RuntimeError("injected")

    monkeypatch.setattr(core.index, "apply", broken)
    monkeypatch.setattr(core, "pump", broken)
    turn(h, "s", [1, 2, 3])
    assert turn_hit(h, "s", [1, 2, 3, 4]) == 3 * BS
    assert core.counters.internal_errors >= 3


def test_evict_rest_first_gives_up_what_the_next_turn_will_not_read() -> None:
    """Session "s" went [1, 2, 10, 11] then [1, 2, 20, 21, 22]: blocks 10 and 11 are a
    branch its next turn will not read. A Retain of the current prompt with
    ``evict_rest_first`` (action version 1.1) puts that branch at the head of the eviction
    order, so pressure takes it instead of the older session LRU would give up."""

    def run(evict_rest_first: bool) -> tuple[HintOutcome, int, int, int]:
        h = sched()
        turn(h, "older", [40, 41, 42, 43])
        turn(h, "s", [1, 2, 10, 11])
        turn(h, "s", [1, 2, 20, 21, 22])
        outcome = hint(h, RetainPayload(target=Target(session_id="s", prefix_tokens=5 * BS),
                                        priority=60, evict_rest_first=evict_rest_first))
        # The free blocks never used go first; five fewer than all free ones reach two
        # cached blocks at the head of the LRU order.
        turn(h, "new", list(range(600, 600 + h.block_pool.get_num_free_blocks() - 5)))
        return (outcome, cached_tokens(h, [40, 41, 42, 43]), cached_tokens(h, [1, 2, 10, 11]),
                cached_tokens(h, [1, 2, 20, 21, 22]))

    outcome, older, branch, current = run(evict_rest_first=True)
    assert outcome.status.value == "accepted", outcome.reason
    assert "2 free blocks of the session past the target go first" in outcome.reason
    assert (older, branch, current) == (4 * BS, 2 * BS, 5 * BS)
    # Control: the same Retain without it (version 1.0) leaves LRU to take "older"'s leaves.
    outcome, older, branch, current = run(evict_rest_first=False)
    assert outcome.status.value == "accepted" and outcome.reason == ""
    assert (older, branch, current) == (2 * BS, 4 * BS, 5 * BS)
