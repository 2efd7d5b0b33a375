"""Log lines that quote what a NATS publisher wrote (security review): a heartbeat's
``http_url`` in the worker-id conflict warning, an outcome's ``reason``, a malformed
message's field names (msgspec's error quotes them as they are). Each was formatted with
``%s``: a newline in one started a log line of the publisher's own text, which a log
reader (and a log pipeline splitting on lines) takes for the router's. Now each is
repr'd: one line per record, the hostile text escaped.

The "plugins" are this test publishing on a real NATS server.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

import msgspec
import pytest

from feed_helpers import router_hearing_nats, status, until
from kvhint.schemas import Subjects, new_epoch

pytestmark = pytest.mark.usefixtures("throwaway_streams")

FORGED = "kvhint.router.service.admin_api WARNING forged"
URL_A = f"http://127.0.0.1:1/\n{FORGED} by A"
URL_B = f"http://127.0.0.1:2/\r\n{FORGED} by B"
A1, B1 = new_epoch(1_000.0), new_epoch(2_000.0)


async def test_hostile_wire_strings_cannot_forge_log_lines(
        tmp_path: Path, nats_url: str, subject_prefix: str,
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVHINT_ROUTER_CONFLICT_CONFIRM_S", "0")
    subjects = Subjects(subject_prefix)
    async with router_hearing_nats(tmp_path, nats_url, subject_prefix) as (
            router, _client, nc):
        runtime = router.runtime

        def warned(text: str) -> list[str]:
            return [r.getMessage() for r in caplog.records if text in r.getMessage()]

        with caplog.at_level(logging.WARNING, logger="kvhint"):
            # Two engines under w0, each heartbeat naming a hostile http_url.
            await nc.publish(subjects.status("w0"), status("w0", A1, 0, URL_A))
            await until(lambda: runtime.workers.get("w0") is not None)
            for _ in range(20):
                if runtime.ingestor.conflicting_workers():
                    break
                await nc.publish(subjects.status("w0"), status("w0", B1, 0, URL_B))
                await asyncio.sleep(0.1)
                await nc.publish(subjects.status("w0"), status("w0", A1, 0, URL_A))
                await asyncio.sleep(0.1)
            await until(lambda: bool(warned("two engines heartbeat")))
            # An outcome of a status this router does not know, with a hostile reason.
            await nc.publish(subjects.outcomes("w0"), msgspec.json.encode({
                "message_id": "m1", "action_id": "a1", "action_type": "kv.pin",
                "worker_id": "w0", "status": "superseded", "at": time.time(),
                "reason": f"r\n{FORGED} by an outcome"}))
            # A malformed outcome and hold releases (their lines quote msgspec's error,
            # which may quote the sender's text: repr'd too).
            await nc.publish(subjects.outcomes("w0"), b'{"x\\n%s by a field": 1}'
                             % FORGED.encode())
            await nc.publish(subjects.releases("w0"), b'{"x\\n%s by a release": 1}'
                             % FORGED.encode())
            await until(lambda: len(warned("malformed")) >= 2 and bool(warned("superseded")))
            # Each malformed message is named for its kind and counted once, by its drop.
            outcomes, releases = subjects.outcomes("w0"), subjects.releases("w0")
            assert len(warned(f"malformed outcome on {outcomes!r}")) == 1
            assert len(warned(f"malformed hold releases on {releases!r}")) == 1
            for drop in ("outcome_malformed", "releases_malformed"):
                assert runtime.metrics.drops.labels(drop)._value.get() == 1, drop

        messages = [r.getMessage() for r in caplog.records]
        for message in messages:
            assert "\n" not in message and "\r" not in message, message
        conflict = warned("two engines heartbeat")[0]
        assert repr(URL_A) in conflict and repr(URL_B) in conflict
        # Each hostile text is still there to read, escaped on its record's one line:
        # both refused URLs, the conflict, the outcome's reason.
        assert sum(FORGED in m for m in messages) >= 4, messages
