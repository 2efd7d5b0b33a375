"""Demote against vLLM's real OffloadingConnector, beside the plugin in a MultiConnector.

vLLM's real Scheduler, KVCacheManager, MultiConnector and OffloadingConnector (scheduler
side, with its CPUOffloadingManager) are built exactly as a CUDA server configures them;
the plugin finds the offloading connector itself at bind time. Only the offloading worker
is stood in for (``HeadlessScheduler`` reports its copy jobs done, or holds them in
flight): vLLM's copies use CUDA streams and its CPU offloading worker refuses to start on
the CPU backend.
"""

from __future__ import annotations

import itertools
from typing import Any

from scheduler_fixtures import empty_blocks_first, plugin_log_lines

from kvhint.engine_plugin.headless import (
    HeadlessScheduler,
    HeadlessSchedulerSpec,
    build_scheduler,
    tokens_for_block_ids,
)
from kvhint.schemas import (
    DemotePayload,
    HintOutcome,
    HintOwner,
    KvHintsEnvelope,
    PinPayload,
    PrefetchPayload,
    RetainPayload,
    Target,
    encode_hints,
    make_action,
)

BS = 32
_ids = itertools.count(1)


def sched(host_blocks: int = 40, **extra: Any) -> HeadlessScheduler:
    return build_scheduler(HeadlessSchedulerSpec(
        block_size=BS, num_blocks=64, connector_module="kvhint.engine_plugin.connector",
        connector_extra_config={"worker_id": "w0", **extra}, host_blocks=host_blocks))


def plugin(h: HeadlessScheduler) -> Any:
    return next(c for c in h.connector.sub_connectors if hasattr(c, "core"))


def prompt(block_ids: list[int]) -> list[int]:
    return tokens_for_block_ids(block_ids, BS) + [3] * 5


def turn(h: HeadlessScheduler, session: str | None, block_ids: list[int]) -> int:
    """Run a turn; return the prompt tokens the model had to compute for it."""
    request = h.add(h.make_request(prompt(block_ids), session_id=session))
    computed = 0
    # Until the request finishes (its blocks stay allocated while its copies are in flight).
    while not request.is_finished():
        prefilling = request.num_output_tokens == 0
        out, _ = h.step()
        if prefilling:
            computed += out.num_scheduled_tokens.get(request.request_id, 0)
    return computed


def hint(h: HeadlessScheduler, payload: Any, action_id: str | None = None) -> HintOutcome:
    action_id = action_id or f"a{next(_ids)}"
    envelope = KvHintsEnvelope(protocol_version="1", message_id=f"m-{action_id}",
                               actions=[make_action(action_id, payload)])
    (outcome,) = plugin(h).core.apply_hints(encode_hints(envelope))
    return outcome


def g1_tokens(h: HeadlessScheduler, block_ids: list[int]) -> int:
    _, hit, _ = h.kv_cache_manager.get_computed_blocks(h.make_request(prompt(block_ids)))
    return hit


def test_the_plugin_finds_vllms_offloading_connector_and_offers_demote() -> None:
    with plugin_log_lines() as lines:
        h = sched()
        core = plugin(h).core
        assert core.executor.host_tier is not None
        assert "kv.demote" in core.supported_actions()
        assert any("host tier: vLLM's OffloadingConnector" in line for line in lines)
        # Without the offloading connector the same plugin has none, and says why.
        plain = build_scheduler(HeadlessSchedulerSpec(
            block_size=BS, num_blocks=64, connector_module="kvhint.engine_plugin.connector",
            connector_extra_config={"worker_id": "w0"}))
    assert plain.connector.core.executor.host_tier is None
    assert "kv.demote" not in plain.connector.core.supported_actions()
    assert any("no host tier (no KV connector with an offloading manager" in line
               for line in lines)


def test_demote_lets_the_gpu_copy_go_first_and_the_next_turn_loads_from_the_host() -> None:
    h = sched()
    assert turn(h, "old", [1, 2, 3, 4]) == 4 * BS + 5
    assert turn(h, "new", [5, 6, 7, 8]) == 4 * BS + 5
    hint(h, RetainPayload(target=Target(session_id="new"), priority=50))
    outcome = hint(h, DemotePayload(target=Target(session_id="new")))
    assert (outcome.status.value, outcome.applied.blocks) == ("accepted", 4)
    assert plugin(h).core.executor.retained_blocks == 0  # the demote superseded the retain
    # One more request takes its blocks from the head of the free queue, past the empty
    # ones: the demoted (most recent) session goes before the older one, which plain LRU
    # would evict first.
    turn(h, None, list(range(100, 103 + empty_blocks_first(h.block_pool))))
    assert g1_tokens(h, [5, 6, 7, 8]) == 0
    assert g1_tokens(h, [1, 2, 3, 4]) == 4 * BS
    # The demoted session is still served from vLLM's host tier: its next turn computes
    # only the tail, not the four demoted blocks.
    assert turn(h, "new", [5, 6, 7, 8, 9]) == BS + 5


def test_a_planners_demote_spares_what_an_agent_holds_and_an_agents_demote_does_not(
        ) -> None:
    h = sched()
    turn(h, "s", [1, 2, 3, 4])
    core = plugin(h).core
    keys = core.index.session_blocks("s")
    hint(h, PinPayload(target=Target(session_id="s", prefix_tokens=2 * BS), ttl_s=60,
                       owner=HintOwner.AGENT))
    hint(h, RetainPayload(target=Target(session_id="s"), priority=50))
    # The planner demotes the session as its response ends: the agent pinned the first
    # two blocks, and they stay in G1, pinned; only the other two let their GPU copy go.
    outcome = hint(h, DemotePayload(target=Target(session_id="s")))
    assert (outcome.status.value, outcome.applied.blocks) == ("clipped", 2)
    assert "2 blocks other claims hold stay in G1" in outcome.reason
    assert core.executor.pinned_blocks == 2 and core.executor.retained_blocks == 0
    assert [core.executor.holds.is_held(core.executor.cache.lookup(k).block_id)
            for k in keys] == [True, True, False, False]
    # The agent retains the whole session, then demotes it itself: the agent knows best,
    # so its Demote also supersedes the planner's claims, and everything goes.
    hint(h, RetainPayload(target=Target(session_id="s"), priority=50))
    outcome = hint(h, DemotePayload(target=Target(session_id="s"), owner=HintOwner.AGENT))
    assert (outcome.status.value, outcome.applied.blocks) == ("accepted", 4)
    assert core.executor.pinned_blocks == 0 and core.executor.retained_blocks == 0


def test_a_sessions_demote_leaves_the_blocks_another_session_retains_in_g1() -> None:
    """Two sessions share a prefix; B retains its chain, then A's planner demotes A. The
    shared blocks are B's too: they stay in G1, retained for B, and only A's own blocks
    go. Before, the Demote dropped B's retain on the shared blocks without telling the
    router, and B's next turn found no prefix in G1."""
    h = sched()
    core = plugin(h).core
    turn(h, "A", [1, 2, 3, 4])
    turn(h, "B", [1, 2, 5, 6])
    hint(h, RetainPayload(target=Target(session_id="B"), priority=90), "b-retain")
    outcome = hint(h, DemotePayload(target=Target(session_id="A")))
    assert (outcome.status.value, outcome.applied.blocks) == ("clipped", 2), outcome.reason
    assert "2 blocks other claims hold stay in G1" in outcome.reason
    executor = core.executor
    assert [executor.holds.is_held(executor.cache.lookup(k).block_id)
            for k in core.index.session_blocks("B")] == [True, True, True, True]
    assert executor.retained_blocks == 4 and core.take_releases() is None
    turn(h, None, [100, 101, 102, 103])
    assert g1_tokens(h, [1, 2, 5, 6]) == 4 * BS
    # A session made only of B's retained blocks has nothing of its own to demote: the
    # Demote is clipped to nothing, not rejected (rejections in a row make the router
    # stop sending Demotes to this worker).
    turn(h, "C", [1, 2])
    nothing = hint(h, DemotePayload(target=Target(session_id="C")))
    assert (nothing.status.value, nothing.applied.blocks) == ("clipped", 0), nothing.reason


def test_a_demote_waits_for_copies_in_flight_then_lets_go() -> None:
    """vLLM's connector copies a request's blocks to the host asynchronously; a Demote
    planned as the response ends can arrive before the last copies finish (on a GPU
    server; here the copy reports are held back). It waits (``deferred``) and goes
    through once they finish, instead of being refused."""
    h = sched()
    core = plugin(h).core
    now = [1000.0]
    core.use_clock(lambda: now[0])
    turn(h, "s", [1, 2])
    h.complete_offloads = False  # the copies of blocks 3 and 4 stay in flight
    turn(h, "s", [1, 2, 3, 4])
    keys = core.index.session_blocks("s")
    assert [core.executor.host_tier.copying(k) for k in keys] == [False, False, True, True]
    outcome = hint(h, DemotePayload(target=Target(session_id="s")))
    assert outcome.status.value == "deferred"
    assert "2 of 4 resident blocks have a host copy vLLM's connector is still making" \
        in outcome.reason
    assert core.executor.pending_actions == 1
    now[0] += 0.5
    h.step()
    assert core.advance() == []  # still in flight
    h.complete_offloads = True
    now[0] += 0.5
    h.step()  # the worker reports the copies done; the plugin's step hook settles it
    (done,) = core.advance()
    assert (done.action_id, done.status.value, done.applied.blocks) == (
        outcome.action_id, "accepted", 4)
    assert core.executor.pending_actions == 0
    # It let the GPU copies go first, as any Demote (past the empty blocks).
    turn(h, None, list(range(100, 103 + empty_blocks_first(h.block_pool))))
    assert g1_tokens(h, [1, 2, 3, 4]) == 0
    assert turn(h, "s", [1, 2, 3, 4, 9]) == BS + 5  # served from the host tier


def test_a_waiting_demote_ends_at_its_deadline_or_when_superseded() -> None:
    h = sched()
    core = plugin(h).core
    now = [1000.0]
    core.use_clock(lambda: now[0])
    turn(h, "s", [1, 2])
    h.complete_offloads = False
    turn(h, "s", [1, 2, 3, 4])
    turn(h, "t", [5, 6, 7, 8])
    assert hint(h, DemotePayload(target=Target(session_id="s"))).status.value == "deferred"
    waiting = hint(h, DemotePayload(target=Target(session_id="t")), action_id="t-demote")
    assert waiting.status.value == "deferred"
    # The session's next protection (its next turn came) ends the waiting Demote of "t"
    # unapplied: applied later it would undo the newer hint.
    hint(h, RetainPayload(target=Target(session_id="t"), priority=50), action_id="t-retain")
    (superseded,) = core.advance()
    assert (superseded.action_id, superseded.status.value) == ("t-demote", "rejected")
    assert "superseded by t-retain" in superseded.reason
    assert core.executor.retained_blocks == 4
    # The copies of "s" never finish: at the deadline it does what it can. Blocks 1-2
    # have copies, but demoting them would strand 3-4 in G1 behind a recompute (vLLM
    # continues a G1 prefix from the host, never the other way): none go.
    now[0] += 2.5
    (late,) = core.advance()
    assert late.status.value == "rejected"
    assert "0 of 4 resident blocks demoted" in late.reason
    turn(h, None, [100, 101, 102, 103])
    assert g1_tokens(h, [1, 2, 3, 4]) == 4 * BS


def test_a_repeated_demote_never_postpones_the_waiting_ones_deadline() -> None:
    """A Demote waits for host copies at most demote_copy_wait_s (2 s) from when it
    came. Before, a repeat re-set that wait: the same id once the idempotency memory
    (max_remembered_actions) had forgotten it replaced the waiting copy, and a new id
    for the same target superseded it with a wait of its own, so a sender re-sending
    its Demote kept it waiting for good. Now the forgotten repeat is a duplicate (its
    first outcome again) and a new id for the same target keeps the first deadline."""
    h = sched(max_remembered_actions=1)
    core = plugin(h).core
    now = [1000.0]
    core.use_clock(lambda: now[0])
    turn(h, "s", [1, 2])
    h.complete_offloads = False  # the copies of blocks 3 and 4 never finish
    turn(h, "s", [1, 2, 3, 4])
    demote = DemotePayload(target=Target(session_id="s"))
    first = hint(h, demote, action_id="d1")
    assert first.status.value == "deferred"
    now[0] += 1.5
    hint(h, PinPayload(target=Target(block_hashes=[12345]), ttl_s=5))  # d1 forgotten
    assert core.executor.counters.remembered_forgotten == 1
    assert hint(h, demote, action_id="d1") == first
    assert core.executor.pending_actions == 1
    now[0] += 0.6  # 2.1 s after d1 came
    (late,) = core.advance()
    assert (late.action_id, late.status.value) == ("d1", "rejected"), late.reason
    assert core.executor.pending_actions == 0
    # A new id for the same target while one waits: it takes the place of the waiting
    # one (superseded) but not a wait of its own.
    assert hint(h, demote, action_id="d2").status.value == "deferred"
    now[0] += 1.5
    again = hint(h, demote, action_id="d3")
    assert again.status.value == "deferred" and "waiting up to 0.5s" in again.reason
    (superseded,) = core.advance()
    assert (superseded.action_id, superseded.status.value) == ("d2", "rejected")
    now[0] += 0.6  # 2.1 s after d2 came
    (late,) = core.advance()
    assert (late.action_id, late.status.value) == ("d3", "rejected"), late.reason
    assert "0 of 4 resident blocks demoted" in late.reason


def test_demote_keeps_the_part_above_a_block_the_host_tier_lost() -> None:
    h = sched(host_blocks=6)
    turn(h, "s", [1, 2, 3, 4])
    core = plugin(h).core
    keys = core.index.session_blocks("s")
    assert [core.executor.host_tier.contains(k) for k in keys] == [True] * 4
    # Another request's copies push the session's two oldest copies out of the host LRU;
    # the plugin's index hears it from vLLM's offloading events.
    turn(h, None, [300, 301, 302, 303])
    assert [core.executor.host_tier.contains(k) for k in keys] == [False, False, True, True]
    assert [core.index.is_resident(k, "CPU") for k in keys] == [False, False, True, True]
    outcome = hint(h, DemotePayload(target=Target(session_id="s")))
    assert (outcome.status.value, outcome.applied.blocks) == ("clipped", 2)
    # Takes the empty blocks, then the two demoted ones off the head of the queue.
    turn(h, None, list(range(400, 401 + empty_blocks_first(h.block_pool))))
    assert g1_tokens(h, [1, 2, 3, 4]) == 2 * BS
    # G1 serves blocks 1-2 and the host tier 3-4: nothing of the session is recomputed.
    assert turn(h, "s", [1, 2, 3, 4, 5]) == BS + 5


def test_prefetch_of_a_demoted_session_waits_for_its_request_then_succeeds() -> None:
    h = sched()
    turn(h, "s", [1, 2, 3])
    assert hint(h, DemotePayload(target=Target(session_id="s"))).status.value == "accepted"
    turn(h, None, list(range(100, 102 + empty_blocks_first(h.block_pool))))
    core = plugin(h).core
    assert core.index.has_session("s")  # its blocks are resident in G2 only
    assert not any(core.index.is_resident(k) for k in core.index.session_blocks("s"))
    payload = PrefetchPayload(target=Target(session_id="s"), deadline_s=30)
    outcome = hint(h, payload, "prefetch-1")
    assert outcome.status.value == "deferred"
    assert "3 in the host tier" in outcome.reason
    # vLLM loads from the host tier only for a request: the session's next turn does it,
    # and the prefetch completes.
    assert turn(h, "s", [1, 2, 3, 4]) == BS + 5
    assert hint(h, payload, "prefetch-1").status.value == "accepted"
