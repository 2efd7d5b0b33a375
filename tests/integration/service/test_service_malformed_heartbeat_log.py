"""A heartbeat that does not decode (a plugin sending budgets out of bounds) was counted
(``malformed_messages``) but never logged, unlike a malformed outcome or hold releases: the
worker looked dead apart from a counter. Now it is logged at WARNING, repr'd and cut
short as theirs are, the first per subject and then at most once per
``malformed_status_log.every_s`` (a minute; heartbeats come every second), saying how
many were held back in between.

The "plugins" are this test publishing on a real NATS server.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import msgspec
import pytest

from feed_helpers import router_hearing_nats, status, until
from kvhint.schemas import Subjects

pytestmark = pytest.mark.usefixtures("throwaway_streams")

FORGED = "kvhint.router.service.admin_api WARNING forged"


def out_of_bounds(worker: str) -> bytes:
    """``worker``'s heartbeat with a pin TTL past the schema's bound (86400 s)."""
    beat = msgspec.json.decode(status(worker, "e1", 0))
    beat["budgets"]["max_pin_ttl_s"] = 10**7
    return msgspec.json.encode(beat)


async def test_malformed_heartbeats_are_logged_per_subject_at_most_once_a_while(
        tmp_path: Path, nats_url: str, subject_prefix: str,
        caplog: pytest.LogCaptureFixture) -> None:
    subjects = Subjects(subject_prefix)
    async with router_hearing_nats(tmp_path, nats_url, subject_prefix) as (router, _, nc):
        runtime = router.runtime

        def malformed() -> int:
            return runtime.ingestor.stats().malformed_messages

        def logged(subject: str) -> list[str]:
            return [r.getMessage() for r in caplog.records
                    if r.getMessage().startswith(f"malformed heartbeat on {subject!r}")]

        w0, w1 = subjects.status("w0"), subjects.status("w1")
        with caplog.at_level(logging.WARNING, logger="kvhint"):
            for _ in range(3):
                await nc.publish(w0, out_of_bounds("w0"))
            await until(lambda: malformed() == 3)
            # The first logged, naming the budget; the two after it only counted.
            (first,) = logged(w0)
            assert "max_pin_ttl_s" in first and "(0 more since" in first, first
            # Another subject's first is logged at once; a hostile one stays on one line.
            await nc.publish(w1, b'{"x\\n%s by a heartbeat": 1}' % FORGED.encode())
            await until(lambda: malformed() == 4)
            assert len(logged(w1)) == 1 and len(logged(w0)) == 1
            # Once the throttle's while has passed, w0's next is logged with the count of
            # those held back.
            runtime.feed.malformed_status_log.every_s = 0.5
            await asyncio.sleep(0.6)
            await nc.publish(w0, out_of_bounds("w0"))
            await until(lambda: len(logged(w0)) == 2)
            assert "(2 more since" in logged(w0)[1], logged(w0)
        for message in (r.getMessage() for r in caplog.records):
            assert "\n" not in message and "\r" not in message, message
        # A well-formed heartbeat still makes the worker live (nothing else changed).
        await nc.publish(w0, status("w0", "e1", 0))
        await until(lambda: runtime.ingestor.live_workers() == ("w0",))
