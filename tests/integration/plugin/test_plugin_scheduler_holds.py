"""Retained holds against vLLM's real Scheduler and block pool (no model): the retain
budget displaces lower priorities, memory pressure relieves them (passing over blocks a
running request uses), re-prioritising stays bounded, and every block a hold loses
without the router asking is reported to it with what the hold still has.
"""

from __future__ import annotations

from scheduler_fixtures import BS, hint, prompt, sched, turn

from kvhint.engine_plugin.headless import HeadlessScheduler
from kvhint.schemas import DonorAdvice, PinPayload, RetainPayload, Target, encode_advice


def test_retain_budget_displaces_lower_priority() -> None:
    h = sched(retain_budget_fraction=0.1)  # 6 blocks
    turn(h, "lo", [1, 2, 3, 4])
    turn(h, "hi", [5, 6, 7, 8])
    hint(h, RetainPayload(target=Target(session_id="lo"), priority=10))
    outcome = hint(h, RetainPayload(target=Target(session_id="hi"), priority=90))
    assert outcome.status.value == "accepted" and outcome.applied.blocks == 4
    executor = h.connector.core.executor
    assert executor.retained_blocks == 6 and executor.holds.counters.displaced == 2
    low = hint(h, RetainPayload(target=Target(block_hashes=[1 << 40]), priority=5))
    assert low.status.value == "missing"


def _held_blocks(h: HeadlessScheduler, session: str) -> int:
    core = h.connector.core
    retained = set(core.executor.holds.keys()["retained"])
    return len(retained.intersection(core.index.session_blocks(session)))


def test_a_raised_retain_priority_is_what_displacement_and_pressure_see() -> None:
    # "back" is retained at 10, then (its next turn done) re-retained at 90: the new claim
    # supersedes the old one, and the old claim's place in the displacement order must go
    # with it. "mid" (50) is then the lowest priority held, so it goes first, both when a
    # higher retain needs budget and when the engine needs memory.
    h = sched(retain_budget_fraction=0.15)  # 9 blocks
    turn(h, "back", [1, 2, 3, 4])
    turn(h, "mid", [5, 6, 7, 8])
    turn(h, "top", [21, 22, 23])
    hint(h, RetainPayload(target=Target(session_id="back"), priority=10))
    hint(h, RetainPayload(target=Target(session_id="back"), priority=90))
    hint(h, RetainPayload(target=Target(session_id="mid"), priority=50))
    executor = h.connector.core.executor
    assert executor.retained_blocks == 8
    outcome = hint(h, RetainPayload(target=Target(session_id="top"), priority=95))
    assert outcome.status.value == "accepted" and executor.holds.counters.displaced == 2
    assert [_held_blocks(h, s) for s in ("back", "mid", "top")] == [4, 2, 3]
    # Memory pressure: a prompt needing every free block and 3 more relieves the 2 blocks
    # "mid" still holds before any block of "back" (whose leaf then goes first).
    turn(h, "big", list(range(600, 600 + h.block_pool.get_num_free_blocks() + 2)))
    assert executor.holds.counters.released_under_pressure == 3
    assert [_held_blocks(h, s) for s in ("back", "mid", "top")] == [3, 0, 3]


def test_pressure_passes_over_retained_blocks_a_running_request_uses() -> None:
    # "lo" holds the lowest retain priority, but its next turn is running and reads its
    # blocks: dropping those holds would free nothing and leave the session unprotected
    # once the turn ends. Relief drops "mid" instead (leaf first) and keeps "lo".
    h = sched(retain_budget_fraction=0.5)
    turn(h, "lo", [1, 2, 3, 4])
    turn(h, "mid", [5, 6, 7, 8])
    hint(h, RetainPayload(target=Target(session_id="lo"), priority=10))
    hint(h, RetainPayload(target=Target(session_id="mid"), priority=50))
    executor = h.connector.core.executor
    runner = h.add(h.make_request(prompt([1, 2, 3, 4, 9]), session_id="lo", max_tokens=40))
    h.step()
    assert not runner.is_finished()
    turn(h, "big", list(range(600, 600 + h.block_pool.get_num_free_blocks() + 2)))
    assert executor.holds.counters.released_under_pressure == 3
    assert executor.holds.counters.kept_in_use_under_pressure == 4
    assert [_held_blocks(h, s) for s in ("lo", "mid")] == [4, 1]
    assert runner.num_preemptions == 0


def test_re_prioritising_forever_keeps_the_holds_bounded_and_ordered() -> None:
    # A router re-sends a session's retain at every idle review; each re-send leaves stale
    # heap entries behind. They must not pile up (a worker runs for weeks), and the order
    # must survive the rebuilds that clear them.
    h = sched(retain_budget_fraction=0.15)  # 9 blocks
    turn(h, "idle", [1, 2, 3, 4])
    turn(h, "other", [5, 6, 7, 8])
    executor = h.connector.core.executor
    for i in range(1500):
        hint(h, RetainPayload(target=Target(session_id="idle"), priority=20 + i % 70))
        hint(h, RetainPayload(target=Target(session_id="other"), priority=90 - i % 70))
    assert executor.holds.heap_entries <= 2 * (8 + 2) + 2 * 1024 + 2  # not ~15,000
    hint(h, RetainPayload(target=Target(session_id="idle"), priority=60))
    hint(h, RetainPayload(target=Target(session_id="other"), priority=30))
    turn(h, "top", [21, 22, 23])
    hint(h, RetainPayload(target=Target(session_id="top"), priority=95))
    assert [_held_blocks(h, s) for s in ("idle", "other", "top")] == [4, 2, 3]


def _releases(h: HeadlessScheduler) -> dict[tuple[str, str], tuple[str | None, int, int]]:
    """(action id, reason) -> (session, blocks released, blocks still held) reported since
    the last call (a plugin connected to NATS queues them at each step, else they wait)."""
    core = h.connector.core
    messages = list(core.mailbox.releases) if core.mailbox is not None else []
    if core.mailbox is not None:
        core.mailbox.releases.clear()
    if (taken := core.take_releases()) is not None:
        messages.append(taken)
    out = {}
    for message in messages:
        assert message.worker_id == "w0"
        for r in message.releases:
            assert r.released.tokens == r.released.blocks * BS
            assert r.action_type == ("kv.pin" if r.action_id.startswith("pin") else "kv.retain")
            out[(r.action_id, r.reason.value)] = (r.session_id, r.released.blocks,
                                                  r.held.blocks)
    return out


def test_blocks_a_hold_loses_unasked_are_reported_once_with_what_is_left() -> None:
    # The router keeps what each session's Pin/Retain holds, and each worker's and
    # tenant's budget, from outcomes; a hold that later loses blocks without the router
    # asking must be reported, or the router believes them protected and counted.
    h = sched(retain_budget_fraction=0.15, pin_budget_fraction=0.1)  # 9 retained, 6 pinned
    turn(h, "back", [1, 2, 3, 4])
    turn(h, "mid", [5, 6, 7, 8])
    turn(h, "top", [21, 22, 23])
    turn(h, "pinned", [31, 32])
    hint(h, RetainPayload(target=Target(session_id="back"), priority=10), "back-1")
    hint(h, RetainPayload(target=Target(session_id="back"), priority=90), "back-2")
    hint(h, RetainPayload(target=Target(session_id="mid"), priority=50), "mid-1")
    hint(h, PinPayload(target=Target(session_id="pinned"), ttl_s=60), "pin-1")
    assert _releases(h) == {}  # a superseded claim is the router's own doing
    hint(h, RetainPayload(target=Target(session_id="top"), priority=95), "top-1")
    assert _releases(h) == {("mid-1", "displaced"): ("mid", 2, 2)}
    assert _releases(h) == {}
    turn(h, "big", list(range(600, 600 + h.block_pool.get_num_free_blocks() + 2)))
    assert _releases(h) == {("mid-1", "pressure"): ("mid", 2, 0),
                            ("back-2", "pressure"): ("back", 1, 3)}
    # Idle, the plugin gives every hold back for a prefix-cache reset; pins included.
    assert h.scheduler.reset_prefix_cache() is True
    assert _releases(h) == {("back-2", "reset"): ("back", 3, 0),
                            ("top-1", "reset"): ("top", 3, 0),
                            ("pin-1", "reset"): ("pinned", 2, 0)}


def test_a_claim_under_an_id_already_claimed_replaces_it_and_still_expires() -> None:
    """Ids are meant to be unique, and the executor answers a repeat from memory; but a
    repeat it no longer remembers made a second claim under the same id. The first claim's holds then had no claim behind them: no
    expiry ever ended them, and they used the pin budget for good."""
    h = sched(max_remembered_actions=1)
    core = h.connector.core
    now = [1_000.0]
    core.use_clock(lambda: now[0])
    executor = core.executor
    turn(h, "s", [1, 2, 3, 4])
    turn(h, "t", [5, 6])
    assert hint(h, PinPayload(target=Target(session_id="s"), ttl_s=10), "x").status.value \
        == "accepted"
    hint(h, RetainPayload(target=Target(session_id="t"), priority=50, ttl_s=10), "other")
    # "x" again, forgotten by the duplicate memory: a Pin of t's blocks this time.
    again = hint(h, PinPayload(target=Target(session_id="t"), ttl_s=10), "x")
    assert (again.status.value, again.applied.blocks) == ("accepted", 2)
    assert executor.pinned_blocks == 2
    # A donor advice under the same id has a claim of its own (DonorClaim): the Pin stays
    # (test_plugin_donor_claim_keys.py; before, the advice replaced it).
    advice = DonorAdvice(advice_id="x", session_id="u", namespace=core.cache_namespace,
                         donor_block_hashes=core.index.session_blocks("s")[:1],
                         similarity=0.9, ttl_s=5, at=now[0])
    assert core.apply_advice(encode_advice(advice)).status.value == "accepted"
    assert (executor.pinned_blocks, executor.retained_blocks) == (2, 1)  # t pinned; s[0]
    now[0] += 4_000
    core.advance()
    assert (executor.pinned_blocks, executor.retained_blocks) == (0, 0)
    assert executor.next_deadline() is None
    empty = DonorAdvice(advice_id="", session_id="u", namespace=core.cache_namespace,
                        donor_block_hashes=[1], similarity=0.9, at=now[0])
    rejected = core.apply_advice(encode_advice(empty))
    assert rejected.status.value == "rejected" and "advice_id is empty" in rejected.reason


def test_a_pin_ending_under_a_retain_keeps_the_retain_budget() -> None:
    """A retain charges its budget only for blocks not held already, so blocks both pinned
    and retained were not counted; when the pin ended they became retained beyond
    max_retained_blocks. The excess is now displaced, lowest priority first, and
    reported."""
    h = sched(retain_budget_fraction=0.1)  # 6 blocks
    core = h.connector.core
    now = [1_000.0]
    core.use_clock(lambda: now[0])
    executor = core.executor
    turn(h, "a", [1, 2, 3, 4])
    turn(h, "b", [5, 6, 7, 8, 9, 10])
    a_blocks = core.index.session_blocks("a")
    hint(h, PinPayload(target=Target(block_hashes=a_blocks), ttl_s=10), "pin-a")
    hint(h, RetainPayload(target=Target(block_hashes=a_blocks), priority=50, ttl_s=100),
         "retain-a")
    hint(h, RetainPayload(target=Target(session_id="b"), priority=80, ttl_s=100), "retain-b")
    assert (executor.pinned_blocks, executor.retained_blocks) == (4, 6)
    now[0] += 20
    core.advance()
    assert (executor.pinned_blocks, executor.retained_blocks) == (0, 6)
    assert _held_blocks(h, "b") == 6  # the higher priority kept
    assert _releases(h) == {("retain-a", "displaced"): (None, 4, 0)}


def test_holds_on_blocks_vllm_drops_from_its_cache_are_given_back_and_reported() -> None:
    """vLLM's ``evict_blocks`` (after a failed KV load) drops blocks from the prefix cache
    even while they are referenced, so a held block can stop caching anything. Before,
    the plugin kept holding it until the claim's TTL: a ghost that used the pin or retain
    budget and the block's memory, and that the router still counted as protected. The
    release's reason is ``gone`` (HoldsReleased 1.1): it was ``reset``, which told the
    router and its operators that vLLM had reset its prefix cache."""
    h = sched(pin_budget_fraction=0.1)  # 6 pinned
    core = h.connector.core
    executor = core.executor
    turn(h, "s", [1, 2, 3])
    turn(h, "t", [4, 5])
    assert hint(h, PinPayload(target=Target(session_id="s"), ttl_s=60), "pin-s").applied.blocks == 3
    assert hint(h, RetainPayload(target=Target(session_id="t"), priority=50), "ret-t"
                ).applied.blocks == 2
    s_keys, t_keys = core.index.session_blocks("s"), core.index.session_blocks("t")
    lookup = core.adapter.lookup
    gone = {lookup(s_keys[1]).block_id, lookup(s_keys[2]).block_id, lookup(t_keys[1]).block_id}
    free = h.block_pool.get_num_free_blocks()
    h.kv_cache_manager.evict_blocks(gone)
    h.step()  # the step drains the BlockRemoved events
    assert (executor.pinned_blocks, executor.retained_blocks) == (1, 1)
    assert executor.holds.counters.released_gone == 3
    assert h.connector._read_stats()["held_blocks_gone"] == 3  # kvhint:held_blocks_gone
    assert h.block_pool.get_num_free_blocks() == free + 3  # the memory is back too
    assert _releases(h) == {("pin-s", "gone"): ("s", 2, 1), ("ret-t", "gone"): ("t", 1, 1)}
    # The pin budget is free again for blocks that exist.
    turn(h, "u", [7, 8, 9, 10, 11])
    assert hint(h, PinPayload(target=Target(session_id="u"), ttl_s=60), "pin-u"
                ).applied.blocks == 5
    # A hold whose block is still cached keeps it when another copy's hash is removed.
    assert executor.holds.release_gone(s_keys[:1]) == 0 and executor.pinned_blocks == 6
    # Holds found without their blocks after an AllBlocksCleared (every hold checked) were
    # lost to a prefix-cache reset, one the plugin did not release for first: ``reset``.
    u_keys = core.index.session_blocks("u")
    h.kv_cache_manager.evict_blocks({lookup(k).block_id for k in u_keys[3:]})
    assert executor.holds.release_gone(None) == 2 and executor.pinned_blocks == 4
    assert executor.holds.counters.released_gone == 5
    assert _releases(h) == {("pin-u", "reset"): ("u", 2, 3)}
