"""Status 1.3 ``claim_cost`` on the real plugin core over vLLM's real hybrid
KVCacheManager: the cost a worker advertises for a claim of n target positions is the
pool blocks a Pin of n positions actually takes there (the router plans pins against the
worker's pool-block budget with it), for n at least a sliding window's tail and below it.
A one-group model sends no cost (the 1.2 status, byte for byte)."""

from __future__ import annotations

import msgspec
import pytest
from hybrid_fixtures import BLOCK, GEMMA, TWO_FULL, Bench

from kvhint.engine_plugin.config import PluginConfig
from kvhint.engine_plugin.core import PluginCore
from kvhint.engine_plugin.headless import build_kv_cache_manager
from kvhint.router.policy.claim_cost import claim_cost
from kvhint.schemas import ClaimCost, decode_status, encode_status


@pytest.mark.parametrize(("layout", "advertised"), [
    # One full-attention group, five 32-token windows (2 blocks of 16 each).
    (GEMMA, ClaimCost(per_position=1, tails=[2] * 5)),
    # Two full-attention groups, one window.
    (TWO_FULL, ClaimCost(per_position=2, tails=[2])),
])
@pytest.mark.parametrize("positions", [4, 2, 1])  # at, above and below the tail of 2
def test_advertised_cost_is_what_a_pin_takes(layout: str, advertised: ClaimCost,
                                             positions: int) -> None:
    bench = Bench(layout, pin_budget_fraction=0.9)
    status = decode_status(encode_status(bench.core.worker_status()))  # as the router reads it
    assert status.claim_cost == advertised
    outcome = bench.hint("kv.pin", {"target": {"session_id": "s",
                                               "prefix_tokens": positions * BLOCK},
                                    "ttl_s": 600})
    assert outcome.status.value == "accepted" and outcome.applied.blocks == positions
    bench.traffic()
    assert bench.core.executor.pinned_blocks == claim_cost(positions, status.claim_cost)
    assert bench.next_turn_hit() == positions * BLOCK


def test_a_one_group_model_sends_no_cost() -> None:
    cache = build_kv_cache_manager(block_size=4, num_blocks=16)
    core = PluginCore.attach(cache.manager, PluginConfig(worker_id="w0"))
    status = core.worker_status()
    assert status.claim_cost is msgspec.UNSET
    assert b"claim_cost" not in encode_status(status)
