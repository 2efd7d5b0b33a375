"""The session's vLLM servers start on ports picked here (free_port()): a port taken by
another process before vLLM binds it (EADDRINUSE; a clean-clone CI run failed a set-up
on such a race) is replaced by another."""

from __future__ import annotations

import socket
import sys
from typing import Any

import httpx
import pytest


def test_a_server_whose_picked_port_was_taken_starts_on_another(
        vllm_pool: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The pool's port picker is made to answer a port another listener holds
    (monkeypatched, in this test only: a real pick cannot be made to collide on cue).
    vLLM exits on it ("Address already in use") and is started again on a new port.
    Before, the start raised: vLLM server exited early."""
    pool_module = sys.modules[type(vllm_pool).__module__]
    real_pick = pool_module.free_port
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        picks = iter([taken])
        monkeypatch.setattr(pool_module, "free_port", lambda: next(picks, None) or real_pick())
        server = vllm_pool.start("port-race")
    try:
        assert server.spec.port != taken
        assert httpx.get(f"{server.url}/v1/models", timeout=10).status_code == 200
    finally:
        server.stop()  # one server less held through the rest of the session
