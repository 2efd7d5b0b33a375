"""A plugin core over vLLM's real KVCacheManager beside a router holdings ledger fed as
the router feeds it, to compare what the ledger counts with what the worker holds."""

from __future__ import annotations

import json

from kvhint.engine_plugin.config import PluginConfig
from kvhint.engine_plugin.core import PluginCore
from kvhint.engine_plugin.headless import build_kv_cache_manager
from kvhint.router.policy import Holdings, HoldingsLedger, target_keys
from kvhint.schemas import HintOutcome

BS = 16


class LedgerWorker:
    """One plugin core over a real KVCacheManager (64 blocks), and a router ledger fed
    as hint_send/hint_dispatch feed it (record before the send, settle on every outcome:
    the terminal one, and a deferred that caps a Prefetch's reservation; shrink on a
    release report)."""

    def __init__(self, retain_blocks: int, **config: float) -> None:
        """``config``: more PluginConfig settings (e.g. ``prefetch_budget_fraction``)."""
        self.now = [1_000.0]
        self.cache = build_kv_cache_manager(block_size=BS, num_blocks=64)
        self.core = PluginCore.attach(
            self.cache.manager,
            PluginConfig(worker_id="w0", retain_budget_fraction=retain_blocks / 64,
                         **config),
            clock=lambda: self.now[0])
        self.ledger = HoldingsLedger()

    def send(self, action_id: str, action_type: str, payload: dict, scope: str,
             blocks: int, ttl_s: float, chain: tuple[int, ...] = (),
             version: str = "1.0") -> HintOutcome:
        self.ledger.record(action_id=action_id, worker_id="w0", tenant="t", scope=scope,
                           action_type=action_type, blocks=blocks,
                           expires_at=self.now[0] + ttl_s,
                           keys=target_keys(action_type, payload, BS, chain))
        message = json.dumps({"protocol_version": "1", "message_id": "m", "actions": [
            {"action_id": action_id, "action_type": action_type,
             "action_version": version, "payload": payload}]}).encode()
        (outcome,) = self.core.apply_hints(message)
        self.answer(outcome)
        return outcome

    def answer(self, outcome: HintOutcome) -> None:
        self.ledger.settle(outcome, self.now[0])
        releases = self.core.take_releases()
        for release in releases.releases if releases is not None else ():
            self.ledger.released(release.action_id, release.held.blocks)

    def advance(self) -> list[HintOutcome]:
        outcomes = self.core.advance()
        for outcome in outcomes:
            self.answer(outcome)
        return outcomes

    def agrees(self) -> bool:
        return self.ledger.worker("w0") == Holdings(self.core.executor.pinned_blocks,
                                                    self.core.executor.retained_blocks)
