"""``/ready`` (readiness) against ``/health`` (liveness): a router is ready once a worker it
would route to has answered it; one that could only answer 503 is alive but not ready."""

from __future__ import annotations

from pathlib import Path

import httpx

from conftest import StubWorker, router_settings, running_router

CHAT = {"model": "stub", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}


async def test_not_ready_until_a_worker_answered_and_not_once_all_are_down(
        tmp_path: Path) -> None:
    settings = router_settings(tmp_path, [("dead", "http://127.0.0.1:9")])  # refused
    async with running_router(settings) as router, httpx.AsyncClient() as client:
        assert (await client.get(f"{router.url}/health")).status_code == 200
        ready = await client.get(f"{router.url}/ready")
        assert ready.status_code == 503
        assert ready.json() == {"status": "not_ready", "reason": "no worker has answered yet",
                                "known_workers": 1}
        response = await client.post(f"{router.url}/v1/chat/completions", json=CHAT)
        assert response.status_code == 502
        ready = await client.get(f"{router.url}/ready")
        assert ready.status_code == 503 and ready.json()["reason"] == "every known worker is down"
        assert (await client.get(f"{router.url}/health")).status_code == 200


async def test_ready_with_a_worker_that_listed_its_models(
        tmp_path: Path, stub_workers: list[StubWorker]) -> None:
    settings = router_settings(tmp_path, [("w0", stub_workers[0].url),
                                          ("dead", "http://127.0.0.1:9")])
    async with running_router(settings) as router, httpx.AsyncClient() as client:
        ready = await client.get(f"{router.url}/ready")
        assert ready.status_code == 200
        assert ready.json() == {"status": "ready", "ready_workers": 1}


async def test_not_ready_with_no_worker_known(tmp_path: Path) -> None:
    settings = router_settings(tmp_path, [])
    async with running_router(settings) as router, httpx.AsyncClient() as client:
        ready = await client.get(f"{router.url}/ready")
        assert ready.status_code == 503
        assert ready.json()["reason"] == "no worker configured or heard from yet"


async def test_a_worker_that_moved_is_not_ready_until_it_answers_at_its_new_address(
        tmp_path: Path, stub_workers: list[StubWorker]) -> None:
    """A worker learnt from its heartbeats served a request, then moved (a new pod
    address). Before, its request count (the worker's, carried over) made the router
    ready at an address that had never answered; now readiness is per address."""
    moved_to = stub_workers[1]
    await moved_to.stop()  # nothing answers there yet
    settings = router_settings(tmp_path, [])
    async with running_router(settings) as router, httpx.AsyncClient() as client:
        workers = router.runtime.workers
        workers.ensure("w0", stub_workers[0].url)  # as a heartbeat would
        assert (await client.get(f"{router.url}/ready")).status_code == 503
        served = await client.post(f"{router.url}/v1/chat/completions", json=CHAT)
        assert served.status_code == 200, served.text
        assert (await client.get(f"{router.url}/ready")).status_code == 200
        workers.ensure("w0", moved_to.url)  # its next heartbeat names a new address
        assert workers.get("w0").requests == 1
        ready = await client.get(f"{router.url}/ready")
        assert ready.status_code == 503, ready.text
        assert ready.json()["reason"] == "no worker has answered yet"
        # It answers there: its next response makes the router ready again.
        await moved_to.start()
        served = await client.post(f"{router.url}/v1/chat/completions", json=CHAT)
        assert served.status_code == 200, served.text
        assert (await client.get(f"{router.url}/ready")).status_code == 200


async def test_not_ready_is_an_error_answer_never_sniffed(tmp_path: Path) -> None:
    """The 503 carries ``X-Content-Type-Options: nosniff`` as the router's other error
    answers do (refusal_headers); before, it alone did not, on the origin that serves
    the dashboard."""
    settings = router_settings(tmp_path, [("dead", "http://127.0.0.1:9")])
    async with running_router(settings) as router, httpx.AsyncClient() as client:
        ready = await client.get(f"{router.url}/ready")
        assert ready.status_code == 503
        assert ready.headers["content-type"] == "application/json"
        assert ready.headers["x-content-type-options"] == "nosniff"
        assert ready.json()["status"] == "not_ready"
