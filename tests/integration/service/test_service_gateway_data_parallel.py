"""The data-parallel ranks of one vLLM server (``--data-parallel-size N``), each a worker
of its own at the server's one URL: the router reaches each rank with vLLM's
``X-data-parallel-rank`` header, as its heartbeat (over real NATS) names it, never with
a client's; and an address that takes no connection takes every rank there down with it.

The stubs are real HTTP servers on localhost that record the headers they get: what a
real server does with the header (vLLM picks the engine) is vLLM's; what is tested is
what the router sends.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import msgspec
import nats
import pytest
from aiohttp import web

from conftest import StubWorker, router_settings, running_router
from feed_helpers import status as status_wire
from feed_helpers import until
from kvhint.router.devstack.nats_server import free_port
from kvhint.schemas import Subjects, decode_status, encode_status

CHAT = {"model": "stub", "messages": [{"role": "user", "content": "hello there"}],
        "max_tokens": 4}
# What a client sends to steer the request itself: never reaches a worker.
CLIENT_HEADERS = {"X-data-parallel-rank": "7"}


class HeaderWorker(StubWorker):
    """A stub that records each inference request's X-data-parallel-rank (None: absent)."""

    ranks: list[str | None]

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        self.ranks.append(request.headers.get("X-data-parallel-rank"))
        return await super()._answer(request)


def _rank_status(worker_id: str, url: str, http_dp_rank: int | None) -> bytes:
    """The heartbeat of one rank's plugin: a WorkerStatus 1.1 naming its header value."""
    status = decode_status(status_wire(worker_id, "e1", 0, url))
    return encode_status(msgspec.structs.replace(status, http_dp_rank=http_dp_rank))


@pytest.mark.usefixtures("throwaway_streams")
async def test_each_rank_is_reached_with_its_header_and_a_clients_never_passes(
        tmp_path: Path, nats_url: str, subject_prefix: str, tiny_model_dir: Path) -> None:
    """Two ranks of one server heartbeat as gpu-0-dp0 and gpu-0-dp1 at one URL. Before,
    the router sent no header: vLLM balanced each request across its ranks, whatever
    rank's cache the router had chosen. Now each request carries the chosen rank's
    value; a worker without one (a plain vLLM server, configured) gets none, and the
    client's header reaches no worker."""
    server = HeaderWorker(model_root=str(tiny_model_dir))
    plain = HeaderWorker(model_root=str(tiny_model_dir))
    server.ranks, plain.ranks = [], []
    await server.start()
    await plain.start()
    nc = await nats.connect(nats_url)
    subjects = Subjects(subject_prefix)
    try:
        settings = router_settings(tmp_path, [("plain", plain.url)], nats_url=nats_url,
                                   subject_prefix=subject_prefix, health_probe_s=30.0)
        async with running_router(settings) as router, httpx.AsyncClient(timeout=10) as client:
            runtime = router.runtime
            # Set up: wait_connected comes before the subscriptions and streams.
            assert await runtime.link.wait_set_up(10)
            for rank in (0, 1):
                await nc.publish(subjects.status(f"gpu-0-dp{rank}"),
                                 _rank_status(f"gpu-0-dp{rank}", server.url, rank))
            await until(lambda: all(
                (w := runtime.workers.get(f"gpu-0-dp{r}")) is not None and w.plugin_alive
                for r in (0, 1)))
            workers = {w.worker_id: w for w in runtime.workers.all()}
            assert set(workers) == {"plain", "gpu-0-dp0", "gpu-0-dp1"}
            assert [w.worker_id for w in runtime.workers.at_address(server.url)] == [
                "gpu-0-dp0", "gpu-0-dp1"]
            # Only the worker under test is up for each request: the route is certain.
            # (Nothing marks them up again: no request failed, so no probe runs.)
            for only, stub, expected in [("gpu-0-dp1", server, "1"),
                                         ("gpu-0-dp0", server, "0"),
                                         ("plain", plain, None)]:
                for worker_id, worker in workers.items():
                    worker.http_up = worker_id == only
                sent_before = len(stub.ranks)
                response = await client.post(f"{router.url}/v1/chat/completions", json=CHAT,
                                             headers=CLIENT_HEADERS)
                assert response.status_code == 200, response.text
                assert response.headers["x-kvhint-worker"] == only
                assert stub.ranks[sent_before:] == [expected], (only, stub.ranks)
            assert "7" not in server.ranks + plain.ranks
    finally:
        await nc.close()
        await server.stop()
        await plain.stop()


async def test_an_address_that_takes_no_connection_takes_every_rank_there_down(
        tmp_path: Path) -> None:
    """Three ranks of one server whose address refuses connections. Before, one failed
    request marked down the rank it went to, and its retry went to another rank of the
    same dead server: two ranks down, the third still routed to (each further request
    failing there first). Now the first refusal marks every worker at that address down
    (each probed on its own)."""
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    ranks = [(f"gpu-0-dp{r}", dead) for r in range(3)]
    settings = router_settings(tmp_path, ranks, health_probe_s=30.0)
    async with running_router(settings) as router, httpx.AsyncClient(timeout=10) as client:
        response = await client.post(f"{router.url}/v1/chat/completions", json=CHAT)
        assert response.status_code in (502, 503), response.text
        states = [router.runtime.workers.get(worker_id) for worker_id, _ in ranks]
        assert [w.http_up for w in states] == [False, False, False], [
            (w.worker_id, w.last_http_error) for w in states]
        assert sum("(at worker" in w.last_http_error for w in states) == 2


async def test_a_server_that_answers_leaves_the_other_ranks_to_their_own_requests(
        tmp_path: Path, tiny_model_dir: Path) -> None:
    """A 503 is the server's answer to one request, not an address that is gone: only the
    ranks a request went to are marked down (two: the request and its one retry)."""
    busy = StubWorker(mode="status:503", model_root=str(tiny_model_dir))
    await busy.start()
    try:
        ranks = [(f"gpu-0-dp{r}", busy.url) for r in range(3)]
        settings = router_settings(tmp_path, ranks, health_probe_s=30.0)
        async with running_router(settings) as router, \
                httpx.AsyncClient(timeout=10) as client:
            response = await client.post(f"{router.url}/v1/chat/completions", json=CHAT)
            assert response.status_code == 503, response.text
            states = [router.runtime.workers.get(worker_id) for worker_id, _ in ranks]
            assert sorted(w.http_up for w in states) == [False, False, True]
            assert len(busy.received) == 2
    finally:
        await busy.stop()
