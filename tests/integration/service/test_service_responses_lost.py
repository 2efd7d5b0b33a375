"""A background response whose run ended without its answer, read by ``GET
/v1/responses/{id}`` (responses_background.py): answered ``failed`` with an error where
the router knows it (its worker restarted, left or forgot it; a stream of it relayed
vLLM's ``error`` event), as OpenAI ends a background response its run lost. Before, the
GET said ``queued`` for good (vLLM's store after an error event), or a bare 404.

Stand-in workers in vLLM 0.32's shapes (test_service_responses_api.py): a worker's
restart is a stand-in stopped and started again on its port with its store emptied, and
its engine's restart a heartbeat with a new epoch (a real server's restart takes minutes
and its background run on a CPU ends within a second)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import nats
import pytest
from conftest import router_settings, running_router, sample, scrape
from feed_helpers import status, until
from test_service_responses_api import ResponsesStub, create, events
from test_service_responses_faults import BackgroundStreamStub

from kvhint.schemas import Subjects
from kvhint.schemas.status import new_epoch


async def test_a_background_response_its_worker_forgot_reads_failed(
        tmp_path: Path, tiny_model_dir: Path) -> None:
    """A worker without the plugin's heartbeat (no epoch) restarts: its store is gone and
    it answers 404. A background response the router relayed queued and never saw end
    reads ``failed`` (plain and streamed GET); one it saw complete stays the worker's 404
    (its answer was had), as does a response not run in the background."""
    stub = ResponsesStub(str(tiny_model_dir), mode="background")
    await stub.start()
    settings = router_settings(tmp_path, [("w0", stub.url)])
    try:
        async with running_router(settings) as router, \
                httpx.AsyncClient(timeout=30) as client:
            url = f"{router.url}/v1/responses"
            running = (await client.post(url, json=create(background=True))).json()
            done = (await client.post(url, json=create(background=True))).json()
            assert running["status"] == done["status"] == "queued"
            stub.store[done["id"]]["status"] = "completed"  # its run ends
            assert (await client.get(f"{url}/{done['id']}")).json()["status"] == "completed"
            stub.mode = "ok"
            plain = (await client.post(url, json=create())).json()
            queued = await client.get(f"{url}/{running['id']}")
            assert queued.json()["status"] == "queued"  # still running: the worker's word
            await stub.stop()  # restarted on its port, its store gone with the process
            stub.store.clear()
            await stub.start()
            await until(lambda: router.runtime.workers.get("w0").routable)
            got = await client.get(f"{url}/{running['id']}")
            assert got.status_code == 200, got.text
            answer = got.json()
            assert answer["id"] == running["id"] and answer["status"] == "failed"
            assert answer["model"] == "stub" and answer["background"] is True
            assert isinstance(answer["created_at"], int)
            assert answer["error"]["code"] == "server_error"
            assert "(w0) no longer holds it" in answer["error"]["message"]
            async with client.stream("GET", f"{url}/{running['id']}",
                                     params={"stream": "true"}) as streamed:
                assert streamed.headers["content-type"].startswith("text/event-stream")
                told = events((await asyncio.wait_for(streamed.aread(), 10)).decode())
            assert [kind for kind, _d in told] == ["response.failed"]
            assert told[0][1]["response"]["status"] == "failed"
            for kept in (done["id"], plain["id"]):  # the worker's 404, as before
                assert (await client.get(f"{url}/{kept}")).status_code == 404
            samples = await scrape(client, router.url)
            assert sample(samples, "kvhint_router_responses_read_failed_total",
                          reason="worker_forgot") == 2
            assert sample(samples, "kvhint_router_response_id_requests_total", op="get",
                          code="404") == 2
    finally:
        await stub.stop()


async def test_a_background_response_whose_stream_failed_reads_failed(
        tmp_path: Path, tiny_model_dir: Path) -> None:
    """vLLM's background stream ends in an ``error`` event (a failed generation) and its
    store keeps the response ``queued`` for good: the router, which relayed the event,
    answers a later GET ``failed`` with that event's error, the rest of the worker's
    answer kept."""
    stub = BackgroundStreamStub(str(tiny_model_dir))
    stub.fail = True
    await stub.start()
    settings = router_settings(tmp_path, [("w0", stub.url)])
    try:
        async with running_router(settings) as router, \
                httpx.AsyncClient(timeout=30) as client:
            url = f"{router.url}/v1/responses"
            async with client.stream("POST", url, json=create(
                    background=True, stream=True)) as original:
                made = events((await asyncio.wait_for(original.aread(), 10)).decode())
            assert made[-1][0] == "error"
            response_id = made[0][1]["response"]["id"]
            assert stub.store[response_id]["status"] == "queued"  # vLLM's, for good
            got = await client.get(f"{url}/{response_id}")
            assert got.status_code == 200, got.text
            answer = got.json()
            assert answer["status"] == "failed" and answer["model"] == "stub"
            assert answer["error"] == {"code": "server_error", "message": "boom"}
            samples = await scrape(client, router.url)
            assert sample(samples, "kvhint_router_responses_read_failed_total",
                          reason="stream_error") == 1
    finally:
        await stub.stop()


@pytest.mark.usefixtures("throwaway_streams")
async def test_a_background_response_whose_engine_restarted_reads_failed(
        tmp_path: Path, tiny_model_dir: Path, nats_url: str, subject_prefix: str) -> None:
    """The worker's heartbeat says its engine restarted (a new epoch): the router sends
    nothing on (the response went with the process) and answers the GET of a background
    response it relayed queued ``failed``; a cancel of it is the 404 saying so, as any
    response's."""
    stub = ResponsesStub(str(tiny_model_dir), mode="background")
    await stub.start()
    settings = router_settings(tmp_path, [("w0", stub.url)], nats_url=nats_url,
                               subject_prefix=subject_prefix)
    subjects = Subjects(subject_prefix)
    nc = await nats.connect(nats_url)
    try:
        async with running_router(settings) as router, \
                httpx.AsyncClient(timeout=30) as client:
            assert await router.runtime.link.wait_set_up(10)
            first = new_epoch(time.time())
            await nc.publish(subjects.status("w0"), status("w0", first, 0, url=stub.url))
            await until(lambda: router.runtime.workers.get("w0").epoch == first)
            url = f"{router.url}/v1/responses"
            running = (await client.post(url, json=create(background=True))).json()
            assert running["status"] == "queued"
            again = new_epoch(time.time() + 1)
            await nc.publish(subjects.status("w0"), status("w0", again, 1, url=stub.url))
            await until(lambda: router.runtime.workers.get("w0").epoch == again)
            fetched = len(stub.fetched)
            got = await client.get(f"{url}/{running['id']}")
            assert got.status_code == 200, got.text
            assert got.json()["status"] == "failed"
            assert "(w0) restarted before it ended" in got.json()["error"]["message"]
            cancel = await client.post(f"{url}/{running['id']}/cancel",
                                       headers={"Authorization": "Bearer x"})
            assert cancel.status_code == 404
            assert "has restarted since" in cancel.json()["error"]["message"]
            assert len(stub.fetched) == fetched  # nothing sent to the worker
            samples = await scrape(client, router.url)
            assert sample(samples, "kvhint_router_responses_read_failed_total",
                          reason="worker_restarted") == 1
            assert sample(samples, "kvhint_router_response_id_misses_total",
                          reason="worker_restarted") == 2
    finally:
        await nc.drain()
        await stub.stop()
