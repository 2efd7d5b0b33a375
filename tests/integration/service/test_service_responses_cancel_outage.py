"""A cancel told while one router replica's NATS link is down still ends that replica's
streams once the link is back (responses_cancel_rechecks.py): two real routers on the
real NATS (127.0.0.1:4222, else one the tests start), B through a TCP relay the test
cuts, in front of one stand-in worker in vLLM 0.32's shapes
(test_service_responses_cancel_replicas.py says why not a real vLLM server)."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, suppress
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
from aiohttp import web
from conftest import router_settings, running_router, sample, scrape
from feed_helpers import until
from test_service_responses_api import create, events
from test_service_responses_cancel_replicas import replica_settings
from test_service_responses_faults import MARKED, BackgroundStreamStub, _read_until

from kvhint.router.devstack.ports import listening, reserved_socket

pytestmark = pytest.mark.usefixtures("throwaway_streams")


class NatsRelay:
    """A TCP relay to NATS for one replica, bytes passed on unchanged. Why not the real
    server stopped: the other replica must stay connected and publish meanwhile, and one
    NATS server cannot drop one client and keep another (a cut relay is the real fault a
    network split makes: the client's connection ends, its reconnects are refused)."""

    def __init__(self, nats_url: str) -> None:
        target = urlsplit(nats_url)
        self._host, self._port = target.hostname or "127.0.0.1", target.port or 4222
        # Bound now (a port found free may be taken before a later bind), served at the
        # first open; a reopen after a cut binds the port again.
        self._reserved: socket.socket | None = reserved_socket()
        self.port = self._reserved.getsockname()[1]
        self.url = f"nats://127.0.0.1:{self.port}"
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    async def open(self) -> None:
        if self._reserved is not None:
            reserved, self._reserved = self._reserved, None
            self._server = await asyncio.start_server(self._serve, sock=listening(reserved))
        else:
            self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)

    async def cut(self) -> None:
        """Refuse new connections and end the ones open now."""
        if self._server is not None:
            self._server.close()
            self._server = None
        for writer in list(self._writers):
            writer.close()
        self._writers.clear()

    async def _serve(self, reader: asyncio.StreamReader,
                     writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(self._host, self._port)
        self._writers.update((writer, up_writer))

        async def pipe(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
            with suppress(OSError, asyncio.IncompleteReadError):
                while data := await source.read(65536):
                    sink.write(data)
                    await sink.drain()
            sink.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))


@dataclass
class StatusFailingStub(BackgroundStreamStub):
    """Answers a stored response's GET (not streamed) with 500: a worker that cannot say
    a response's status (the stand-in's, as its other faults are)."""

    status_fails: bool = False

    async def _get(self, request: web.Request) -> web.StreamResponse:
        if self.status_fails and request.query.get("stream") != "true":
            return web.json_response({"error": {"message": "boom"}}, status=500)
        return await super()._get(request)


@pytest.fixture
async def worker(tiny_model_dir: Path) -> AsyncIterator[StatusFailingStub]:
    stub = StatusFailingStub(str(tiny_model_dir))
    await stub.start()
    try:
        yield stub
    finally:
        await stub.stop()


async def test_a_cancel_told_while_a_replica_s_nats_is_down_ends_its_streams_after(
        tmp_path: Path, nats_url: str, subject_prefix: str,
        worker: StatusFailingStub) -> None:
    """A starts a background streamed response; B streams it (GET); B's NATS link goes
    down; the cancel goes through A, its notice lost for B. Once B's link is back, B's
    stream ends within the grace with ``response.failed`` (status cancelled), and so does
    a GET through B opened after (the recovered cancel is remembered). Before, B's stream
    stayed open, silent, until background_idle_s / request_timeout_s."""
    relay = NatsRelay(nats_url)
    await relay.open()
    replicas = replica_settings(tmp_path, worker.url, subject_prefix,
                                (nats_url, relay.url))
    async with AsyncExitStack() as stack:
        stack.push_async_callback(relay.cut)
        a = await stack.enter_async_context(running_router(replicas[0]))
        b = await stack.enter_async_context(running_router(replicas[1]))
        client = await stack.enter_async_context(httpx.AsyncClient(timeout=30))
        for router in (a, b):
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
                await relay.cut()
                await until(lambda: not b.runtime.link.connected)
                cancel = await client.post(f"{a.url}/v1/responses/{response_id}/cancel",
                                           headers=MARKED)
                assert cancel.status_code == 200, cancel.text
                await asyncio.wait_for(reading, 10)  # A's own: its grace
                await asyncio.sleep(1.0)  # past the grace: B heard nothing
                assert not following.done()
                back_at = time.monotonic()
                await relay.open()
                await asyncio.wait_for(following, 10)
                assert time.monotonic() - back_at < 5
        async with client.stream("GET", f"{b.url}/v1/responses/{response_id}",
                                 params={"stream": "true"}) as late:
            later = (await asyncio.wait_for(late.aread(), 10)).decode()
        for text in ("".join(got), later):
            relayed = events(text)
            kind, last = relayed[-1]
            assert kind == "response.failed" and last["sequence_number"] == 3, relayed
            assert last["response"]["status"] == "cancelled"
        on_a, on_b = await scrape(client, a.url), await scrape(client, b.url)
        assert sample(on_a, "kvhint_router_responses_cancel_notices_total",
                      outcome="sent") == 1
        assert sample(on_b, "kvhint_router_responses_cancel_notices_total",
                      outcome="recovered") == 1
        assert not sample(on_b, "kvhint_router_responses_cancel_notices_total",
                          outcome="applied")
        assert sample(on_b, "kvhint_router_responses_cancel_ends_total") == 2
        assert not sample(on_b, "kvhint_router_drops_total",
                          what="response_cancel_recheck_failed")


async def test_a_stream_whose_worker_cannot_say_its_status_after_an_outage_is_counted(
        tmp_path: Path, nats_url: str, subject_prefix: str,
        worker: StatusFailingStub) -> None:
    """A stream open across a NATS outage whose worker does not answer the recheck: a
    drop (a cancel missed meanwhile stays missed); a stream already ended or in a grace
    is not checked."""
    relay = NatsRelay(nats_url)
    await relay.open()
    settings = router_settings(tmp_path, [("w0", worker.url)], nats_url=relay.url,
                               subject_prefix=subject_prefix,
                               responses={"cancel_grace_s": 0.3})
    async with AsyncExitStack() as stack:
        stack.push_async_callback(relay.cut)
        router = await stack.enter_async_context(running_router(settings))
        client = await stack.enter_async_context(httpx.AsyncClient(timeout=30))
        assert await router.runtime.link.wait_set_up(10)
        started = asyncio.Event()
        made: list[str] = []
        async with client.stream("POST", f"{router.url}/v1/responses", json=create(
                background=True, stream=True)) as original:
            reading = asyncio.create_task(_read_until(original, made, started))
            await asyncio.wait_for(started.wait(), 10)
            worker.status_fails = True
            await relay.cut()
            await until(lambda: not router.runtime.link.connected)
            await relay.open()
            assert await router.runtime.link.wait_connected(10)

            samples: dict[tuple[str, frozenset], float] = {}

            async def counted() -> bool:
                samples.update(await scrape(client, router.url))
                return bool(sample(samples, "kvhint_router_drops_total",
                                   what="response_cancel_recheck_failed"))

            deadline = time.monotonic() + 10
            while not await counted():
                assert time.monotonic() < deadline
                await asyncio.sleep(0.1)
            assert not reading.done()  # not ended for it
            reading.cancel()
        assert sample(samples, "kvhint_router_drops_total",
                      what="response_cancel_recheck_failed") == 1
        assert not sample(samples, "kvhint_router_responses_cancel_notices_total",
                          outcome="recovered")


async def test_a_cancel_relayed_while_its_replica_s_nats_is_down_is_told_once_back(
        tmp_path: Path, nats_url: str, subject_prefix: str,
        worker: StatusFailingStub) -> None:
    """A's NATS link is down when the cancel goes through A: its notice is not sent
    (counted), kept, and sent once A's link is back; B's stream (B stayed connected,
    nothing to recheck) then ends within the grace. Before, the notice was lost for good
    and B's stream stayed open until background_idle_s / request_timeout_s."""
    relay = NatsRelay(nats_url)
    await relay.open()
    replicas = replica_settings(tmp_path, worker.url, subject_prefix,
                                (relay.url, nats_url))
    async with AsyncExitStack() as stack:
        stack.push_async_callback(relay.cut)
        a = await stack.enter_async_context(running_router(replicas[0]))
        b = await stack.enter_async_context(running_router(replicas[1]))
        client = await stack.enter_async_context(httpx.AsyncClient(timeout=30))
        for router in (a, b):
            assert await router.runtime.link.wait_set_up(10)
        started, fetched = asyncio.Event(), asyncio.Event()
        made: list[str] = []
        got: list[str] = []
        async with client.stream("POST", f"{a.url}/v1/responses", json=create(
                background=True, stream=True)) as original:
            reading = asyncio.create_task(_read_until(original, made, started))
            await asyncio.wait_for(started.wait(), 10)
            response_id = events("".join(made))[0][1]["response"]["id"]
            async with client.stream("GET", f"{b.url}/v1/responses/{response_id}",
                                     params={"stream": "true"}) as watching:
                following = asyncio.create_task(_read_until(watching, got, fetched))
                await asyncio.wait_for(fetched.wait(), 10)
                await relay.cut()
                await until(lambda: not a.runtime.link.connected)
                cancel = await client.post(f"{a.url}/v1/responses/{response_id}/cancel",
                                           headers=MARKED)
                assert cancel.status_code == 200, cancel.text
                await asyncio.wait_for(reading, 10)
                await asyncio.sleep(1.0)
                assert not following.done()
                await relay.open()
                await asyncio.wait_for(following, 10)
        kind, last = events("".join(got))[-1]
        assert kind == "response.failed" and last["response"]["status"] == "cancelled"
        on_a, on_b = await scrape(client, a.url), await scrape(client, b.url)
        assert sample(on_a, "kvhint_router_drops_total",
                      what="response_cancel_notice_unsent") == 1
        assert sample(on_a, "kvhint_router_responses_cancel_notices_total",
                      outcome="resent") == 1
        assert not sample(on_a, "kvhint_router_responses_cancel_notices_total",
                          outcome="sent")
        assert sample(on_b, "kvhint_router_responses_cancel_notices_total",
                      outcome="applied") == 1
