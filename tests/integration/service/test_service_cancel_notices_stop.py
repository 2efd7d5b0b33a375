"""Cancel notices still kept unsent when the router stops (responses_cancel_notices.py
``CancelNotices.close``): published before NATS's drain where the link is up, so the
other replicas still end their streams within the grace; lost and counted where it is
down (``drops_total{what="response_cancel_notice_unsent_at_stop"}``). Before, the stop
left them in memory: none sent, the loss in no metric (each counted only
``response_cancel_notice_unsent`` when kept, as if still to be sent).

Real NATS (127.0.0.1:4222, else one the tests start) and a real NatsLink; the stop's
race with the link's return (the resend not yet run) is the link started without the
notices' set-up, since the real race lasts a loop turn."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import nats
from conftest import router_settings, running_router
from test_service_responses_api import ResponsesStub, create
from test_service_responses_faults import MARKED

from kvhint.router.devstack.nats_server import free_port
from kvhint.router.service.metrics import RouterMetrics
from kvhint.router.service.nats_link import NatsLink
from kvhint.router.service.responses_cancel_notices import CancelNotices
from kvhint.schemas import Subjects, decode_response_cancelled

_LOST = "response_cancel_notice_unsent_at_stop"


async def test_notices_kept_at_stop_go_out_where_the_link_is_up(
        nats_url: str, subject_prefix: str) -> None:
    subjects = Subjects(subject_prefix)
    metrics = RouterMetrics()
    link = NatsLink(nats_url, subjects, lambda kind: None, lambda count: None)
    notices = CancelNotices(link, subjects, metrics)
    for number in range(3):  # relayed while the link was down: kept
        assert not await notices.publish(f"resp_{number}", "default", "w0")
    listener = await nats.connect(nats_url)
    heard: list[str] = []

    async def hear(msg: nats.aio.msg.Msg) -> None:
        heard.append(decode_response_cancelled(msg.data).response_id)

    await listener.subscribe(subjects.all_of("cancels"), cb=hear)
    await listener.flush()
    link.start()  # up, the resend not run yet
    try:
        assert await link.wait_connected(10)
        assert await notices.close() == 0
    finally:
        await link.close()  # drains: what close() published goes out
    for _ in range(100):
        if len(heard) == 3:
            break
        await asyncio.sleep(0.05)
    await listener.drain()
    assert heard == ["resp_0", "resp_1", "resp_2"]
    assert metrics.responses_cancel_notices.labels("resent")._value.get() == 3
    assert metrics.drops.labels(_LOST)._value.get() == 0


async def test_notices_kept_when_the_router_stops_without_nats_are_counted_lost(
        tmp_path: Path, tiny_model_dir: Path) -> None:
    """A cancel the worker accepted while the router had no NATS link (nothing listens
    on its nats_url), its notice still kept when the router stops: counted lost."""
    stub = ResponsesStub(str(tiny_model_dir), mode="background")
    await stub.start()
    settings = router_settings(tmp_path, [("w0", stub.url)],
                               nats_url=f"nats://127.0.0.1:{free_port()}")
    try:
        async with running_router(settings) as router, \
                httpx.AsyncClient(timeout=30) as client:
            url = f"{router.url}/v1/responses"
            response_id = (await client.post(url, json=create(background=True))).json()["id"]
            cancel = await client.post(f"{url}/{response_id}/cancel", headers=MARKED)
            assert cancel.status_code == 200, cancel.text
            drops = router.runtime.metrics.drops
            assert drops.labels("response_cancel_notice_unsent")._value.get() == 1
            assert drops.labels(_LOST)._value.get() == 0  # kept, to send later
        assert drops.labels(_LOST)._value.get() == 1  # the router stopped first
    finally:
        await stub.stop()
