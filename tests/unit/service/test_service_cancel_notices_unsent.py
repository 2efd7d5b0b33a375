"""Cancel notices not sent for want of a NATS link (responses_cancel_notices.py): kept
to send once the link is back, at most MAX_UNSENT_KEPT, the oldest past it discarded,
counted. A real NatsLink that was never started: not connected, as in an outage."""

from __future__ import annotations

import asyncio

from kvhint.router.service.metrics import RouterMetrics
from kvhint.router.service.nats_link import NatsLink
from kvhint.router.service.responses_cancel_notices import MAX_UNSENT_KEPT, CancelNotices
from kvhint.schemas import Subjects


def test_unsent_notices_are_kept_within_a_bound_and_the_oldest_past_it_counted() -> None:
    async def scenario() -> None:
        metrics = RouterMetrics()
        link = NatsLink("nats://127.0.0.1:4222", Subjects("kvtest"), lambda kind: None,
                        lambda count: None)
        notices = CancelNotices(link, Subjects("kvtest"), metrics)
        for number in range(MAX_UNSENT_KEPT + 1):
            assert not await notices.publish(f"resp_{number}", "default", "w0")
        assert metrics.drops.labels("response_cancel_notice_unsent")._value.get() == (
            MAX_UNSENT_KEPT + 1)
        assert metrics.drops.labels(
            "response_cancel_notice_unsent_discarded")._value.get() == 1
        kept = [notice.response_id for notice in notices._unsent]
        assert kept[0] == "resp_1" and kept[-1] == f"resp_{MAX_UNSENT_KEPT}"
    asyncio.run(scenario())
