"""The router's holdings ledger counts a session's Prefetches as the plugin holds them, on
vLLM's real KVCacheManager and block pool: each Prefetch's retain is a claim of its own
until its own deadline, and the blocks two of them share are one block. Before, the ledger
kept one Prefetch per session and worker (``prefetch:<scope>``): once the second's
shorter deadline passed it believed free the blocks the worker still retained for the
first."""

from __future__ import annotations

from core_fixtures import cached_blocks, hints_message

from kvhint.engine_plugin.config import PluginConfig
from kvhint.engine_plugin.core import PluginCore
from kvhint.engine_plugin.headless import build_kv_cache_manager
from kvhint.router.policy import Holdings, HoldingsLedger, target_keys
from kvhint.schemas import OutcomeStatus

BS = 16


def test_the_ledger_holds_a_sessions_prefetches_as_the_worker_does() -> None:
    now = [1_000.0]
    cache = build_kv_cache_manager(block_size=BS, num_blocks=64)
    core = PluginCore.attach(cache.manager, PluginConfig(worker_id="w0"),
                             clock=lambda: now[0])
    chain = cached_blocks(cache, core, "s", 1)  # four blocks in G1, free
    ledger = HoldingsLedger()
    executor = core.executor

    def prefetch(action_id: str, deadline_s: float, keys: tuple[int, ...]) -> None:
        payload = {"target": {"session_id": "s"}, "deadline_s": deadline_s}
        (outcome,) = core.apply_hints(hints_message((action_id, "kv.prefetch", payload)))
        assert outcome.status is OutcomeStatus.ACCEPTED and outcome.applied.blocks == 4
        # As the router records and settles it (hint_send, hint_dispatch.on_outcome).
        ledger.record(action_id=action_id, worker_id="w0", tenant="t", scope="s",
                      action_type="kv.prefetch", blocks=4,
                      expires_at=now[0] + deadline_s,
                      keys=target_keys("kv.prefetch", payload, BS, keys))
        ledger.settle(outcome, now[0])

    def at(when: float) -> tuple[int, Holdings]:
        now[0] = when
        core.advance()
        ledger.expire(when)
        return executor.retained_blocks, ledger.worker("w0")

    for keys in (tuple(chain), ()):  # the prompt's hashes known, then not (a restart)
        start = now[0]
        prefetch(f"long-{start}", 60.0, keys)
        now[0] = start + 10.0
        prefetch(f"short-{start}", 10.0, keys)  # the same session, a shorter deadline
        assert at(start + 15.0) == (4, Holdings(0, 4))
        assert at(start + 20.0) == (4, Holdings(0, 4))  # the first still retains them
        assert at(start + 60.0) == (0, Holdings())
        assert len(ledger) == 0
