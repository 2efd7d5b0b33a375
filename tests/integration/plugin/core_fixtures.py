"""Helpers of the tests that drive :class:`PluginCore` straight over vLLM's real
KVCacheManager and block pool (no Scheduler): a session's blocks cached, a hints
envelope's bytes."""

from __future__ import annotations

import json

from kvhint.engine_plugin.core import PluginCore
from kvhint.engine_plugin.headless import HeadlessCache


def cached_blocks(cache: HeadlessCache, core: PluginCore, session: str, first: int
                  ) -> list[int]:
    """Four blocks of ``session`` (tokens from ``first`` on) cached and freed; their
    hashes, root first."""
    size = cache.block_size
    request = cache.make_request(list(range(first, first + 4 * size + 1)), session_id=session)
    assert cache.admit(request) is not None
    cache.finish(request)
    core.sync()
    return core.index.session_blocks(session)


def hints_message(*actions: tuple[str, str, dict], message_id: str = "m") -> bytes:
    """A hints envelope (version 1.0 actions: id, type, payload) as the wire has it."""
    return json.dumps({"protocol_version": "1", "message_id": message_id, "actions": [
        {"action_id": aid, "action_type": type_, "action_version": "1.0", "payload": payload}
        for aid, type_, payload in actions]}).encode()
