"""The adapter's per-request state on vLLM's real scheduler: every way vLLM frees a request
ends it (deferred frees included), a hash a live request still needs is never forgotten,
and the plugin alone is loaded as no KV consumer."""

from __future__ import annotations

import random
from typing import Any

import pytest
from scheduler_fixtures import BS, hint, plugin_log_lines, prompt

from kvhint.engine_plugin.config import KV_ROLE
from kvhint.engine_plugin.headless import (
    HeadlessScheduler,
    HeadlessSchedulerSpec,
    build_scheduler,
)
from kvhint.engine_plugin.vllm_adapter import digest_to_int
from kvhint.schemas import RetainPayload, Target

CONNECTOR = "kvhint.engine_plugin.connector"


def build(**spec: Any) -> HeadlessScheduler:
    spec.setdefault("num_blocks", 64)
    return build_scheduler(HeadlessSchedulerSpec(
        block_size=BS, connector_module=CONNECTOR, connector_extra_config={"worker_id": "w0"},
        **spec))


def plugin_core(h: HeadlessScheduler) -> Any:
    connector = h.connector
    if hasattr(connector, "core"):
        return connector.core
    return next(c for c in connector.sub_connectors if hasattr(c, "core")).core


def pool_resident_keys(block_pool: Any) -> set[int]:
    from vllm.v1.core.kv_cache_utils import get_block_hash

    return {digest_to_int(get_block_hash(key))
            for key in block_pool.cached_block_hash_to_block._cache}


def aborted(h: HeadlessScheduler, requests: list[Any]) -> None:
    from vllm.v1.request import RequestStatus

    h.scheduler.finish_requests([r.request_id for r in requests],
                                RequestStatus.FINISHED_ABORTED)


# --- deferred frees ---------------------------------------------------------------------------

@pytest.mark.parametrize("setup", ["kv_both alone", "beside OffloadingConnector"])
def test_requests_freed_after_the_step_in_flight_leave_no_state(setup: str) -> None:
    """With overlapping batches (async scheduling, vLLM's default on CUDA) and a KV consumer
    among the connectors, vLLM frees a request aborted or preempted while a step is in flight
    through ``pop_blocks_for_free`` and the block pool, never ``KVCacheManager.free``."""
    if setup == "kv_both alone":
        h = build(async_scheduling=True, kv_role="kv_both")
    else:
        h = build(async_scheduling=True, host_blocks=16)
    scheduler = h.scheduler
    assert scheduler.defer_block_free  # vLLM's own decision for this configuration
    core = plugin_core(h)
    requests = [h.add(h.make_request(prompt([100 + i, 200 + i, 300 + i]), session_id=f"s{i}",
                                     max_tokens=20)) for i in range(6)]
    h.step()
    h.step()
    out = scheduler.schedule()  # a step in flight
    aborted(h, requests[:3])  # clients gone mid-generation
    assert len(scheduler.deferred_frees) == 3
    h.complete(out)
    assert not scheduler.deferred_frees
    h.run_until_done()
    assert all(r.is_finished() for r in requests)
    assert core.adapter.num_live_requests == 0
    assert core.status_usage().active_requests == 0
    assert set(core.adapter.known_keys()) == pool_resident_keys(h.block_pool)
    assert core.counters.internal_errors == 0


# --- the plugin's role ------------------------------------------------------------------------

def test_the_plugin_alone_is_no_kv_consumer_so_vllm_frees_and_resets_as_without_it() -> None:
    plain = build_scheduler(HeadlessSchedulerSpec(block_size=BS, num_blocks=64,
                                                  async_scheduling=True))
    h = build(async_scheduling=True)
    assert h.vllm_config.kv_transfer_config.kv_role == KV_ROLE
    # ... and so is the plugin `kvhint up`, the benchmarks and the e2e tests load.
    from kvhint.router.devstack.up import plugin_transfer_config
    assert plugin_transfer_config("w0", "nats://x")["kv_role"] == KV_ROLE
    assert not h.vllm_config.kv_transfer_config.is_kv_consumer
    for engine in (plain, h):
        scheduler = engine.scheduler
        assert not scheduler.defer_block_free
        assert not scheduler.requires_kv_delivery  # a preempted request keeps its output
        for i in range(4):
            engine.add(engine.make_request(prompt([100 + i, 200 + i]), session_id=f"s{i}",
                                           max_tokens=20))
        scheduler.schedule()  # a step in flight
        # What pause(clear_cache=True), sleep() and release_kv_cache_memory() do.
        assert scheduler.reset_prefix_cache(reset_running_requests=True)


def test_a_consumer_role_for_the_plugin_alone_is_named_in_the_log() -> None:
    with plugin_log_lines() as lines:
        build(kv_role="kv_both")
        said = [line for line in lines if "KV consumer" in line]
        lines.clear()
        build()
        build(host_blocks=16)  # the MultiConnector is kv_both: its OffloadingConnector loads
    assert len(said) == 1 and f"kv_role {KV_ROLE!r}" in said[0], said
    assert not [line for line in lines if "KV consumer" in line]


# --- hashes shared by live requests -------------------------------------------------------------

def test_a_request_aborted_mid_prefill_leaves_a_shared_prefix_resolvable() -> None:
    """Two sessions prefill the same 10-block document in chunks; one leaves after the
    first chunk. The other caches the rest later, and hints naming them find them."""
    h = build(long_prefill_token_threshold=2 * BS)
    core = plugin_core(h)
    ids = list(range(1, 11))
    a = h.add(h.make_request(prompt(ids), session_id="A", max_tokens=2))
    h.add(h.make_request(prompt(ids), session_id="B", max_tokens=2))
    h.step()  # both admitted, two blocks each computed
    aborted(h, [a])
    h.run_until_done()
    keys = core.index.session_blocks("B")
    assert len(keys) == 10
    assert all(core.adapter.lookup(k) is not None for k in keys)
    outcome = hint(h, RetainPayload(target=Target(session_id="B"), priority=50))
    assert (outcome.status.value, outcome.applied.blocks) == ("accepted", 10), outcome.reason


def test_a_removed_copy_does_not_forget_a_hash_a_live_request_will_cache() -> None:
    """vLLM keeps duplicate copies: a BlockRemoved for one copy, while a live request has
    mapped (and will compute) the same hash, must leave the hash resolvable."""
    h = build(max_num_batched_tokens=2 * BS)  # a prefill of two blocks a step
    core = plugin_core(h)
    request = h.add(h.make_request(prompt(list(range(1, 11))), session_id="B", max_tokens=2))
    h.step()  # 2 of 10 blocks computed; all 10 hashes mapped
    later = [digest_to_int(d) for d in request.block_hashes[2:]]
    core.adapter.forget(later)  # what on_engine_events does for a BlockRemoved of a copy
    h.run_until_done()
    assert all(core.adapter.lookup(k) is not None for k in later)


def test_mapped_hashes_follow_residency_under_aborts_preemptions_and_shared_prefixes() -> None:
    """Random traffic over shared prefixes, chunked prefills, aborts and preemptions
    (a small pool): every cached hash stays resolvable at every step, and once the engine
    is idle exactly the cached hashes are mapped."""
    h = build(num_blocks=40, long_prefill_token_threshold=2 * BS)
    core = plugin_core(h)
    rng = random.Random(2)
    live: list[Any] = []
    preemptions = aborts = 0
    for step in range(120):
        for _ in range(rng.randint(0, 2)):
            # A new document every few steps, read by several sessions at once.
            shared = [step // 4 * 100 + i for i in range(rng.randint(2, 8))]
            tail = [10**6 + step * 10 + i for i in range(rng.randint(0, 3))]
            live.append(h.add(h.make_request(prompt(shared + tail), session_id=f"s{step % 7}",
                                             max_tokens=rng.randint(1, 40))))
        if live and rng.random() < 0.2:
            victim = live.pop(rng.randrange(len(live)))
            if not victim.is_finished():
                aborts += 1
                aborted(h, [victim])
        if h.scheduler.has_requests():
            h.step()
        preemptions = max(preemptions, sum(r.num_preemptions for r in live))
        live = [r for r in live if not r.is_finished()]
        missing = pool_resident_keys(h.block_pool) - set(core.adapter.known_keys())
        assert not missing, (step, len(missing))
    h.run_until_done()
    h.step()
    assert aborts > 0 and preemptions > 0
    assert core.adapter.num_live_requests == 0
    assert set(core.adapter.known_keys()) == pool_resident_keys(h.block_pool)
    assert core.counters.internal_errors == 0
