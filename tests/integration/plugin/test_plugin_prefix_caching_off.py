"""A worker started without prefix caching (``--no-enable-prefix-caching``), on vLLM's real
Scheduler: the plugin cannot do anything there, and says so instead of running silently."""

from __future__ import annotations

import time

from scheduler_fixtures import BS, hint, plugin_log_lines, turn

from kvhint.engine_plugin.headless import HeadlessSchedulerSpec, build_scheduler
from kvhint.engine_plugin.metrics import HINTS_KEY
from kvhint.schemas import DonorAdvice, OutcomeStatus, PinPayload, RetainPayload, Target


def test_without_prefix_caching_the_plugin_warns_advertises_nothing_and_rejects_hints() -> None:
    """Before, the plugin started without a word, its heartbeat advertised Pin, Retain and
    Prefetch, and each hint was answered ``missing`` ("no target block is resident"), as
    if the session had merely been evicted: nothing told the operator that no hint could
    ever apply on this worker. Now the log says so at start-up, naming the flag, the
    heartbeat advertises no action, and every hint and donor advice is ``rejected`` with
    that reason (counted in kvhint:hints_total; not transient, so the router learns it)."""
    with plugin_log_lines() as lines:
        h = build_scheduler(HeadlessSchedulerSpec(
            block_size=BS, num_blocks=64, connector_module="kvhint.engine_plugin.connector",
            connector_extra_config={"worker_id": "w0"}, enable_prefix_caching=False))
    warnings = [line for line in lines if "without prefix caching" in line]
    assert len(warnings) == 1 and "--enable-prefix-caching" in warnings[0]
    core = h.connector.core
    turn(h, "s", [1, 2, 3])
    assert len(core.index) == 0  # vLLM cached nothing: no event, no hit
    assert core.supported_actions() == {}
    assert core.worker_status().supported_actions == {}

    pin = hint(h, PinPayload(target=Target(session_id="s"), ttl_s=30))
    retain = hint(h, RetainPayload(target=Target(block_hashes=[1, 2]), priority=50))
    for outcome in (pin, retain):
        assert outcome.status is OutcomeStatus.REJECTED
        assert "prefix caching is off" in outcome.reason
    donor = core.apply_advice(DonorAdvice(advice_id="d1", session_id="t",
                                          namespace=core.cache_namespace,
                                          donor_block_hashes=[1], similarity=0.9,
                                          at=time.time()))
    assert donor.status is OutcomeStatus.REJECTED and "prefix caching is off" in donor.reason
    hints = h.connector._read_stats()[HINTS_KEY]
    assert hints == {"kv.pin|rejected": 1, "kv.retain|rejected": 1, "kv.donor|rejected": 1}
    assert core.executor.pinned_blocks == core.executor.retained_blocks == 0


def test_with_prefix_caching_nothing_of_that_is_said() -> None:
    with plugin_log_lines() as lines:
        h = build_scheduler(HeadlessSchedulerSpec(
            block_size=BS, num_blocks=64, connector_module="kvhint.engine_plugin.connector",
            connector_extra_config={"worker_id": "w0"}))
    assert not [line for line in lines if "without prefix caching" in line]
    turn(h, "s", [1, 2, 3])
    assert len(h.connector.core.index) == 3
    assert "kv.pin" in h.connector.core.supported_actions()
    assert hint(h, PinPayload(target=Target(session_id="s"), ttl_s=30)).status is (
        OutcomeStatus.ACCEPTED)
