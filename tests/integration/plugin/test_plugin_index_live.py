"""The SessionPrefixIndex fed by vLLM's real scheduler: it matches the block pool, it is
rebuilt exactly by replaying its events, prefix hits count, and it stays bounded."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import pytest
from scheduler_fixtures import empty_blocks_first

from kvhint.engine_plugin.config import PluginConfigError
from kvhint.engine_plugin.core import PluginCore
from kvhint.engine_plugin.metrics import exposed_names
from kvhint.engine_plugin.headless import (
    HeadlessSchedulerSpec,
    build_kv_cache_manager,
    build_scheduler,
    tokens_for_block_ids,
)
from kvhint.engine_plugin.session_index import SessionPrefixIndex
from kvhint.engine_plugin.vllm_adapter import digest_to_int
from kvhint.schemas import (
    DemotePayload,
    DonorAdvice,
    KvHintsEnvelope,
    PinPayload,
    RetainPayload,
    Target,
    encode_advice,
    make_action,
)

BS = 32


def pool_resident_keys(block_pool: Any) -> set[int]:
    """The 64-bit hashes vLLM's prefix cache holds right now (ground truth)."""
    from vllm.v1.core.kv_cache_utils import get_block_hash

    return {digest_to_int(get_block_hash(key)) for key in block_pool.cached_block_hash_to_block._cache}


def resident_keys(index: SessionPrefixIndex) -> set[int]:
    return {k for k, _, medium in index.snapshot_blocks() if medium == "GPU"}


def test_index_matches_the_pool_and_replays_exactly_under_random_traffic() -> None:
    h = build_scheduler(HeadlessSchedulerSpec(
        block_size=BS, num_blocks=96, connector_module="kvhint.engine_plugin.connector",
        connector_extra_config={"worker_id": "w0", "max_frontiers_per_session": 4}))
    core = h.connector.core
    log: list = []
    core.record_events(log)
    rng = random.Random(7)
    histories: dict[str, list[int]] = {}
    next_block = 1
    for step in range(160):
        session = f"s{rng.randint(0, 12)}"
        history = histories.setdefault(session, [])
        if not history or rng.random() < 0.15:  # new conversation, maybe with a shared prefix
            history[:] = [0, 1] if rng.random() < 0.5 else []
        new = list(range(next_block, next_block + rng.randint(1, 4)))
        next_block += len(new)
        history.extend(new)
        request = h.make_request(tokens_for_block_ids(history, BS) + [5] * rng.randint(0, 40),
                                 session_id=session, max_tokens=rng.randint(1, 40))
        h.add(request)
        if step % 3 == 0:
            h.run_until_done()
        else:
            h.step()
    h.run_until_done()
    h.step()  # drain the last events
    index = core.index
    index.check_invariants()
    assert resident_keys(index) == pool_resident_keys(h.block_pool)
    assert index.counters.unknown_removed == 0
    # Every session's blocks are resident in vLLM and resolvable for hints.
    for session in list(index.sessions()):
        for key in index.session_blocks(session):
            assert core.adapter.lookup(key) is not None
    replayed = SessionPrefixIndex(max_frontiers_per_session=4)
    replayed.replay(log)
    assert replayed.state() == index.state()
    assert h.connector.core.counters.internal_errors == 0


def test_prefix_hit_makes_the_second_session_own_the_shared_blocks() -> None:
    h = build_scheduler(HeadlessSchedulerSpec(
        block_size=BS, num_blocks=64, connector_module="kvhint.engine_plugin.connector",
        connector_extra_config={"worker_id": "w0"}))
    system_prompt = [1, 2, 3]
    h.run(h.make_request(tokens_for_block_ids(system_prompt + [10], BS) + [4], session_id="a"))
    # b's prompt ends inside the shared prefix: vLLM stores no new full block for b, so
    # no BlockStored carries b's session id; only the hit can tell the plugin.
    h.run(h.make_request(tokens_for_block_ids(system_prompt, BS) + [9] * 5, session_id="b"))
    index = h.connector.core.index
    assert len(index.session_blocks("b")) == 3
    assert index.session_blocks("b") == index.session_blocks("a")[:3]
    outcome = h.connector.core.apply_hints(_hints(PinPayload(target=Target(session_id="b"))))
    assert outcome[0].status.value == "accepted" and outcome[0].applied.blocks == 3


def _turns_through_the_scheduler(turns: list[list[int]]) -> PluginCore:
    h = build_scheduler(HeadlessSchedulerSpec(
        block_size=BS, num_blocks=64, connector_module="kvhint.engine_plugin.connector",
        connector_extra_config={"worker_id": "w0"}))
    for ids in turns:
        h.run(h.make_request(tokens_for_block_ids(ids, BS) + [4], session_id="s"))
    return h.connector.core


def _turns_through_the_manager(turns: list[list[int]]) -> PluginCore:
    """The simulator's path: the manager driven directly, events drained by ``sync``."""
    hc = build_kv_cache_manager(block_size=BS, num_blocks=64)
    core = PluginCore.attach(hc.manager)
    for ids in turns:
        request = hc.make_request(tokens_for_block_ids(ids, BS) + [4], session_id="s")
        assert hc.admit(request) is not None
        hc.finish(request)
        core.sync()
    return core


@pytest.mark.parametrize("drive", [_turns_through_the_scheduler, _turns_through_the_manager])
def test_a_turn_that_extends_its_cached_prefix_moves_the_frontier_to_the_new_leaf(drive) -> None:
    # Turn 2 hits blocks 1-3 and stores 4-6 in the same step: the session's most recent
    # branch must be the extended chain, so {session_id, prefix_tokens} targets reach it.
    core = drive([[1, 2, 3], [1, 2, 3, 4, 5, 6]])
    assert len(core.index.frontiers("s")) == 1
    assert len(core.index.session_prefix("s", 6)) == 6
    outcome = core.apply_hints(_hints(RetainPayload(
        target=Target(session_id="s", prefix_tokens=6 * BS), priority=50)))
    assert outcome[0].status.value == "accepted" and outcome[0].applied.blocks == 6


def test_index_memory_stays_bounded_by_residency_with_the_real_pool() -> None:
    hc = build_kv_cache_manager(block_size=BS, num_blocks=200)
    core = PluginCore.attach(hc.manager)
    rng = random.Random(3)
    peak = 0
    for i in range(600):
        shared = [0, 1] if rng.random() < 0.3 else []
        ids = shared + [1000 + 7 * i + j for j in range(rng.randint(1, 6))]
        request = hc.make_request(tokens_for_block_ids(ids, BS) + [2], session_id=f"s{i % 97}")
        core.observe_new_request(request)
        hit = hc.admit(request)
        if hit is not None:
            core.observe_admission(request, hit)
            hc.finish(request)
        core.observe_finished(request)
        core.sync()
        peak = max(peak, len(core.index))
    core.index.check_invariants()
    assert peak <= 200
    assert core.adapter.num_mapped_hashes <= 200
    assert resident_keys(core.index) == pool_resident_keys(hc.block_pool)


def _hints(payload: Any, action_id: str = "x") -> bytes:
    from kvhint.schemas import encode_hints

    return encode_hints(KvHintsEnvelope(protocol_version="1", message_id="m",
                                        actions=[make_action(action_id, payload)]))


def test_donor_advice_checks_residency_and_retains_the_donor() -> None:
    hc = build_kv_cache_manager(block_size=BS, num_blocks=64)
    core = PluginCore.attach(hc.manager)
    request = hc.make_request(tokens_for_block_ids([1, 2, 3], BS) + [4], session_id="donor")
    hc.admit(request)
    hc.finish(request)
    core.sync()
    blocks = core.index.session_blocks("donor")

    def advice(advice_id: str, hashes: Sequence[int], namespace: str | None = None) -> bytes:
        return encode_advice(DonorAdvice(
            advice_id=advice_id, session_id="t/new", namespace=namespace or core.cache_namespace,
            donor_session_id="donor", donor_block_hashes=list(hashes), similarity=0.9, ttl_s=20,
            at=0.0))

    ok = core.apply_advice(advice("d1", blocks))
    assert (ok.action_type, ok.action_id, ok.status.value) == ("kv.donor", "d1", "accepted")
    assert ok.applied.blocks == 3 and core.executor.retained_blocks == 3
    part = core.apply_advice(advice("d2", blocks + [42]))
    assert part.status.value == "clipped" and part.applied.blocks == 3
    assert core.apply_advice(advice("d3", [42])).status.value == "missing"
    other = core.apply_advice(advice("d4", blocks, namespace="other-model|sha256|x|bs32"))
    assert other.status.value == "rejected" and "namespace" in other.reason
    bad = core.apply_advice(b'{"advice_id": "d5", "similarity": 7}')
    assert (bad.action_id, bad.status.value) == ("d5", "rejected")
    assert core.apply_advice(advice("d1", [42])) == ok  # idempotent by advice_id


class RecordingHostTier:
    """A stand-in for a host tier: vLLM's offloading connectors need CUDA, so the real G2
    cannot run here. It records what Demote stored; the GPU-side effects are real."""

    def __init__(self) -> None:
        self.stored: set[int] = set()

    def keep(self, block_hashes: Sequence[int]) -> frozenset[int]:
        self.stored.update(block_hashes)
        return frozenset(block_hashes)

    def contains(self, block_hash: int) -> bool:
        return block_hash in self.stored

    def copying(self, block_hash: int) -> bool:
        return False  # keep() stores at once


def test_demote_with_a_host_tier_puts_gpu_copies_first_in_line() -> None:
    hc = build_kv_cache_manager(block_size=BS, num_blocks=40)
    tier = RecordingHostTier()
    core = PluginCore.attach(hc.manager, host_tier=tier)
    for session, ids in (("old", [1, 2, 3]), ("new", [7, 8, 9])):
        request = hc.make_request(tokens_for_block_ids(ids, BS) + [4], session_id=session)
        hc.admit(request)
        hc.finish(request)
    core.sync()
    core.apply_hints(_hints(RetainPayload(target=Target(session_id="new"), priority=50), "r"))
    outcome, = core.apply_hints(_hints(DemotePayload(target=Target(session_id="new")), "d"))
    assert outcome.status.value == "accepted" and outcome.applied.blocks == 3
    assert tier.stored == set(core.index.session_blocks("new"))
    assert core.executor.retained_blocks == 0  # the demote superseded the retain
    assert "kv.demote" in core.supported_actions()
    # The demoted (most recent) session is now evicted before the older one: past the
    # free blocks that hold nothing, the 3 demoted ones come off the head first.
    empty = empty_blocks_first(hc.block_pool)
    filler = hc.make_request(tokens_for_block_ids(list(range(100, 102 + empty)), BS) + [4])
    free = hc.num_free_blocks
    hc.admit(filler)
    assert hc.num_free_blocks == free - empty - 3
    core.sync()
    assert not core.index.session_blocks("new") or len(core.index.session_blocks("new")) < 3
    assert len(core.index.session_blocks("old")) == 3


def test_bad_extra_config_stops_start_up_naming_the_key() -> None:
    with pytest.raises(PluginConfigError, match=r"kv_connector_extra_config\['max_pin_ttl_s'\]"):
        build_scheduler(HeadlessSchedulerSpec(
            block_size=BS, num_blocks=64, connector_module="kvhint.engine_plugin.connector",
            connector_extra_config={"max_pin_ttl_s": -5}))


def test_connector_stats_reach_prometheus_metrics() -> None:
    """The path vLLM uses: scheduler-side stats -> to_dict() -> the front end's
    build_kv_connector_stats / build_prom_metrics -> kvhint:* series."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

    from kvhint.engine_plugin.connector import KvHintConnector

    h = build_scheduler(HeadlessSchedulerSpec(
        block_size=BS, num_blocks=64, connector_module="kvhint.engine_plugin.connector",
        connector_extra_config={"worker_id": "w0", "pin_budget_fraction": 0.2}))
    h.run(h.make_request(tokens_for_block_ids([1, 2, 3], BS) + [4], session_id="s"))
    h.connector.core.apply_hints(_hints(PinPayload(target=Target(session_id="s"), ttl_s=30)))
    h.connector._stats.interval_s = 0.0
    stats = h.connector.get_kv_connector_stats()
    assert stats is not None and not stats.is_empty()
    payload = stats.to_dict()
    assert payload["hints"] == {"kv.pin|accepted": 1} and payload["pinned_blocks"] == 3
    registry = CollectorRegistry()

    def bind(cls: type) -> type:
        return type(cls.__name__, (cls,), {"__init__": lambda self, *a, **k:
                                           cls.__init__(self, *a, registry=registry, **k)})

    types = {Counter: bind(Counter), Gauge: bind(Gauge), Histogram: bind(Histogram)}
    prom = KvHintConnector.build_prom_metrics(h.vllm_config, types, ["model_name", "engine"],
                                              {0: ["tiny", "0"]})
    prom.observe(KvHintConnector.build_kv_connector_stats(payload).data, 0)
    text = generate_latest(registry).decode()
    assert 'kvhint:hints_total{action="kv.pin",engine="0",model_name="tiny",status="accepted"} 1.0' \
        in text
    assert 'kvhint:pinned_blocks{engine="0",model_name="tiny"} 3.0' in text
    # exposed_names() (what the deploy files are checked against) is what is registered.
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}
    series = {f"{family.name}{suffix}" for family in registry.collect()
              if family.name.startswith("kvhint:")
              for suffix in suffixes.get(family.type, ("",))}
    assert series == exposed_names()
    assert h.connector.get_kv_connector_stats() is None  # nothing changed since


def test_retained_blocks_are_released_only_when_that_lets_the_allocation_succeed() -> None:
    hc = build_kv_cache_manager(block_size=BS, num_blocks=40)
    core = PluginCore.attach(hc.manager)
    kept = hc.make_request(tokens_for_block_ids([1, 2, 3, 4], BS) + [4], session_id="kept")
    hc.admit(kept)
    hc.finish(kept)
    core.sync()
    core.apply_hints(_hints(RetainPayload(target=Target(session_id="kept"), priority=50)))
    running = hc.make_request(tokens_for_block_ids(list(range(100, 125)), BS))
    assert hc.admit(running) is not None  # holds 25 blocks; 40 - 25 - 4 retained = 11 free
    assert hc.num_free_blocks == 11
    too_big = hc.make_request(tokens_for_block_ids(list(range(200, 220)), BS))
    assert hc.admit(too_big) is None  # 20 blocks > 11 free + 4 retained: plain vLLM fails too
    assert core.executor.retained_blocks == 4  # ...and the retained blocks were not wasted
    fits = hc.make_request(tokens_for_block_ids(list(range(300, 313)), BS))
    assert hc.admit(fits) is not None  # 13 blocks: fits once 2 retained blocks are released
    assert core.executor.retained_blocks == 2
    assert core.executor.holds.counters.released_under_pressure == 2
