"""A cancel relayed by one router replica ends the streams of its response that another
replica relays (responses_cancel_notices.py, schemas/response_cancels.py): two real
routers on the real NATS (127.0.0.1:4222, else one the tests start), each with its own
SQLite store (a cancel needs nothing stored: every replica reads the worker from the id),
in front of one stand-in worker in vLLM 0.32's shapes (test_service_responses_faults.py:
a real vLLM server's background response ends or is cancelled within a fraction of a
second on the CPU, too soon to hold its streams open across replicas)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from pathlib import Path

import httpx
import nats
import pytest
from conftest import router_settings, running_router, sample, scrape
from test_service_responses_api import create, events
from test_service_responses_faults import MARKED, BackgroundStreamStub, _read_until

from kvhint.router.service.settings import RouterSettings
from kvhint.schemas import ResponseCancelled, Subjects, encode_response_cancelled

pytestmark = pytest.mark.usefixtures("throwaway_streams")


def replica_settings(tmp_path: Path, worker_url: str, subject_prefix: str,
                     nats_urls: tuple[str, str]) -> list[RouterSettings]:
    """Replicas "a" and "b" in front of one worker, each with its own store (a folder
    under ``tmp_path``) and its NATS URL (in that order), sharing the salt secret (each
    verifies the ids the other minted) and a short cancel grace."""
    replicas = []
    for name, url in zip(("a", "b"), nats_urls, strict=True):
        (tmp_path / name).mkdir()
        replicas.append(router_settings(
            tmp_path / name, [("w0", worker_url)], nats_url=url,
            subject_prefix=subject_prefix, salt_secret="replicas-share-this-secret",
            responses={"cancel_grace_s": 0.3}))
    return replicas


@pytest.fixture
async def worker(tiny_model_dir: Path) -> AsyncIterator[BackgroundStreamStub]:
    stub = BackgroundStreamStub(str(tiny_model_dir))
    await stub.start()
    try:
        yield stub
    finally:
        await stub.stop()


async def test_a_cancel_through_one_replica_ends_the_other_replica_s_streams(
        tmp_path: Path, nats_url: str, subject_prefix: str,
        worker: BackgroundStreamStub) -> None:
    """A starts a background streamed response; B streams it (GET); the cancel goes
    through A. B's stream ends within the grace with ``response.failed`` (status
    cancelled), and so does a GET through B opened after the cancel (B never relayed
    the response: it knows the cancel from A's notice only). Before, B's streams stayed
    open, silent, until request_timeout_s (600 s): the grace ran on A only. A notice
    that is not one, or names an id not minted for its tenant, ends nothing, counted."""
    replicas = replica_settings(tmp_path, worker.url, subject_prefix,
                                (nats_url, nats_url))
    async with AsyncExitStack() as stack:
        a = await stack.enter_async_context(running_router(replicas[0]))
        b = await stack.enter_async_context(running_router(replicas[1]))
        client = await stack.enter_async_context(httpx.AsyncClient(timeout=30))
        for router in (a, b):
            # Set up: wait_connected comes before the subscriptions and streams.
            assert await router.runtime.link.wait_set_up(10)
        started, fetched = asyncio.Event(), asyncio.Event()
        made: list[str] = []
        got: list[str] = []
        async with client.stream("POST", f"{a.url}/v1/responses", json=create(
                background=True, stream=True)) as original:
            assert original.status_code == 200
            reading = asyncio.create_task(_read_until(original, made, started))
            await asyncio.wait_for(started.wait(), 10)
            response_id = events("".join(made))[0][1]["response"]["id"]
            async with client.stream("GET", f"{b.url}/v1/responses/{response_id}",
                                     params={"stream": "true"}) as watching:
                assert watching.status_code == 200
                following = asyncio.create_task(_read_until(watching, got, fetched))
                await asyncio.wait_for(fetched.wait(), 10)
                cancelled_at = time.monotonic()
                cancel = await client.post(f"{a.url}/v1/responses/{response_id}/cancel",
                                           headers=MARKED)
                assert cancel.status_code == 200, cancel.text
                # B's stream ended by B, well within request_timeout_s.
                await asyncio.wait_for(asyncio.gather(reading, following), 10)
                assert time.monotonic() - cancelled_at < 5
        async with client.stream("GET", f"{b.url}/v1/responses/{response_id}",
                                 params={"stream": "true"}) as late:
            later = (await asyncio.wait_for(late.aread(), 10)).decode()
        for text in ("".join(made), "".join(got), later):
            relayed = events(text)
            assert len(relayed) == 4, relayed
            kind, last = relayed[-1]
            assert kind == "response.failed" and last["sequence_number"] == 3
            assert last["response"]["id"] == response_id
            assert last["response"]["status"] == "cancelled"
        assert len(b.app.state.responses.cancels) == 0
        # Not notices: junk, a forged id (changed tag), another tenant's claim.
        subjects = Subjects(subject_prefix)
        nc = await nats.connect(nats_url)
        stack.push_async_callback(nc.drain)
        forged = response_id[:-1] + ("0" if response_id[-1] != "0" else "1")
        await nc.publish(subjects.cancels("w0"), b"{not json")
        for rid, tenant in ((forged, "default"), (response_id, "other")):
            await nc.publish(subjects.cancels("w0"), encode_response_cancelled(
                ResponseCancelled(origin="outsider", response_id=rid, tenant=tenant,
                                  worker_id="w0", at=time.time())))
        await nc.flush()
        await asyncio.sleep(0.5)
        on_a, on_b = await scrape(client, a.url), await scrape(client, b.url)
        assert sample(on_a, "kvhint_router_responses_cancel_notices_total",
                      outcome="sent") == 1
        assert sample(on_b, "kvhint_router_responses_cancel_notices_total",
                      outcome="applied") == 1
        assert not sample(on_a, "kvhint_router_responses_cancel_notices_total",
                          outcome="applied")  # its own notice: skipped
        assert sample(on_b, "kvhint_router_responses_cancel_ends_total") == 2
        assert sample(on_a, "kvhint_router_responses_cancel_ends_total") == 1
        for samples in (on_a, on_b):
            assert sample(samples, "kvhint_router_drops_total",
                          what="response_cancel_notice_malformed") == 1
            assert sample(samples, "kvhint_router_drops_total",
                          what="response_cancel_notice_unverified") == 2
