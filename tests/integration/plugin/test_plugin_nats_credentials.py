"""The plugin's transport against a real nats-server that requires a user and password
holding '/', '#', '?', '@' and '%' (the password_nats fixture).

Before, such a password could not be used: nats-py does not percent-decode a URL's user
info, so the encoded password reached NATS encoded (an authorization violation at every
attempt, the engine without NATS for good), and the password written as it is was
refused at start-up, or parsed to another host. Now the plugin decodes it and passes
user and password to nats-py separately, the servers stripped of them
(schemas/nats_address.py)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any
from urllib.parse import quote

import nats
import pytest
from scheduler_fixtures import nats_plugin as plugin
from scheduler_fixtures import plugin_log_lines, until

from kvhint.schemas import Subjects, decode_status


@pytest.fixture(autouse=True)
def _quiet_nats_logs(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR, logger="nats")


@pytest.mark.parametrize("given_as", ["nats_url", "nats_url_env"])
async def test_a_percent_encoded_password_reaches_nats_decoded_and_no_log_line(
        password_nats: Any, subject_prefix: str, given_as: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    encoded = quote(password_nats.password, safe="")
    url = password_nats.url.replace("nats://", f"nats://{password_nats.user}:{encoded}@")
    monkeypatch.setenv("KVHINT_TEST_NATS_URL", url)
    given = {"nats_url_env": "KVHINT_TEST_NATS_URL"} if given_as == "nats_url_env" else {}
    subjects = Subjects(subject_prefix)
    # The server takes this password given as it is, out of a URL.
    nc = await nats.connect(password_nats.url, user=password_nats.user,
                            password=password_nats.password, max_reconnect_attempts=0)
    try:
        beats: asyncio.Queue[Any] = asyncio.Queue()
        await nc.subscribe(subjects.status("w0"), cb=beats.put)
        with plugin_log_lines() as lines:
            with plugin(url if not given else None, subject_prefix,
                        create_events_stream=False, **given) as h:
                await until(lambda: h.connector.transport.connected)
                beat = decode_status((await asyncio.wait_for(beats.get(), 5)).data)
                assert beat.worker_id == "w0"
                assert h.connector.transport.counters.connects == 1
        logged = "\n".join(lines)
        assert f"connected to NATS {password_nats.url}" in logged
        for secret in (encoded, password_nats.password, "w%rd", "w%25rd"):
            assert secret not in logged
    finally:
        await nc.drain()


async def test_a_wrong_password_is_named_as_the_cause_not_an_unreachable_server(
        password_nats: Any, subject_prefix: str) -> None:
    """With a wrong NATS password, nats-py reports the authorization violation to the
    error callback and keeps retrying inside its connect, so the attempt ran out of time:
    the plugin's warning said the server was "unreachable (no connection within 5s)",
    after an error line naming the real cause. The warning now names the last
    connection error the attempt saw (the authorization violation)."""
    url = password_nats.url.replace("nats://", f"nats://{password_nats.user}:wrong-pw@")
    with plugin_log_lines() as lines:
        with plugin(url, subject_prefix, create_events_stream=False) as h:
            await until(lambda: any("retrying in the background" in line for line in lines),
                        timeout_s=15)
            assert not h.connector.transport.connected
    (warning,) = [line for line in lines if "retrying in the background" in line]
    assert "refused the connection: nats: 'Authorization Violation'" in warning, warning
    assert "unreachable" not in warning and "wrong-pw" not in "\n".join(lines)
