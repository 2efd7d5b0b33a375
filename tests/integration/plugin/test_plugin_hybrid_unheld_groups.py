"""A hybrid model with KV cache groups no hold can take, against vLLM's real
KVCacheManager: full attention beside chunked local attention (Llama 4's kind), whose
hit rule the plugin does not model (``vllm_adapter/hit_groups.py`` reads the managers'
classes, never a version). vLLM's hit needs those groups' blocks too, so a hold of the
followed group's keeps no hit: the worker says it applies no Pin or Retain, and answers
one ``rejected`` with a capability reason (the router stops sending them there), counted
as any outcome. Before, it held the full-attention blocks, answered ``accepted`` and
left the other groups to eviction.
"""

from __future__ import annotations

import pytest
from hybrid_fixtures import CHUNKED, GEMMA, Bench

from kvhint.schemas import DonorAdvice, decode_status, encode_status
from kvhint.schemas.outcomes import REJECTED_UNHELD_GROUPS, is_capability_rejection


@pytest.mark.parametrize(("kind", "payload"), [
    ("kv.pin", {"target": {"session_id": "s"}, "ttl_s": 600}),
    ("kv.retain", {"target": {"session_id": "s"}, "priority": 50, "ttl_s": 600}),
    ("kv.retain", {"target": {"block_hashes": "keys"}, "priority": 50, "ttl_s": 600}),
    # A Prefetch retains what it finds until its deadline: before, it held the
    # full-attention blocks and answered accepted, as a Pin did.
    ("kv.prefetch", {"target": {"session_id": "s"}, "deadline_s": 5}),
])
def test_a_hold_that_keeps_no_hit_is_refused_and_counted(kind: str, payload: dict) -> None:
    bench = Bench(CHUNKED, pin_budget_fraction=0.5)
    executor = bench.core.executor
    assert bench.core.adapter.unheld_groups == ("1 (ChunkedLocalAttentionManager)",
                                                "2 (ChunkedLocalAttentionManager)")
    if payload["target"].get("block_hashes") == "keys":
        payload = {**payload, "target": {"block_hashes": bench.core.index.session_prefix("s", 4)}}
    outcome = bench.hint(kind, payload)
    assert outcome.status.value == "rejected"
    assert outcome.reason.startswith(REJECTED_UNHELD_GROUPS)
    assert "1 (ChunkedLocalAttentionManager)" in outcome.reason
    assert is_capability_rejection(outcome.reason)  # learnt for the worker, every tenant
    assert executor.pinned_blocks == executor.retained_blocks == 0
    assert executor.counters.outcomes[(kind, "rejected")] == 1


def test_the_status_offers_no_pin_or_retain_and_a_release_still_applies() -> None:
    bench = Bench(CHUNKED)
    status = decode_status(encode_status(bench.core.worker_status()))
    assert "kv.pin" not in status.supported_actions
    assert "kv.retain" not in status.supported_actions
    assert "kv.prefetch" not in status.supported_actions  # its retain keeps no hit either
    release = bench.hint("kv.retain", {"target": {"session_id": "s"}, "priority": 0,
                                       "ttl_s": 600})
    assert release.status.value == "accepted"  # priority 0 holds nothing: a release
    # A model whose every group holds can take is unchanged.
    supported = Bench(GEMMA).core.worker_status().supported_actions
    assert {"kv.pin", "kv.retain"} <= set(supported)


def test_donor_advice_retains_nothing_and_is_refused_as_a_retain_is() -> None:
    """Before: "4 donor blocks retained", ``accepted``, blocks held, no hit kept."""
    bench = Bench(CHUNKED)
    core = bench.core
    outcome = core.apply_advice(DonorAdvice(
        advice_id="adv", session_id="recipient", namespace=core.cache_namespace,
        donor_block_hashes=core.index.session_prefix("s", 4), similarity=0.9, ttl_s=60.0,
        at=0.0))
    assert outcome.status.value == "rejected"
    assert outcome.reason.startswith(REJECTED_UNHELD_GROUPS)
    assert is_capability_rejection(outcome.reason)
    assert core.executor.retained_blocks == 0
    assert core.executor.counters.outcomes[("kv.donor", "rejected")] == 1
