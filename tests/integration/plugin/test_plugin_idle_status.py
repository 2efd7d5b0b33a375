"""An idle engine steps for a status refresh a busy step skipped, so its heartbeat does
not report stale figures for good (vLLM's busy loop, woken, steps only when the
connector's ``has_pending_push_work`` says so)."""

from __future__ import annotations

import time

from kvhint.engine_plugin.config import PluginConfig
from kvhint.engine_plugin.core import PluginCore
from kvhint.engine_plugin.headless import build_kv_cache_manager
from kvhint.engine_plugin.mailbox import Mailbox


def test_a_skipped_status_refresh_that_falls_due_asks_for_a_step() -> None:
    """Before, the transport woke the engine for it, but has_pending_work said no: the
    woken engine went back to sleep and the heartbeat kept the figures of before."""
    cache = build_kv_cache_manager(block_size=16, num_blocks=64)
    mailbox = Mailbox(100, 100, 10)
    core = PluginCore.attach(cache.manager, PluginConfig(worker_id="w0"), mailbox=mailbox)
    assert not core.has_pending_work()
    mailbox.status_refresh_at = time.time() + 60
    assert not core.has_pending_work()  # not due yet
    mailbox.status_refresh_at = time.time() - 0.01
    assert core.has_pending_work()
