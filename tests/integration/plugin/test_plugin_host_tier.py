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
import logging
from typing import Any

from kvhint.engine_plugin.config import LOGGER_NAME
from kvhint.engine_plugin.headless import (
    HeadlessScheduler,
    HeadlessSchedulerSpec,
    build_scheduler,
    tokens_for_block_ids,
)
from kvhint.schemas import (
    DemotePayload,
    HintOutcome,
    KvHintsEnvelope,
    PrefetchPayload,
    RetainPayload,
    Target,
    encode_hints,
    make_action,
)

BS = 32
_ids = itertools.count(1)


def sched(host_blocks: int = 40) -> HeadlessScheduler:
    return build_scheduler(HeadlessSchedulerSpec(
        block_size=BS, num_blocks=64, connector_module="kvhint.engine_plugin.connector",
        connector_extra_config={"worker_id": "w0"}, host_blocks=host_blocks))


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


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_the_plugin_finds_vllms_offloading_connector_and_offers_demote() -> None:
    log = logging.getLogger(LOGGER_NAME)  # vLLM's loggers do not propagate to the root
    lines, level = _Lines(), log.level
    log.addHandler(lines)
    log.setLevel(logging.INFO)
    try:
        h = sched()
        core = plugin(h).core
        assert core.executor.host_tier is not None
        assert "kv.demote" in core.supported_actions()
        assert any("host tier: vLLM's OffloadingConnector" in line for line in lines.lines)
        # Without the offloading connector the same plugin has none, and says why.
        plain = build_scheduler(HeadlessSchedulerSpec(
            block_size=BS, num_blocks=64, connector_module="kvhint.engine_plugin.connector",
            connector_extra_config={"worker_id": "w0"}))
    finally:
        log.removeHandler(lines)
        log.setLevel(level)
    assert plain.connector.core.executor.host_tier is None
    assert "kv.demote" not in plain.connector.core.supported_actions()
    assert any("no host tier (no KV connector with an offloading manager" in line
               for line in lines.lines)


def test_demote_lets_the_gpu_copy_go_first_and_the_next_turn_loads_from_the_host() -> None:
    h = sched()
    assert turn(h, "old", [1, 2, 3, 4]) == 4 * BS + 5
    assert turn(h, "new", [5, 6, 7, 8]) == 4 * BS + 5
    hint(h, RetainPayload(target=Target(session_id="new"), priority=50))
    outcome = hint(h, DemotePayload(target=Target(session_id="new")))
    assert (outcome.status.value, outcome.applied.blocks) == ("accepted", 4)
    assert plugin(h).core.executor.retained_blocks == 0  # the demote superseded the retain
    # One more request takes its blocks from the head of the free queue: the demoted
    # (most recent) session goes before the older one, which plain LRU would evict first.
    turn(h, None, [100, 101, 102, 103])
    assert g1_tokens(h, [5, 6, 7, 8]) == 0
    assert g1_tokens(h, [1, 2, 3, 4]) == 4 * BS
    # The demoted session is still served from vLLM's host tier: its next turn computes
    # only the tail, not the four demoted blocks.
    assert turn(h, "new", [5, 6, 7, 8, 9]) == BS + 5


def test_blocks_whose_copy_is_in_flight_stay_in_g1() -> None:
    h = sched()
    turn(h, "s", [1, 2])
    h.complete_offloads = False  # the copies of blocks 3 and 4 stay in flight
    turn(h, "s", [1, 2, 3, 4])
    outcome = hint(h, DemotePayload(target=Target(session_id="s")))
    # Blocks 1-2 have host copies, but demoting them would strand 3-4 in G1 behind a
    # recompute (vLLM continues a G1 prefix from the host, never the other way): none go.
    assert outcome.status.value == "rejected"
    assert "0 of 4 resident blocks demoted" in outcome.reason
    turn(h, None, [100, 101, 102, 103])
    assert g1_tokens(h, [1, 2, 3, 4]) == 4 * BS
    # Once the copies finish, the same Demote goes through.
    h.complete_offloads = True
    turn(h, None, [200])
    outcome = hint(h, DemotePayload(target=Target(session_id="s")))
    assert (outcome.status.value, outcome.applied.blocks) == ("accepted", 4)


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
    turn(h, None, [400, 401])  # takes the two demoted blocks off the head of the queue
    assert g1_tokens(h, [1, 2, 3, 4]) == 2 * BS
    # G1 serves blocks 1-2 and the host tier 3-4: nothing of the session is recomputed.
    assert turn(h, "s", [1, 2, 3, 4, 5]) == BS + 5


def test_prefetch_of_a_demoted_session_waits_for_its_request_then_succeeds() -> None:
    h = sched()
    turn(h, "s", [1, 2, 3])
    assert hint(h, DemotePayload(target=Target(session_id="s"))).status.value == "accepted"
    turn(h, None, [100, 101, 102])
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
