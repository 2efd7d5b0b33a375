"""Relief under memory pressure counts the free blocks vLLM keeps back, on vLLM's real
KVCacheManager: its watermark (``--watermark``, kept free when admitting a waiting
request) and an allocation's ``reserved_blocks`` (kept for other in-flight sequences)."""

from __future__ import annotations

from typing import Any

import pytest

from kvhint.engine_plugin.config import PluginConfig
from kvhint.engine_plugin.core import PluginCore
from kvhint.engine_plugin.headless import (
    HeadlessCache,
    build_kv_cache_manager,
    tokens_for_block_ids,
)
from kvhint.schemas import KvHintsEnvelope, RetainPayload, Target, encode_hints, make_action

BS = 32
KEPT_BACK = 4  # watermark 0.1 of vLLM's 41 blocks (its null block counted), or reserved


def _admit(hc: HeadlessCache, request: Any, reserved: int) -> bool:
    """HeadlessCache.admit, with ``reserved_blocks`` as vLLM's scheduler passes it."""
    blocks, hit, _ = hc.manager.get_computed_blocks(request)
    extra = {"reserved_blocks": reserved} if reserved else {}
    new = hc.manager.allocate_slots(request, request.num_tokens - hit,
                                    num_new_computed_tokens=hit, new_computed_blocks=blocks,
                                    **extra)
    if new is None:
        return False
    request.num_computed_tokens = request.num_tokens
    return True


def _setup(kept_back: str) -> tuple[HeadlessCache, PluginCore, int]:
    """6 idle retained blocks, a running request, 9 free blocks; the reserve to pass."""
    hc = build_kv_cache_manager(block_size=BS, num_blocks=40,
                                watermark=0.1 if kept_back == "watermark" else 0.0)
    core = PluginCore.attach(hc.manager, PluginConfig(retain_budget_fraction=1.0))
    idle = hc.make_request(tokens_for_block_ids([1, 2, 3, 4, 5, 6], BS) + [6],
                           session_id="idle")
    assert _admit(hc, idle, 0)
    hc.finish(idle)
    core.sync()
    (outcome,) = core.apply_hints(encode_hints(KvHintsEnvelope(
        protocol_version="1", message_id="m", actions=[make_action("r-idle", RetainPayload(
            target=Target(session_id="idle"), priority=50))])))
    assert outcome.applied.blocks == 6
    hog = hc.make_request(tokens_for_block_ids(list(range(100, 125)), BS))
    assert _admit(hc, hog, 0)
    assert (hc.num_free_blocks, core.executor.retained_blocks) == (9, 6)
    return hc, core, KEPT_BACK if kept_back == "reserved" else 0


@pytest.mark.parametrize("kept_back", ["watermark", "reserved"])
def test_relief_that_the_kept_back_blocks_make_futile_releases_nothing(kept_back: str) -> None:
    # 13 blocks + the 4 vLLM keeps back: 9 free + 6 retained are not enough. Before,
    # relief counted 13 only (9 + 6 looked enough): it released all 6, and the
    # allocation failed anyway, as in plain vLLM, every step it was retried.
    hc, core, reserved = _setup(kept_back)
    big = hc.make_request(tokens_for_block_ids(list(range(200, 213)), BS))
    assert not _admit(hc, big, reserved)
    assert core.executor.holds.counters.released_under_pressure == 0
    assert core.executor.retained_blocks == 6
    assert core.take_releases() is None


@pytest.mark.parametrize("kept_back", ["watermark", "reserved"])
def test_relief_releases_what_the_allocation_and_the_kept_back_blocks_need(
        kept_back: str) -> None:
    # 10 blocks + the 4 kept back: 5 short. Before, relief started at 1 (10 - 9) and
    # doubled (1, 2, 4): it released all 6 where 5 were enough.
    hc, core, reserved = _setup(kept_back)
    fits = hc.make_request(tokens_for_block_ids(list(range(300, 310)), BS))
    assert _admit(hc, fits, reserved)
    assert core.executor.holds.counters.released_under_pressure == 5
    assert core.executor.retained_blocks == 1


def test_relief_counts_the_whole_prompt_where_vllm_admits_only_a_prompt_that_fits() -> None:
    # vLLM's admission gate (full_sequence_must_fit, scheduler_reserve_full_isl: on by
    # default) refuses a waiting request whose whole prompt does not fit, though its
    # first chunk would. Before, relief counted the chunk only: for a 20-block prompt in
    # chunks of 5 it released all 6 retained blocks and vLLM refused it anyway.
    hc, core, _ = _setup("none")
    counters = core.executor.holds.counters

    def admit_chunk(blocks: int, chunk_blocks: int, first: int) -> bool:
        request = hc.make_request(tokens_for_block_ids(list(range(first, first + blocks)),
                                                       BS))
        computed, hit, _ = hc.manager.get_computed_blocks(request)
        return hc.manager.allocate_slots(request, chunk_blocks * BS,
                                         num_new_computed_tokens=hit,
                                         new_computed_blocks=computed,
                                         full_sequence_must_fit=True) is not None

    assert not admit_chunk(20, 5, 400)
    assert counters.released_under_pressure == 0 and core.executor.retained_blocks == 6
    # A 13-block prompt fits with 4 released (before: 1, 2, then the rest: all 6).
    assert admit_chunk(13, 4, 500)
    assert counters.released_under_pressure == 4 and core.executor.retained_blocks == 2
