"""The router's NATS link against a real nats-server: losing the server is a warning an
operator should see; the link closing its own connection (shutdown) is not."""

from __future__ import annotations

import asyncio
import logging

import pytest

from kvhint.router.devstack.nats_server import NatsServerProcess
from kvhint.router.service.nats_link import NatsLink
from kvhint.schemas import Subjects

LOGGER = "kvhint.router.service.nats_link"


async def _connected_link(url: str, errors: list[str]) -> NatsLink:
    link = NatsLink(url, Subjects("kvhinttest.link"), on_error=errors.append, retry_s=0.1)

    async def nothing() -> None:
        return None

    link.start(nothing)
    assert await link.wait_connected(10.0)
    return link


def _warned_reconnecting(caplog: pytest.LogCaptureFixture) -> bool:
    return any(r.name == LOGGER and r.levelno == logging.WARNING
               and "reconnecting" in r.getMessage() for r in caplog.records)


async def test_a_lost_server_warns_and_the_links_own_close_does_not(
        own_nats: NatsServerProcess, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    errors: list[str] = []
    link = await _connected_link(own_nats.url, errors)
    await link.close()
    assert not _warned_reconnecting(caplog)
    assert any(r.name == LOGGER and r.getMessage() == "NATS connection closed"
               for r in caplog.records)

    link = await _connected_link(own_nats.url, errors)
    try:
        own_nats.stop()
        for _ in range(100):
            if _warned_reconnecting(caplog):
                break
            await asyncio.sleep(0.05)
        assert _warned_reconnecting(caplog)
        own_nats.start()
        assert await link.wait_connected(10.0)
    finally:
        await link.close()
