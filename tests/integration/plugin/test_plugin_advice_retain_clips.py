"""What clips a donor advice's retain is said in its outcome, on vLLM's real
KVCacheManager and block pool. The status stays residency's (schemas.advice: accepted when
every donor block is resident), but the reason names the TTL actually held and the budget
that cut the retain. Before, the executor dropped those notes: the reason said "2 donor
blocks retained for 300s" for blocks held 60 s, and nothing of why only 2."""

from __future__ import annotations

from core_fixtures import cached_blocks

from kvhint.engine_plugin.config import PluginConfig
from kvhint.engine_plugin.core import PluginCore
from kvhint.engine_plugin.headless import build_kv_cache_manager
from kvhint.schemas import DonorAdvice, OutcomeStatus


def test_a_donor_retain_clipped_by_ttl_and_budget_says_so() -> None:
    now = [1_000.0]
    cache = build_kv_cache_manager(block_size=16, num_blocks=64)
    core = PluginCore.attach(cache.manager, PluginConfig(
        worker_id="w0", retain_budget_fraction=2 / 64, max_retain_ttl_s=60.0),
        clock=lambda: now[0])
    donor = cached_blocks(cache, core, "d", 300)
    outcome = core.apply_advice(DonorAdvice(
        advice_id="a", session_id="recipient", namespace=core.cache_namespace,
        donor_block_hashes=donor, similarity=0.9, ttl_s=300.0, at=now[0]))
    assert outcome.status is OutcomeStatus.ACCEPTED  # all 4 resident
    assert outcome.applied.blocks == 4
    assert "2 donor blocks retained for 60s" in outcome.reason, outcome.reason
    assert "ttl clipped to max_retain_ttl_s=60" in outcome.reason
    assert "retain budget: 2 of 4" in outcome.reason
    assert core.executor.retained_blocks == 2
    now[0] += 61  # the TTL held, not the advice's 300 s
    core.advance()
    assert core.executor.retained_blocks == 0
