"""Relief under memory pressure on vLLM's real KVCacheManager: retained blocks a running
request also uses cannot be given to an allocation (releasing them frees nothing), so
they must not make an allocation that cannot succeed look worth releasing the others."""

from __future__ import annotations

from typing import Any

from kvhint.engine_plugin.config import PluginConfig
from kvhint.engine_plugin.core import PluginCore
from kvhint.engine_plugin.headless import build_kv_cache_manager, tokens_for_block_ids
from kvhint.schemas import KvHintsEnvelope, RetainPayload, Target, encode_hints, make_action

BS = 32


def _retain(core: PluginCore, session: str, action_id: str) -> None:
    payload = RetainPayload(target=Target(session_id=session), priority=50)
    (outcome,) = core.apply_hints(encode_hints(KvHintsEnvelope(
        protocol_version="1", message_id="m", actions=[make_action(action_id, payload)])))
    assert outcome.status.value == "accepted", outcome


def _cached(hc: Any, core: PluginCore, session: str, ids: list[int]) -> list[int]:
    tokens = tokens_for_block_ids(ids, BS) + [ids[-1]]
    request = hc.make_request(tokens, session_id=session)
    assert hc.admit(request) is not None
    hc.finish(request)
    core.sync()
    return tokens


def test_retained_blocks_in_use_do_not_count_as_releasable() -> None:
    # Before, allocate_slots' wrapper took every retained block as releasable: with a
    # running request reading a retained session, an allocation that releasing all the
    # idle retained blocks could not satisfy still released them (reported as
    # pressure to the router) and failed anyway, as plain vLLM does, every step it was
    # retried: the idle sessions lost their protection for nothing.
    hc = build_kv_cache_manager(block_size=BS, num_blocks=40)
    core = PluginCore.attach(hc.manager)
    _cached(hc, core, "idle", [1, 2, 3, 4, 5, 6])
    _retain(core, "idle", "r-idle")
    turn = _cached(hc, core, "run", list(range(10, 22)))
    _retain(core, "run", "r-run")
    assert core.executor.retained_blocks == 18
    # The session's next turn runs on its retained 12 blocks and adds 4.
    running = hc.make_request(turn + [7] * (4 * BS - 1), session_id="run")
    assert hc.admit(running) is not None
    assert hc.num_free_blocks == 40 - 6 - 16  # 18
    # 30 blocks: 18 free + the 6 idle retained blocks are not enough; the 12 retained
    # blocks the running turn reads would free nothing.
    too_big = hc.make_request(tokens_for_block_ids(list(range(200, 230)), BS))
    assert hc.admit(too_big) is None  # plain vLLM fails too
    assert core.executor.holds.counters.released_under_pressure == 0
    assert core.executor.retained_blocks == 18
    assert core.take_releases() is None
    # An allocation the idle retained blocks do let through still gets them.
    fits = hc.make_request(tokens_for_block_ids(list(range(300, 322)), BS))
    assert hc.admit(fits) is not None  # 22 blocks: 18 free + 4 released
    assert core.executor.holds.counters.released_under_pressure == 4
    assert core.executor.retained_blocks == 14


def test_a_turn_waiting_for_memory_keeps_its_own_retained_prefix() -> None:
    # The case retains are for: a session's next turn, its prefix retained, waits for
    # memory. Before, relief counted the turn's own prefix hits as releasable: releasing
    # one frees a block but vLLM then needs one to allocate it back, so an admission
    # that could not succeed released every retained block (the session's own prefix
    # and the idle ones) and failed anyway, every step it was retried.
    hc = build_kv_cache_manager(block_size=BS, num_blocks=40)
    core = PluginCore.attach(hc.manager, PluginConfig(retain_budget_fraction=1.0))
    _cached(hc, core, "idle", [1, 2, 3, 4, 5])
    _retain(core, "idle", "r-idle")
    turn = _cached(hc, core, "next", list(range(10, 30)))
    _retain(core, "next", "r-next")
    hog = hc.make_request(tokens_for_block_ids(list(range(100, 112)), BS))
    assert hc.admit(hog) is not None
    assert (hc.num_free_blocks, core.executor.retained_blocks) == (3, 25)
    prefix = core.index.session_blocks("next")
    # 10 new blocks: 3 free + 5 idle retained are not enough.
    waiting = hc.make_request(turn + [7] * (10 * BS - 1), session_id="next")
    assert hc.admit(waiting) is None  # plain vLLM fails too
    assert core.executor.holds.counters.released_under_pressure == 0
    assert core.executor.retained_blocks == 25
    # 6 new blocks: the idle session gives 3 and the turn runs on its retained prefix.
    waiting = hc.make_request(turn + [7] * (6 * BS - 1), session_id="next")
    assert hc.admit(waiting) == 20 * BS
    assert core.executor.holds.counters.released_under_pressure == 3
    holds, cache = core.executor.holds, core.executor.cache
    assert all(holds.is_held(cache.lookup(k).block_id) for k in prefix)
