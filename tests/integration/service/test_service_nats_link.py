"""The router's NATS link against a real nats-server: losing the server is a warning an
operator should see; the link closing its own connection (shutdown) is not."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import nats
import pytest

from conftest import router_settings, running_router, sample, scrape
from kvhint.router.devstack.nats_server import NatsServerProcess, free_port
from kvhint.router.service.nats_link import NatsLink, remove_streams
from kvhint.schemas import Subjects

LOGGER = "kvhint.router.service.nats_link"


async def _connected_link(url: str, errors: list[str]) -> NatsLink:
    link = NatsLink(url, Subjects("kvhinttest.link"), on_error=errors.append,
                    on_lost=lambda _count: None, retry_s=0.1)

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


async def test_lost_messages_are_told_apart_from_errors_that_lost_none(
        own_nats: NatsServerProcess, subject_prefix: str) -> None:
    """Before, every NATS error was one drop, ``nats_error``: a refused connect, a
    failed setup and messages the client discarded alike, and a failed hint publish
    was counted twice (with the caller's ``hint_unsent``). Now messages the client
    discards (a slow consumer) are reported one by one as lost; a failed publish is left
    to its caller; errors that lose nothing have a kind.

    The server is this test's own, and the subscription is proven live (a first message
    handled) before the burst: a CI run on the shared server once saw none of the burst
    reach the subscription (0 lost, cause not caught), which a burst before the
    subscription took effect would explain."""
    nats_url = own_nats.url
    errors: list[str] = []
    lost: list[int] = []
    link = NatsLink(nats_url, Subjects(subject_prefix), on_error=errors.append,
                    on_lost=lost.append, retry_s=0.1)

    async def nothing() -> None:
        return None

    link.start(nothing)
    assert await link.wait_connected(10.0)
    release = asyncio.Event()
    handled: list[bytes] = []

    async def stuck(msg) -> None:  # noqa: ANN001
        handled.append(msg.data)
        await release.wait()

    publisher = await nats.connect(nats_url)
    try:
        subject = f"{subject_prefix}.slow"
        # A subscription that holds one message waiting: the rest are discarded.
        await link._nc.subscribe(subject, cb=stuck, pending_msgs_limit=1)
        await link._nc.flush()
        # The first message reaches the callback and holds it: the subscription is live.
        firsts = 0
        for _ in range(100):
            await publisher.publish(subject, b"first")
            firsts += 1
            await publisher.flush()
            await asyncio.sleep(0.05)
            if handled:
                break
        assert handled, "the subscription never received a message"
        for n in range(10):
            await publisher.publish(subject, str(n).encode())
        await publisher.flush()
        # One message held by the callback, one in the queue's one place: the rest lost,
        # each reported.
        expected_lost = firsts + 10 - 2
        for _ in range(100):
            if sum(lost) >= expected_lost:
                break
            await asyncio.sleep(0.05)
        assert sum(lost) == expected_lost, (lost, handled, errors, link.connected)
        assert len(handled) == 1
        assert errors == []
        # Over the server's max_payload: refused by the client, not sent.
        assert not await link.publish(f"{subject_prefix}.big", b"x" * (8 << 20))
        assert errors == []
    finally:
        release.set()
        await publisher.close()
        await link.close()


async def test_a_refused_connect_is_a_nats_error_of_its_kind_not_a_drop(
        tmp_path: Path) -> None:
    settings = router_settings(tmp_path, [], nats_url=f"nats://127.0.0.1:{free_port()}")
    async with running_router(settings) as router, httpx.AsyncClient() as client:
        for _ in range(100):
            samples = await scrape(client, router.url)
            if sample(samples, "kvhint_router_nats_errors_total", kind="connect"):
                break
            await asyncio.sleep(0.1)
        assert sample(samples, "kvhint_router_nats_errors_total", kind="connect") >= 1
        assert sample(samples, "kvhint_router_nats_errors_total", kind="setup") == 0
        assert not [labels for name, labels in samples
                    if name == "kvhint_router_drops_total" and ("what", "nats_error") in labels]


async def test_a_nats_url_with_credentials_reaches_no_log_line(
        own_nats: NatsServerProcess, caplog: pytest.LogCaptureFixture) -> None:
    """A password in ``nats_url`` (README: credentials go in the URL) is not logged; a
    comma-separated list is served (its first server refuses: the link goes on to the
    next), as the plugin serves it."""
    caplog.set_level(logging.INFO, logger="kvhint.router")
    refused = f"nats://router:n4ts-pw@127.0.0.1:{free_port()}"
    own = own_nats.url.replace("nats://", "nats://router:n4ts-pw@")
    link = await _connected_link(f"{refused}, {own}", [])
    await link.close()
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "NATS connected: nats://***@127.0.0.1" in logged
    assert "n4ts-pw" not in logged


async def test_a_percent_encoded_password_reaches_nats_decoded_and_no_log_line(
        password_nats: Any, subject_prefix: str, caplog: pytest.LogCaptureFixture) -> None:
    """A password holding '/', '#', '?', '@' and '%' could not be used: nats-py does not
    percent-decode a URL's user info, so the encoded one reached NATS encoded (refused
    at every attempt, the router without NATS). Now the link passes the decoded user and
    password to nats-py, the servers without them (schemas/nats_address.py)."""
    caplog.set_level(logging.INFO, logger="kvhint.router")
    encoded = quote(password_nats.password, safe="")
    url = password_nats.url.replace("nats://", f"nats://{password_nats.user}:{encoded}@")
    errors: list[str] = []
    link = await _connected_link(url, errors)
    received: asyncio.Queue[Any] = asyncio.Queue()
    try:
        subject = f"{subject_prefix}.ping"
        await link.subscribe(subject, received.put)
        await link._nc.flush()
        assert await link.publish(subject, b"ping")
        assert (await asyncio.wait_for(received.get(), 5)).data == b"ping"
        assert errors == []
        await link.ensure_streams()
        await remove_streams(url, Subjects("kvhinttest.link"))  # connects the same way
    finally:
        await link.close()
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert f"NATS connected: nats://***@{password_nats.url.removeprefix('nats://')}" in logged
    for secret in (encoded, password_nats.password, "w%rd", "w%25rd"):
        assert secret not in logged


async def test_an_unexpected_connect_error_is_counted_and_retried(
        own_nats: NatsServerProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    """nats-py raises more than NATS and OS errors when it connects (ValueError or
    AssertionError on a URL it refuses); one ended the link's connect task, and the router
    served on without NATS, nothing counted. The fault is injected (the first connect
    raises): the one known real cause, a URL nats-py refuses, is refused by the settings."""
    from kvhint.router.service import nats_link as nats_link_module

    real_connect = nats_link_module.nats.connect
    calls: list[int] = []

    async def connect_failing_once(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        calls.append(1)
        if len(calls) == 1:
            raise AssertionError("nats-py refused the URL")
        return await real_connect(*args, **kwargs)

    monkeypatch.setattr(nats_link_module.nats, "connect", connect_failing_once)
    errors: list[str] = []
    link = await _connected_link(own_nats.url, errors)
    try:
        assert errors == ["connect"] and len(calls) == 2
    finally:
        await link.close()


async def test_wait_set_up_returns_once_the_set_up_ran_and_its_subscriptions_hold(
        nats_url: str, subject_prefix: str) -> None:
    """wait_connected returns before the set-ups (the feed's streams and subscriptions):
    tests that waited for it and then published lost their message now and then on a
    loaded machine. wait_set_up returns once each set-up ran and the server holds what
    it subscribed (a message published at once reaches it)."""
    link = NatsLink(nats_url, Subjects(subject_prefix), on_error=lambda _kind: None,
                    on_lost=lambda _count: None, retry_s=0.1)
    release, got = asyncio.Event(), asyncio.Queue()

    async def slow_set_up() -> None:
        await release.wait()  # a set-up slow to come, as on a loaded machine

    async def subscribe() -> None:
        await link.subscribe(f"{subject_prefix}.probe", got.put)

    link.start(slow_set_up, subscribe)
    try:
        assert await link.wait_connected(10.0)
        assert not await link.wait_set_up(0.3)
        release.set()
        assert await link.wait_set_up(10.0)
        nc = await nats.connect(nats_url)
        try:
            await nc.publish(f"{subject_prefix}.probe", b"x")
            assert (await asyncio.wait_for(got.get(), 5)).data == b"x"
        finally:
            await nc.drain()
    finally:
        await link.close()
