"""The gateway's view of its workers against stub workers: a hung worker (accepts the
connection, never answers) is found out and marked down, a slow one stays up; a worker
that moved is never routed by its old address's model list; what the router compares
with its cache prediction when a request samples several sequences."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import msgspec
from aiohttp import web

from conftest import StubWorker, router_settings, running_router
from feed_helpers import status as _status_wire
from kvhint.router.service.model_discovery import discover_models
from kvhint.router.service.upstream import UpstreamPool
from kvhint.router.service.workers import WorkerRegistry
from kvhint.schemas import decode_status

CHAT = {"model": "stub", "messages": [{"role": "user", "content": "hello there"}],
        "max_tokens": 4}


async def _metric(client: httpx.AsyncClient, url: str, prefix: str) -> float:
    text = (await client.get(f"{url}/metrics")).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(prefix))


class CountingWorker(StubWorker):
    """A stub that counts the /health probes it answers."""

    health_calls: int = 0

    async def _health(self, request: web.Request) -> web.Response:
        self.health_calls += 1
        return await super()._health(request)


async def test_a_hung_worker_is_marked_down_and_a_slow_one_stays_up(
        tmp_path: Path, tiny_model_dir: Path) -> None:
    """A server that accepts connections and never answers (a hung process, a half-open
    load balancer) gets each request as a 504 after request_timeout_s and was never
    marked down: a timeout is not a failure (the worker may be running the request) and
    the prober only checks workers already down, so it took traffic for good. Two such
    timeouts in a row now have the prober check its /health at once: it fails that too
    and is marked down. A slow worker that times out as often answers /health and
    stays up."""
    hung_conns: list[asyncio.StreamWriter] = []

    async def hold(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        hung_conns.append(writer)  # read nothing, answer nothing

    hung = await asyncio.start_server(hold, "127.0.0.1", 0)
    hung_url = f"http://127.0.0.1:{hung.sockets[0].getsockname()[1]}"
    slow = CountingWorker(answer_delay_s=1.5, model_root=str(tiny_model_dir))
    await slow.start()
    try:
        settings = router_settings(tmp_path, [("hung", hung_url), ("slow", slow.url)],
                                   request_timeout_s=0.3, health_probe_s=30.0)
        async with running_router(settings) as router, httpx.AsyncClient(timeout=10) as client:
            workers = router.runtime.workers
            codes = []
            for number in range(8):
                response = await client.post(f"{router.url}/v1/chat/completions",
                                             json={**CHAT, "session_id": f"s{number}"})
                codes.append(response.status_code)
                await asyncio.sleep(0.05)  # a probe now running gets its turn
            assert set(codes) == {504}, codes
            deadline = time.monotonic() + 4.0
            while workers.get("hung").http_up and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            hung_state, slow_state = workers.get("hung"), workers.get("slow")
            assert not hung_state.http_up and "/health" in hung_state.last_http_error
            assert slow_state.http_up and slow_state.http_failures == 0
            assert slow_state.silent_timeouts >= 2 and slow.health_calls >= 1
            # The slow worker answers in time again: routed to, the hung one is not.
            slow.answer_delay_s = 0.0
            response = await client.post(f"{router.url}/v1/chat/completions", json=CHAT)
            assert response.status_code == 200
            assert response.headers["x-kvhint-worker"] == "slow"
            assert workers.get("slow").silent_timeouts == 0
    finally:
        for writer in hung_conns:
            writer.close()
        hung.close()
        await slow.stop()


def _drops(what: str) -> str:
    return f'kvhint_router_drops_total{{what="{what}"}}'


class SlowListing(StubWorker):
    """A stub whose /v1/models answers only once ``release`` is set."""

    listing_asked: asyncio.Event | None = None
    release: asyncio.Event | None = None

    async def _models(self, request: web.Request) -> web.Response:
        assert self.listing_asked is not None and self.release is not None
        self.listing_asked.set()
        await self.release.wait()
        return await super()._models(request)


async def test_a_moved_worker_is_not_given_its_old_addresses_model_list(
        tmp_path: Path) -> None:
    """A worker heard at an old address moves (its heartbeat names a new http_url) while
    the router is listing the old address's models: the list that comes back describes
    the old address, and landed on the moved worker, so requests for the model its new
    address serves were kept from it (and ones for the old model sent to it). Now a move
    gives the worker a new state: the late list lands on the old one, nobody routes by
    it, and the next listing asks the new address."""
    old = SlowListing(model="old-model")
    old.listing_asked, old.release = asyncio.Event(), asyncio.Event()
    new = StubWorker(model="stub")
    await old.start()
    await new.start()
    pool = UpstreamPool(1.0, 5.0, keepalive_s=1.0)
    await pool.start()
    try:
        settings = router_settings(tmp_path, [])
        registry = WorkerRegistry([])
        registry.on_heartbeat(decode_status(_status_wire("w", "e1", 0, old.url)))
        listing = asyncio.create_task(discover_models(settings, registry, pool))
        await asyncio.wait_for(old.listing_asked.wait(), 5.0)
        moved = msgspec.structs.replace(decode_status(_status_wire("w", "e1", 1, old.url)),
                                        http_url=new.url)
        registry.on_heartbeat(moved)
        old.release.set()
        await listing
        worker = registry.get("w")
        assert worker.url == new.url and worker.served_models is None
        assert registry.not_serving("stub") == frozenset()
        await discover_models(settings, registry, pool)
        assert registry.get("w").served_models == frozenset({"stub"})
    finally:
        await pool.close()
        await old.stop()
        await new.stop()


async def test_parallel_sampling_is_not_compared_with_the_cache_prediction(
        tmp_path: Path, tiny_model_dir: Path) -> None:
    """vLLM runs ``n`` > 1 as n child requests of one prompt: usage counts the prompt
    once (as the router's prediction and dispatched load do), but its cached_tokens is
    one child's, and a child scheduled after its sibling hits the blocks the sibling just
    allocated. So it is counted as usage without a prediction (and the skip as a drop);
    before, a cold prompt's 32 sibling-hit tokens were booked against a prediction of
    0. A request with n = 1 is compared as before."""
    stub = StubWorker(model_root=str(tiny_model_dir))
    await stub.start()
    try:
        settings = router_settings(tmp_path, [("w0", stub.url)])
        async with running_router(settings) as router, httpx.AsyncClient(timeout=10) as client:
            actual = 'kvhint_router_cached_tokens_actual_total{predicted="%s",worker="w0"}'
            for stream in (False, True):
                response = await client.post(f"{router.url}/v1/chat/completions", json={
                    **CHAT, "n": 2, "stream": stream, "session_id": f"s{stream}"})
                assert response.status_code == 200
            assert await _metric(client, router.url, actual % "true") == 0
            assert await _metric(client, router.url, actual % "false") == 64
            assert await _metric(client, router.url, _drops(
                "cached_prediction_unchecked:parallel_sampling")) == 2
            assert await _metric(client, router.url, "kvhint_router_prompt_tokens_total") == 80
            response = await client.post(f"{router.url}/v1/chat/completions",
                                         json={**CHAT, "session_id": "s-one"})
            assert response.status_code == 200
            assert await _metric(client, router.url, actual % "true") == 32
    finally:
        await stub.stop()
