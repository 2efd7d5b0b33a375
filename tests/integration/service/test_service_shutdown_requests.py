"""The router stopping (SIGTERM: uvicorn's should_exit) with a non-streamed request still
waiting on its worker when ``http_shutdown_grace_s`` runs out: uvicorn cancels it, and the
client gets the router's JSON 503 ("the router is shutting down"), counted 503, as a
stream open then gets its 503 error event (test_service_shutdown_streams.py). Before,
the cancel reached uvicorn: a plain-text 500 with a traceback in the log, counted 499."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from pathlib import Path

import httpx
import pytest
import uvicorn
from aiohttp import web

from conftest import StubWorker, router_settings, serving, serving_app
from test_service_responses_api import create, events
from test_service_responses_faults import BackgroundStreamStub, _read_until
from kvhint.router.devstack.ports import reserved_socket
from kvhint.router.server_cli import uvicorn_config
from kvhint.router.service.app import RouterApp, create_app
from kvhint.router.service.settings import RouterSettings

pytestmark = pytest.mark.integration


async def _started(settings: RouterSettings, listener: socket.socket
                   ) -> tuple[RouterApp, uvicorn.Server, asyncio.Task[None]]:
    """The router app served by uvicorn (on ``listener``, a reserved_socket() on
    ``settings.port``: a port found free may be taken before a later bind) once it has
    started: the app, its server and the task serving it."""
    app = create_app(settings)
    server = uvicorn.Server(uvicorn_config(app, settings))
    serve = asyncio.create_task(server.serve(sockets=[listener]))
    while not server.started:
        assert not serve.done()
        await asyncio.sleep(0.02)
    return app, server, serve


async def test_a_request_waiting_on_its_worker_past_the_grace_gets_a_json_503(
        tmp_path: Path, tiny_model_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    async with serving([StubWorker(model_root=str(tiny_model_dir))]) as (worker,):
        listener = reserved_socket()
        settings = router_settings(tmp_path, [("w0", worker.url)], port=listener.getsockname()[1],
                                   http_shutdown_grace_s=0.5)
        app, server, serve = await _started(settings, listener)
        url = f"http://127.0.0.1:{settings.port}"
        worker.answer_delay_s = 3.0  # busy past the grace
        async with httpx.AsyncClient(timeout=30) as client:
            asked = asyncio.create_task(client.post(
                f"{url}/v1/chat/completions", headers={"x-session-id": "s"},
                json={"model": "stub", "messages": [{"role": "user", "content": "go"}]}))
            while not worker.received:
                await asyncio.sleep(0.02)
            caplog.clear()
            stopped_at = time.monotonic()
            server.should_exit = True  # what SIGTERM does
            answer = await asyncio.wait_for(asked, 10)
        await asyncio.wait_for(serve, 20)
        assert time.monotonic() - stopped_at < 4
    assert answer.status_code == 503, answer.text
    assert answer.headers["content-type"].startswith("application/json")
    error = answer.json()["error"]
    assert "shutting down" in error["message"]
    counted = {(sample.labels["worker"], sample.labels["code"]): sample.value
               for metric in app.state.runtime.metrics.requests.collect()
               for sample in metric.samples if sample.name.endswith("_total")
               and sample.labels["endpoint"] == "chat"}
    # Cut before its worker's headers came: no worker took it yet ("none").
    assert counted == {("none", "503"): 1.0}, counted
    assert "Exception in ASGI application" not in caplog.text


async def test_a_streamed_get_open_past_the_grace_ends_with_response_failed_503(
        tmp_path: Path, tiny_model_dir: Path) -> None:
    """GET /v1/responses/{id}?stream=true of a background response still running at the
    grace's end: a ``response.failed`` naming the shutdown, counted 503. Before, the
    stream was cut mid-body (no terminal event), counted 499."""
    stub = BackgroundStreamStub(str(tiny_model_dir))
    await stub.start()
    listener = reserved_socket()
    settings = router_settings(tmp_path, [("w0", stub.url)], port=listener.getsockname()[1],
                               http_shutdown_grace_s=0.5)
    try:
        app, server, serve = await _started(settings, listener)
        url = f"http://127.0.0.1:{settings.port}/v1/responses"
        async with httpx.AsyncClient(timeout=30) as client:
            made: list[str] = []
            got: list[str] = []
            started, fetched = asyncio.Event(), asyncio.Event()
            async with client.stream("POST", url, json=create(
                    background=True, stream=True)) as original:
                reading = asyncio.create_task(_read_until(original, made, started))
                await asyncio.wait_for(started.wait(), 10)
                response_id = events("".join(made))[0][1]["response"]["id"]
                async with client.stream("GET", f"{url}/{response_id}",
                                         params={"stream": "true"}) as watching:
                    assert watching.status_code == 200
                    following = asyncio.create_task(_read_until(watching, got, fetched))
                    await asyncio.wait_for(fetched.wait(), 10)
                    server.should_exit = True  # what SIGTERM does
                    await asyncio.wait_for(asyncio.gather(reading, following), 10)
        await asyncio.wait_for(serve, 20)
    finally:
        await stub.stop()
    kind, last = events("".join(got))[-1]
    assert kind == "response.failed", got
    assert "shutting down" in json.dumps(last)
    get_503 = app.state.runtime.metrics.response_id_requests.labels("get", "503")
    assert get_503._value.get() == 1


async def test_a_plain_get_waiting_on_its_worker_past_the_grace_gets_a_json_503(
        tmp_path: Path) -> None:
    """GET /v1/responses/{id} (not streamed) whose worker has not answered at the grace's
    end: the same JSON 503, counted. Before, uvicorn's plain-text 500."""
    asked, released = asyncio.Event(), asyncio.Event()

    async def hanging_get(_request: web.Request) -> web.Response:
        asked.set()
        await released.wait()  # a worker busy past the grace
        return web.json_response({"status": "completed"})

    async def models(_request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": []})

    worker = web.Application()
    worker.router.add_get("/v1/responses/{id}", hanging_get)
    worker.router.add_get("/v1/models", models)
    async with serving_app(worker) as worker_url:
        listener = reserved_socket()
        settings = router_settings(tmp_path, [("w0", worker_url)], port=listener.getsockname()[1],
                                   http_shutdown_grace_s=0.5)
        try:
            app, server, serve = await _started(settings, listener)
            # An id minted for w0 as a POST would have been (found by any replica).
            response_id = app.state.responses.codec.mint("default", "w0", None, False)
            async with httpx.AsyncClient(timeout=30) as client:
                asking = asyncio.create_task(client.get(
                    f"http://127.0.0.1:{settings.port}/v1/responses/{response_id}"))
                await asyncio.wait_for(asked.wait(), 10)
                server.should_exit = True  # what SIGTERM does
                answer = await asyncio.wait_for(asking, 10)
            await asyncio.wait_for(serve, 20)
        finally:
            released.set()
    assert answer.status_code == 503, answer.text
    assert "shutting down" in answer.json()["error"]["message"]
    assert app.state.runtime.metrics.response_id_requests.labels(
        "get", "503")._value.get() == 1
