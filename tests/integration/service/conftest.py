"""Helpers for the router's integration tests: the router app served in-process (uvicorn
on the test's event loop), stub workers, and router replicas sharing one store.

Stub workers stand in for vLLM only where a real one cannot produce the fault under test
on demand (a connection that dies after the first streamed event, an exact chunk timing,
a 503); tests/e2e/service runs the same paths against real vLLM servers.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import errno
import json
import socket
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
import sqlalchemy as sa
import uvicorn
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from kvhint.router.devstack.ports import free_port, listening, reserved_socket
from kvhint.router.service.app import RouterApp, create_app
from kvhint.router.service.nats_link import remove_streams
from kvhint.router.service.runtime import RouterRuntime
from kvhint.router.service.settings import RouterSettings
from kvhint.router.store.database import create_store_engine, migrate
from kvhint.schemas import Subjects


@dataclass
class RunningRouter:
    url: str
    server: uvicorn.Server
    app: RouterApp

    @property
    def runtime(self) -> RouterRuntime:
        return self.app.state.runtime


@asynccontextmanager
async def running_router(settings: RouterSettings) -> AsyncIterator[RunningRouter]:
    # A socket bound here, served by uvicorn: a port free_port() found may be taken
    # before uvicorn binds it.
    listener = reserved_socket()
    port = listener.getsockname()[1]
    app = create_app(settings)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                           log_level="warning", lifespan="on"))
    task = asyncio.create_task(server.serve(sockets=[listener]))
    while not server.started:
        if task.done():
            task.result()
            raise RuntimeError("router exited during start-up")
        await asyncio.sleep(0.02)
    try:
        yield RunningRouter(f"http://127.0.0.1:{port}", server, app)
    finally:
        server.should_exit = True
        await task


def usage(prompt: int, cached: int, completion: int = 1) -> dict[str, Any]:
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


@dataclass
class StubWorker:
    """An OpenAI-shaped HTTP server whose behaviour a test sets per request."""

    port: int = field(default_factory=free_port)
    # "ok" | "status:<code>" | "html:<code>" (an HTML page) | "die_mid_stream" | "slow_stream" | "no_usage" (a 200 without
    # usage, streamed or not) | "unparsable" (a 200 whose body, or an event, is not JSON)
    # | "error_event:<code>" (a stream that fails after its first event as vLLM's does)
    # | "error_event_no_done:<code>" (the same error event, then the stream's end with no
    # [DONE]: a worker that ends its stream at the error)
    mode: str = "ok"
    finish_reason: str = "stop"
    tool_names: list[str] = field(default_factory=list)
    received: list[dict[str, Any]] = field(default_factory=list)
    chunk_gap_s: float = 0.0
    # A worker busy before it answers at all (a long prefill, a queue).
    answer_delay_s: float = 0.0
    # Set: a request on a kept-alive connection idle longer than this is dropped unanswered
    # (the connection reset), the outcome of a request written just as a server closes
    # an idle connection (vLLM's after 5 s), a race no real server loses on cue.
    drop_requests_idle_over_s: float | None = None
    _idle_since: dict[int, float] = field(default_factory=dict)
    prompt_tokens: int = 40  # the usage it reports (32 of them cached)
    # /v1/models "root": where the router finds the tokenizer (the tiny model's).
    model_root: str = "stub"
    # The served model name; a request naming another model (nor an adapter) gets
    # vLLM's 404.
    model: str = "stub"
    # LoRA adapters it lists as models of their own (vLLM: "parent" names the base).
    adapters: list[str] = field(default_factory=list)
    # Seconds a stream stays open after its [DONE] event before the worker ends it.
    linger_after_done_s: float = 0.0
    # A socket bound for it (reserved_socket()): its port, refusing connections until
    # the first start serves it. For a URL given out before the worker starts.
    listen_on: socket.socket | None = None
    _runner: web.AppRunner | None = None

    def __post_init__(self) -> None:
        if self.listen_on is not None:
            self.port = self.listen_on.getsockname()[1]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _middlewares(self) -> list[Any]:
        """aiohttp middlewares in front of every route (a subclass's: none here)."""
        return []

    async def start(self) -> None:
        app = web.Application(middlewares=self._middlewares())
        app.router.add_post("/v1/chat/completions", self._complete)
        app.router.add_post("/v1/completions", self._complete)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await bind_stand_in(self._runner, self)

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _health(self, _request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def _models(self, _request: web.Request) -> web.Response:
        adapters = [{"id": name, "root": f"/adapters/{name}", "parent": self.model}
                    for name in self.adapters]
        return web.json_response({"object": "list",
                                  "data": [{"id": self.model, "root": self.model_root},
                                           *adapters]})

    def _message(self) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": "hello"}
        if self.tool_names:
            message["tool_calls"] = [{"id": f"c{i}", "type": "function",
                                      "function": {"name": n, "arguments": "{}"}}
                                     for i, n in enumerate(self.tool_names)]
        return message

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        connection = id(request.transport)
        idle_since = self._idle_since.pop(connection, None)
        if (self.drop_requests_idle_over_s is not None and idle_since is not None
                and time.monotonic() - idle_since > self.drop_requests_idle_over_s):
            request.transport.abort()  # type: ignore[union-attr]
            raise web.HTTPServiceUnavailable()  # never sent: the connection is gone
        try:
            return await self._answer(request)
        finally:
            self._idle_since[connection] = time.monotonic()

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.received.append(body)
        if body.get("model", self.model) not in (self.model, *self.adapters):
            return web.json_response({"error": {
                "message": f"The model `{body['model']}` does not exist.",
                "type": "NotFoundError", "code": 404}}, status=404)
        if self.answer_delay_s:
            await asyncio.sleep(self.answer_delay_s)
        if self.mode.startswith("status:"):
            code = int(self.mode.split(":")[1])
            return web.json_response({"error": {"message": f"stub says {code}", "code": code}},
                                     status=code)
        if self.mode.startswith("html:"):  # a proxy's error page in front of a worker
            return web.Response(text="<script>alert(document.domain)</script>",
                                content_type="text/html", status=int(self.mode.split(":")[1]))
        if self.mode == "unparsable" and not body.get("stream"):
            return web.Response(text="{not json", content_type="application/json")
        if not body.get("stream"):
            if self.mode == "no_usage":
                return web.json_response({
                    "id": "x", "object": "chat.completion", "model": "stub",
                    "choices": [{"index": 0, "message": self._message(),
                                 "finish_reason": self.finish_reason}]})
            return web.json_response({
                "id": "x", "object": "chat.completion", "model": "stub",
                "choices": [{"index": 0, "message": self._message(),
                             "finish_reason": self.finish_reason}],
                "usage": usage(self.prompt_tokens, 32, 2)})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        delta = self._message()
        chunks = [{"choices": [{"index": 0, "delta": delta, "finish_reason": None}]},
                  {"choices": [{"index": 0, "delta": {"content": "!"},
                                "finish_reason": self.finish_reason}]}]
        if self.mode == "unparsable":
            await response.write(b"data: {not json\n\n")
        for number, chunk in enumerate(chunks):
            await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            if self.mode == "die_mid_stream":
                await asyncio.sleep(0.1)  # let the first event reach the router
                request.transport.close()  # type: ignore[union-attr]
                return response
            if self.mode.startswith(("error_event:", "error_event_no_done:")):
                # vLLM's bytes for a generation that fails once the stream has begun
                # (create_streaming_error_response: json.dumps of its ErrorResponse),
                # then [DONE] (not in error_event_no_done) and a clean end, after
                # linger_after_done_s: no usage chunk.
                code = int(self.mode.split(":")[1])
                kind = "InternalServerError" if code >= 500 else "BadRequestError"
                await response.write(b"data: " + json.dumps({"error": {
                    "message": f"stub fails: {kind}", "type": kind, "param": None,
                    "code": code}}).encode() + b"\n\n")
                if self.mode.startswith("error_event:"):
                    await response.write(b"data: [DONE]\n\n")
                if self.linger_after_done_s:
                    await asyncio.sleep(self.linger_after_done_s)
                await response.write_eof()
                return response
            if number == 0 and self.chunk_gap_s:
                await asyncio.sleep(self.chunk_gap_s)
        options = body.get("stream_options") or {}
        if options.get("include_usage") and self.mode != "no_usage":
            await response.write(b"data: " + json.dumps(
                {"choices": [], "usage": usage(self.prompt_tokens, 32, 2)}).encode() + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        if self.linger_after_done_s:
            await asyncio.sleep(self.linger_after_done_s)
        await response.write_eof()
        return response


W = TypeVar("W", bound=StubWorker)


async def scrape(client: httpx.AsyncClient, url: str) -> dict[tuple[str, frozenset], float]:
    """The router's /metrics: (sample name, its labels as items) -> value."""
    text = (await client.get(f"{url}/metrics")).text
    return {(sample.name, frozenset(sample.labels.items())): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def sample(samples: dict[tuple[str, frozenset], float], name: str, **labels: str
           ) -> float | None:
    return samples.get((name, frozenset(labels.items())))


@pytest.fixture
async def throwaway_streams(nats_url: str, subject_prefix: str) -> AsyncIterator[None]:
    """Deletes the streams the test's router created under its prefix."""
    yield
    await remove_streams(nats_url, Subjects(subject_prefix))


@asynccontextmanager
async def serving(workers: list[W]) -> AsyncIterator[list[W]]:
    """``workers`` started, stopped at the end."""
    for worker in workers:
        await worker.start()
    try:
        yield workers
    finally:
        for worker in workers:
            await worker.stop()


async def bind_stand_in(runner: web.AppRunner, worker: Any) -> None:
    """Serve ``runner`` on ``worker.port``, on its ``listen_on`` socket if it has one.
    free_port() only found that port free: another process may take it before this bind
    (a clean-clone CI run saw it). A first start then takes another port; a restart keeps
    its own, which the router under test was given."""
    if getattr(worker, "listen_on", None) is not None:
        await web.SockSite(runner, listening(worker.listen_on)).start()
        worker.listen_on, worker._bound = None, True  # closed when the runner stops
        return
    for attempt in range(5):
        try:
            await web.TCPSite(runner, "127.0.0.1", worker.port).start()
            break
        except OSError as exc:
            if (exc.errno != errno.EADDRINUSE or getattr(worker, "_bound", False)
                    or attempt == 4):
                raise
            worker.port = free_port()
    worker._bound = True


@asynccontextmanager
async def serving_app(app: web.Application) -> AsyncIterator[str]:
    """A stand-in worker's aiohttp ``app`` served on a free local port; its URL. Cleaned
    up at the end."""
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    # Port 0: the kernel's pick, bound at once (a port free_port() found may be taken
    # before the bind).
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    port = runner.addresses[0][1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


@pytest.fixture
async def stub_workers(tiny_model_dir: Path) -> AsyncIterator[list[StubWorker]]:
    async with serving([StubWorker(model_root=str(tiny_model_dir)),
                        StubWorker(model_root=str(tiny_model_dir))]) as workers:
        yield workers


def router_settings(tmp_path: Path, workers: list[tuple[str, str]], **extra: Any
                    ) -> RouterSettings:
    base: dict[str, Any] = {
        "workers": [{"id": w, "url": u} for w, u in workers],
        "database_url": f"sqlite:///{tmp_path / 'router.db'}",
        "nats_url": None,
        "store_flush_interval_s": 0.05,
        "health_probe_s": 0.2,
        # Small streams: JetStream reserves max_bytes on the shared server's disk.
        "events_stream_max_bytes": 8 << 20,
        "outcomes_stream_max_bytes": 8 << 20,
        "releases_stream_max_bytes": 8 << 20,
    }
    base.update(extra)
    return RouterSettings(**base)


@pytest.fixture
def replica_engines(database_url: str) -> Iterator[list[sa.Engine]]:
    """Three router replicas' engines on one store, disposed at the end. Replicas share a
    PostgreSQL store; a SQLite file is one router's own: skipped there."""
    if not database_url.startswith("postgresql"):
        pytest.skip("replicas share a PostgreSQL store; SQLite is one router's own")
    engines = [create_store_engine(database_url) for _ in range(3)]
    try:
        yield engines
    finally:
        for engine in engines:
            engine.dispose()


def migrate_together(engines: list[sa.Engine]) -> list[bool]:
    """Every engine migrates its store at once, each on a thread of its own (replicas
    starting together); what each migrate returned, in the engines' order."""
    with concurrent.futures.ThreadPoolExecutor(len(engines)) as pool:
        return [f.result() for f in [pool.submit(migrate, engine) for engine in engines]]
