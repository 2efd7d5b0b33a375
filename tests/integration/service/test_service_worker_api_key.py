"""Workers whose vLLM runs with ``--api-key`` (it then requires ``Authorization: Bearer``):
the router sends each worker its key (``workers[].api_key``, else ``worker_api_key``) on
every request it makes to it, forwarded inference, ``/v1/models`` (the start-up discovery
and the client-facing union) and ``/health`` probes; a client's own key never reaches a
worker; the keys appear in no admin API answer, setting dump or log line.

The workers here are small aiohttp servers requiring the key as vLLM's middleware does
(401 without it), here on /health too so the probes are checked: a real vLLM server with
``--api-key`` would be one more engine start (tens of seconds of the suite's 2 cores)
for a check of one header, which the shared vLLM fixtures cannot give.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from aiohttp import web

from conftest import StubWorker, router_settings, running_router, serving
from kvhint.router.service.settings import RouterSettings

CHAT = {"model": "stub", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@dataclass
class KeyedWorker(StubWorker):
    """A stub worker that records every request's Authorization header and, with a
    ``key``, answers 401 to any request without ``Bearer <key>``."""

    key: str | None = None
    seen: list[tuple[str, str | None]] = field(default_factory=list)

    def _middlewares(self) -> list[Any]:
        @web.middleware
        async def require_key(request: web.Request, handler: Any) -> web.StreamResponse:
            authorization = request.headers.get("Authorization")
            self.seen.append((request.path, authorization))
            if self.key is not None and authorization != f"Bearer {self.key}":
                return web.json_response({"error": "Unauthorized"}, status=401)
            return await handler(request)

        return [require_key]


@pytest.fixture
async def keyed(tiny_model_dir: Path) -> AsyncIterator[list[KeyedWorker]]:
    async with serving([KeyedWorker(model_root=str(tiny_model_dir), key="worker-secret-0"),
                        KeyedWorker(model_root=str(tiny_model_dir), key="fleet-secret")]
                       ) as workers:
        yield workers


def keyed_settings(tmp_path: Path, workers: list[dict[str, str]], **extra: Any
                   ) -> RouterSettings:
    """router_settings' test defaults, with workers that may have an ``api_key``."""
    base = router_settings(tmp_path, []).model_dump()
    return RouterSettings(**{**base, "workers": workers, **extra})


async def _until(predicate: Any, timeout_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.05)


async def test_each_worker_gets_its_key_on_every_request_and_never_a_tenants(
        tmp_path: Path, keyed: list[KeyedWorker], caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    w0, w1 = keyed
    settings = keyed_settings(
        tmp_path, [{"id": "w0", "url": w0.url, "api_key": "worker-secret-0"},
                   {"id": "w1", "url": w1.url}],
        worker_api_key="fleet-secret", admin_keys=["root"],
        tenants=[{"name": "a", "api_keys": ["tenant-key"]}])
    tenant = {"authorization": "Bearer tenant-key"}
    admin = {"authorization": "Bearer root"}
    async with running_router(settings) as router, httpx.AsyncClient() as client:
        runtime = router.runtime
        # Start-up discovery listed both workers' models with their keys.
        assert all(runtime.workers.get(w).served_models == {"stub"} for w in ("w0", "w1"))
        for number in range(6):
            response = await client.post(f"{router.url}/v1/chat/completions", headers=tenant,
                                         json={**CHAT, "session_id": f"s{number}"})
            assert response.status_code == 200, response.text
        models = await client.get(f"{router.url}/v1/models", headers=tenant)
        assert [m["id"] for m in models.json()["data"]] == ["stub"]
        # Both workers fail a request (503): marked down, probed on /health, back up
        # only if the probes carry their keys.
        w0.mode = w1.mode = "status:503"
        await client.post(f"{router.url}/v1/chat/completions", headers=tenant, json=CHAT)
        assert not any(runtime.workers.get(w).http_up for w in ("w0", "w1"))
        w0.mode = w1.mode = "ok"
        await _until(lambda: all(runtime.workers.get(w).http_up for w in ("w0", "w1")))
        shown = [(await client.get(f"{router.url}{path}", headers=admin)).text
                 for path in ("/admin/workers", "/admin/workers/w0", "/admin/overview")]
    for worker, key in ((w0, "worker-secret-0"), (w1, "fleet-secret")):
        paths = {path for path, _ in worker.seen}
        assert {"/v1/models", "/v1/chat/completions", "/health"} <= paths, paths
        assert {auth for _, auth in worker.seen} == {f"Bearer {key}"}, worker.seen
    for text in (*shown, caplog.text, repr(settings),
                 json.dumps(settings.model_dump(mode="json"))):
        assert "worker-secret" not in text and "fleet-secret" not in text


async def test_a_clients_key_is_not_sent_to_a_worker(
        tmp_path: Path, tiny_model_dir: Path) -> None:
    """Without a worker key the worker gets no Authorization at all: not the tenant's."""
    worker = KeyedWorker(model_root=str(tiny_model_dir))
    await worker.start()
    try:
        settings = router_settings(tmp_path, [("w0", worker.url)],
                                   tenants=[{"name": "a", "api_keys": ["tenant-key"]}])
        async with running_router(settings) as router, httpx.AsyncClient() as client:
            for headers in ({"authorization": "Bearer tenant-key"},
                            {"x-api-key": "tenant-key"}):
                response = await client.post(f"{router.url}/v1/chat/completions",
                                             headers=headers, json=CHAT)
                assert response.status_code == 200
                assert (await client.get(f"{router.url}/v1/models",
                                         headers=headers)).status_code == 200
        assert {path for path, _ in worker.seen} >= {"/v1/chat/completions", "/v1/models"}
        assert {auth for _, auth in worker.seen} == {None}
    finally:
        await worker.stop()


async def test_a_worker_refusing_the_key_is_logged_without_it(
        tmp_path: Path, tiny_model_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A wrong key: discovery's failure is logged, and the log names no key (aiohttp's
    error repr carries the request's headers). The worker's 401 is not passed to the
    client (it would read as its own key refused): the worker is down for it, a 502."""
    caplog.set_level(logging.DEBUG)
    worker = KeyedWorker(model_root=str(tiny_model_dir), key="the-right-one")
    await worker.start()
    try:
        settings = keyed_settings(tmp_path, [
            {"id": "w0", "url": worker.url, "api_key": "a-wrong-secret"}])
        async with running_router(settings) as router, httpx.AsyncClient() as client:
            assert router.runtime.workers.get("w0").served_models is None
            response = await client.post(f"{router.url}/v1/chat/completions", json=CHAT)
            assert response.status_code == 502, response.text
            assert "refused the router's worker API key" in response.json()["error"]["message"]
            assert not router.runtime.workers.get("w0").http_up
        assert worker.seen and {a for _, a in worker.seen} == {"Bearer a-wrong-secret"}
        assert "could not list models" in caplog.text and "401" in caplog.text
        assert "a-wrong-secret" not in caplog.text
    finally:
        await worker.stop()


async def test_a_request_a_worker_refuses_for_the_routers_key_goes_to_the_next_best(
        tmp_path: Path, keyed: list[KeyedWorker]) -> None:
    """One worker's key misconfigured: its 401 is the worker failing, as a 503 is: marked
    down and the request retried on another worker, whose answer the client gets."""
    w0, w1 = keyed
    settings = keyed_settings(
        tmp_path, [{"id": "w0", "url": w0.url, "api_key": "a-wrong-secret"},
                   {"id": "w1", "url": w1.url}], worker_api_key="fleet-secret")
    async with running_router(settings) as router, httpx.AsyncClient() as client:
        answered = []
        for number in range(10):  # until one went to w0 first (new sessions spread)
            response = await client.post(f"{router.url}/v1/chat/completions",
                                         json={**CHAT, "session_id": f"s{number}"})
            assert response.status_code == 200, response.text
            answered.append(response.headers["x-kvhint-worker"])
            if any(path == "/v1/chat/completions" for path, _ in w0.seen):
                break
        assert not router.runtime.workers.get("w0").http_up
    assert any(path == "/v1/chat/completions" for path, _ in w0.seen)
    assert set(answered) == {"w1"}
