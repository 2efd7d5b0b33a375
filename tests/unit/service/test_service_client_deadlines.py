"""Where the installed uvicorn lacks a hook the slow-client deadlines rely on, the router
still serves (plain h11) and says so in an error, rather than failing to start or
running without them silently. (The deadlines themselves: the integration test
test_service_client_timeouts.py, on a real server.)"""

from __future__ import annotations

import logging

import pytest
from uvicorn.protocols.http.h11_impl import H11Protocol

from kvhint.router.server_cli import uvicorn_config
from kvhint.router.service.client_deadlines import deadline_protocol
from kvhint.router.service.settings import RouterSettings


def test_the_deadlines_subclass_uvicorns_h11_protocol() -> None:
    protocol = deadline_protocol(1.0, 1.0, lambda phase: None)
    assert protocol is not None and issubclass(protocol, H11Protocol)


def test_a_uvicorn_without_the_hook_falls_back_to_plain_h11_loudly(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    # As an older or newer uvicorn whose protocol has no such method would be.
    monkeypatch.delattr(H11Protocol, "on_response_complete")
    with caplog.at_level(logging.ERROR, logger="kvhint.router"):
        assert deadline_protocol(1.0, 1.0, lambda phase: None) is None
        config = uvicorn_config(object(), RouterSettings(database_url="sqlite://"))
    assert config.http == "h11"
    assert any("slow-client deadlines OFF" in r.getMessage() and "on_response_complete"
               in r.getMessage() for r in caplog.records), caplog.text
