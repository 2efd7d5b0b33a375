"""Donor advice claims have their own key space in the hold ledger, on vLLM's real
KVCacheManager and block pool: an advice and a hint action sharing an id each keep their
claim, a waiting Prefetch settling under that id leaves the donor's claim alone, and what
each claim loses is reported under the id (and type) the router knows it by.

Before, both were keyed by the bare id: a donor advice named like a hint ended that hint's
claim (its blocks given back, its priority and TTL gone), and a Prefetch settling under a
donor's id ended the donor's."""

from __future__ import annotations

import json
from typing import Any

from core_fixtures import cached_blocks

from kvhint.engine_plugin.config import PluginConfig
from kvhint.engine_plugin.core import PluginCore
from kvhint.engine_plugin.headless import HeadlessCache, build_kv_cache_manager
from kvhint.engine_plugin.hold_records import DonorClaim
from kvhint.engine_plugin.vllm_adapter.cache import digest_to_int
from kvhint.schemas import DonorAdvice, OutcomeStatus

BS = 16


def _plugin(clock: list[float], **extra: Any) -> tuple[HeadlessCache, PluginCore]:
    cache = build_kv_cache_manager(block_size=BS, num_blocks=64)
    core = PluginCore.attach(cache.manager, PluginConfig(
        worker_id="w0", retain_budget_fraction=1.0, **extra), clock=lambda: clock[0])
    return cache, core


def _hints(action_id: str, type_: str, payload: dict) -> bytes:
    return json.dumps({"protocol_version": "1", "message_id": f"m-{action_id}", "actions": [
        {"action_id": action_id, "action_type": type_, "action_version": "1.0",
         "payload": payload}]}).encode()


def _advice(core: PluginCore, advice_id: str, keys: list[int], ttl_s: float = 30.0
            ) -> DonorAdvice:
    return DonorAdvice(advice_id=advice_id, session_id="recipient",
                       namespace=core.cache_namespace, donor_block_hashes=keys,
                       similarity=0.9, ttl_s=ttl_s, at=0.0)


def _retains(core: PluginCore, keys: list[int]) -> list[dict]:
    holds, cache = core.executor.holds, core.executor.cache
    return [dict(hold.retains) if (hold := holds._holds.get(cache.lookup(k).block_id))
            else {} for k in keys]


def test_a_donor_advice_and_a_hint_sharing_an_id_keep_both_claims() -> None:
    now = [1_000.0]
    cache, core = _plugin(now)
    mine = cached_blocks(cache, core, "s", 1)
    donor = cached_blocks(cache, core, "d", 300)
    (retained,) = core.apply_hints(_hints("x", "kv.retain", {
        "target": {"session_id": "s"}, "priority": 30, "ttl_s": 600}))
    assert retained.status is OutcomeStatus.ACCEPTED and retained.applied.blocks == 4
    advised = core.apply_advice(_advice(core, "x", donor, ttl_s=5.0))
    assert (advised.action_id, advised.status) == ("x", OutcomeStatus.ACCEPTED)
    # Before: the advice's claim replaced the Retain's (s's blocks given back).
    assert _retains(core, mine) == [{"x": 30}] * 4
    assert _retains(core, donor) == [{DonorClaim("x"): 60}] * 4
    assert core.executor.retained_blocks == 8
    now[0] += 10  # the advice's TTL ends; the Retain's does not
    core.advance()
    assert _retains(core, mine) == [{"x": 30}] * 4
    assert _retains(core, donor) == [{}] * 4
    # And the reverse: a hint under a live advice's id leaves the advice's claim alone.
    core.apply_advice(_advice(core, "z", donor))
    core.apply_hints(_hints("z", "kv.retain", {
        "target": {"session_id": "s"}, "priority": 40, "ttl_s": 600}))
    assert _retains(core, donor) == [{DonorClaim("z"): 60}] * 4
    assert _retains(core, mine) == [{"z": 40}] * 4  # (the planner's newer claim on s)


def test_a_waiting_prefetch_settling_leaves_a_donor_claim_under_its_id() -> None:
    now = [1_000.0]
    cache, core = _plugin(now)
    donor = cached_blocks(cache, core, "d", 300)
    later = cache.make_request(list(range(500, 500 + 4 * BS + 1)), session_id="later")
    coming = [digest_to_int(h) for h in later.block_hashes]
    (deferred,) = core.apply_hints(_hints("y", "kv.prefetch", {
        "target": {"block_hashes": coming}, "deadline_s": 60}))
    assert deferred.status is OutcomeStatus.DEFERRED
    assert core.apply_advice(_advice(core, "y", donor)).status is OutcomeStatus.ACCEPTED
    assert cache.admit(later) is not None  # the Prefetch's blocks arrive
    cache.finish(later)
    core.sync()
    (settled,) = core.advance()
    assert (settled.action_id, settled.status) == ("y", OutcomeStatus.ACCEPTED)
    # Before: the Prefetch's retain under "y" ended the donor's claim.
    assert _retains(core, donor) == [{DonorClaim("y"): 60}] * 4
    assert _retains(core, coming) == [{"y": core.config.prefetch_retain_priority}] * 4


def test_losses_are_reported_under_the_id_and_type_the_router_knows() -> None:
    now = [1_000.0]
    cache, core = _plugin(now)
    cached_blocks(cache, core, "s", 1)
    donor = cached_blocks(cache, core, "d", 300)
    core.apply_hints(_hints("x", "kv.retain", {
        "target": {"session_id": "s"}, "priority": 30, "ttl_s": 600}))
    core.apply_advice(_advice(core, "x", donor))
    assert core.executor.release_all() == 8
    releases = sorted((r.action_id, r.action_type, r.session_id, r.reason.value,
                       r.released.blocks, r.held.blocks)
                      for r in core.executor.take_releases())
    assert releases == [("x", "kv.donor", None, "reset", 4, 0),
                        ("x", "kv.retain", "s", "reset", 4, 0)]
