"""The address a heartbeat gives a worker the router is not configured with
(``http_url``): whoever publishes on ``<prefix>.v1.status.<w>`` names it, and the router
routes client prompts there with the fleet's ``worker_api_key``. Before, any URL was
taken (any scheme, any host). Now the form is checked always, and the host against
``heartbeat_worker_hosts`` (none given: a private network's addresses only); a refused
URL gives the worker no address (nothing is sent there, the key least of all), is
counted (``drops_total{what="worker_url_refused"}``) and logged once per worker.

Real router, real NATS (the session's server), a real HTTP server recording what reaches
it and the Authorization it carries."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import nats
import pytest
from aiohttp import web

from conftest import StubWorker, router_settings, running_router, sample, scrape, serving
from feed_helpers import status, until
from kvhint.schemas import Subjects

KEY = "fleet-key-never-to-leave"
CHAT = {"model": "stub", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@dataclass
class RecordingWorker(StubWorker):
    """A stub recording every request's path and Authorization header."""

    seen: list[tuple[str, str | None]] = field(default_factory=list)

    def _middlewares(self) -> list[Any]:
        @web.middleware
        async def record(request: web.Request, handler: Any) -> web.StreamResponse:
            self.seen.append((request.path, request.headers.get("Authorization")))
            return await handler(request)

        return [record]


async def _beat(nc: Any, subjects: Subjects, worker: str, url: str, times: int) -> None:
    for seq in range(times):
        await nc.publish(subjects.status(worker), status(worker, "e1", seq, url=url))
    await nc.flush()


async def _refused(client: httpx.AsyncClient, url: str) -> float:
    samples = await scrape(client, url)
    return sample(samples, "kvhint_router_drops_total", what="worker_url_refused") or 0.0


async def _until_refused(client: httpx.AsyncClient, url: str, count: float) -> None:
    for _ in range(200):
        if await _refused(client, url) >= count:
            break
        await asyncio.sleep(0.05)
    assert await _refused(client, url) == count


@asynccontextmanager
async def _router(tmp_path: Path, nats_url: str, prefix: str, **extra: Any
                  ) -> AsyncIterator[tuple[Any, httpx.AsyncClient, Any]]:
    """A router with no configured worker and worker_api_key set, linked to NATS; an
    HTTP client; a NATS client publishing as plugins do."""
    settings = router_settings(tmp_path, [], nats_url=nats_url, subject_prefix=prefix,
                               worker_api_key=KEY, health_probe_s=0.2, **extra)
    nc = await nats.connect(nats_url)
    try:
        async with running_router(settings) as router, \
                httpx.AsyncClient(timeout=10) as client:
            # Set up: wait_connected comes before the subscriptions and streams.
            assert await router.runtime.link.wait_set_up(10)
            yield router, client, nc
    finally:
        await nc.drain()


async def test_a_heartbeat_outside_the_allowed_hosts_gets_no_address_and_no_key(
        tmp_path: Path, nats_url: str, subject_prefix: str, throwaway_streams: None,
        caplog: pytest.LogCaptureFixture) -> None:
    """w0's heartbeats name a server as ``localhost``, w1's another as ``127.0.0.1``;
    only 127.0.0.1 is allowed. Before, w0 was routed to (probed, asked for its models,
    sent chats) with the fleet key. Now w0 is known (its plugin heard) but has no
    address, nothing reaches its server; each of its three heartbeats is counted, one
    warning logged. w1 is routed to, with the key."""
    subjects = Subjects(subject_prefix)
    async with serving([RecordingWorker(), RecordingWorker()]) as (w0_server, w1_server), \
            _router(tmp_path, nats_url, subject_prefix,
                    heartbeat_worker_hosts="127.0.0.1") as (router, client, nc):
        runtime = router.runtime
        with caplog.at_level(logging.WARNING, "kvhint.router.service.cluster_feed"):
            await _beat(nc, subjects, "w0", f"http://localhost:{w0_server.port}", 3)
            await _until_refused(client, router.url, 3)
        w0 = runtime.workers.get("w0")
        assert w0 is not None and w0.plugin_alive and w0.url is None
        warnings = [r.getMessage() for r in caplog.records
                    if "w0" in r.getMessage() and "refused" in r.getMessage()]
        assert len(warnings) == 1, warnings
        assert "heartbeat_worker_hosts" in warnings[0] and KEY not in caplog.text

        await _beat(nc, subjects, "w1", w1_server.url, 1)
        await until(lambda: (w := runtime.workers.get("w1")) is not None
                    and w.url == w1_server.url)
        for _ in range(3):
            answer = await client.post(f"{router.url}/v1/chat/completions", json=CHAT)
            assert answer.status_code == 200, answer.text
            assert answer.headers["x-kvhint-worker"] == "w1"
        models = await client.get(f"{router.url}/v1/models")
        assert models.status_code == 200
        await asyncio.sleep(0.5)  # w0's probes, were it routable, would be in by now
        assert ("/v1/chat/completions", f"Bearer {KEY}") in w1_server.seen
        assert w0_server.seen == []


async def test_a_heartbeats_url_of_another_form_or_a_public_host_is_refused_by_default(
        tmp_path: Path, nats_url: str, subject_prefix: str, throwaway_streams: None) -> None:
    """With heartbeat_worker_hosts unset: a scheme other than http(s), a user and
    password in the URL, a public IP and a dotted (public DNS) name are refused (each
    heartbeat counted); a private IP is taken. Before, each was the worker's address."""
    subjects = Subjects(subject_prefix)
    refused = ["file:///etc/passwd", "ftp://10.0.0.5:21", "http://u:p@10.0.0.5:8000",
               "http://93.184.215.14:8000", "https://collector.example.com",
               "http://10.0.0.5:8000/v1?x=1"]
    async with _router(tmp_path, nats_url, subject_prefix) as (router, client, nc):
        workers = router.runtime.workers
        for index, url in enumerate(refused):
            await _beat(nc, subjects, f"r{index}", url, 1)
        await _until_refused(client, router.url, len(refused))
        for index, url in enumerate(refused):
            worker = workers.get(f"r{index}")
            assert worker is not None and worker.url is None, url
        await _beat(nc, subjects, "ok", "http://10.1.2.3:8000", 1)
        await until(lambda: (w := workers.get("ok")) is not None
                    and w.url == "http://10.1.2.3:8000")
        assert await _refused(client, router.url) == len(refused)


async def test_no_heartbeat_gives_an_address_when_learning_is_off(
        tmp_path: Path, nats_url: str, subject_prefix: str, throwaway_streams: None) -> None:
    """learn_workers_from_heartbeats false: a heartbeat naming even an allowed address
    gives the worker none (before the setting, there was no way to say so)."""
    subjects = Subjects(subject_prefix)
    async with serving([RecordingWorker()]) as (server,), \
            _router(tmp_path, nats_url, subject_prefix,
                    learn_workers_from_heartbeats=False) as (router, client, nc):
        await _beat(nc, subjects, "w0", server.url, 2)
        await _until_refused(client, router.url, 2)
        w0 = router.runtime.workers.get("w0")
        assert w0 is not None and w0.plugin_alive and w0.url is None
        await asyncio.sleep(0.5)
        assert server.seen == []


async def test_a_stored_address_the_hosts_no_longer_allow_is_not_restored(
        tmp_path: Path, nats_url: str, subject_prefix: str, throwaway_streams: None) -> None:
    """A worker learnt at 127.0.0.1 is stored; the router restarts with
    heartbeat_worker_hosts narrowed to another network. Before, the stored address came
    back (asked for its models at start, probed, routed to, with the key) though no
    heartbeat could give it now. Now it does not come back."""
    subjects = Subjects(subject_prefix)
    async with serving([RecordingWorker()]) as (server,):
        async with _router(tmp_path, nats_url, subject_prefix) as (router, client, nc):
            await _beat(nc, subjects, "w0", server.url, 1)
            await until(lambda: (w := router.runtime.workers.get("w0")) is not None
                        and w.url == server.url)
            await asyncio.sleep(0.3)  # the store's writer flushes every 0.05 s
        server.seen.clear()
        settings = router_settings(tmp_path, [], nats_url=None, worker_api_key=KEY,
                                   health_probe_s=0.2, heartbeat_worker_hosts="10.0.0.0/8")
        async with running_router(settings) as router:
            assert router.runtime.workers.get("w0") is None
            await asyncio.sleep(0.5)
        assert server.seen == []


async def test_a_heartbeat_cannot_move_a_learnt_worker_to_a_refused_address(
        tmp_path: Path, nats_url: str, subject_prefix: str, throwaway_streams: None) -> None:
    """w0 is learnt at 127.0.0.1; a heartbeat on its subject then names a public host.
    Before, w0 moved there (the next chat, and the key, went to it). Now w0 keeps the
    address it had and still serves; the heartbeat is counted."""
    subjects = Subjects(subject_prefix)
    async with serving([RecordingWorker()]) as (server,), \
            _router(tmp_path, nats_url, subject_prefix) as (router, client, nc):
        workers = router.runtime.workers
        await _beat(nc, subjects, "w0", server.url, 1)
        await until(lambda: (w := workers.get("w0")) is not None and w.url == server.url)
        await nc.publish(subjects.status("w0"),
                         status("w0", "e1", 1, url="https://collector.example.net"))
        await nc.flush()
        await _until_refused(client, router.url, 1)
        assert workers.get("w0").url == server.url
        answer = await client.post(f"{router.url}/v1/chat/completions", json=CHAT)
        assert answer.status_code == 200 and len(server.received) == 1
