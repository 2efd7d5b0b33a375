"""The Responses API through the router against stand-in workers that answer in vLLM
0.32's shapes (responses/serving.py, api_router.py): what real servers cannot be made to
do on cue (break mid-stream, fail a response, go away, answer in the background) and
the routing of stored response ids between two workers and two tenants. The same paths
against real vLLM servers: tests/e2e/service/test_service_responses_e2e.py."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from aiohttp import web

from conftest import bind_stand_in, router_settings, running_router, sample, scrape, serving
from kvhint.router.devstack.nats_server import free_port

TENANTS = [{"name": "acme", "api_keys": ["ka"]}, {"name": "beta", "api_keys": ["kb"]}]


@dataclass
class ResponsesStub:
    """A worker's Responses API as vLLM 0.32 answers it, with a response store (as with
    VLLM_ENABLE_RESPONSES_API_STORE=1)."""

    model_root: str
    port: int = field(default_factory=free_port)
    # "ok" | "tools" (ends in a function call) | "failed" (vLLM's completed event with a
    # failed response) | "die_mid_stream" (the connection dies after response.created) |
    # "background" (answers at once, queued) | "die_after_end" (the connection dies after
    # response.completed, before the stream's end)
    mode: str = "ok"
    received: list[dict[str, Any]] = field(default_factory=list)
    fetched: list[str] = field(default_factory=list)
    store: dict[str, dict[str, Any]] = field(default_factory=dict)
    _runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/responses", self._create)
        app.router.add_get("/v1/responses/{id}", self._get)
        app.router.add_post("/v1/responses/{id}/cancel", self._cancel)
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
        return web.json_response({"object": "list",
                                  "data": [{"id": "stub", "root": self.model_root}]})

    def _response(self, body: dict[str, Any], status: str) -> dict[str, Any]:
        output: list[dict[str, Any]] = [{
            "id": "msg_1", "type": "message", "role": "assistant", "status": "completed",
            "content": [{"type": "output_text", "text": "hello", "annotations": []}]}]
        if self.mode == "tools":
            output.append({"id": "fc_1", "type": "function_call", "call_id": "c1",
                           "name": "get_weather", "arguments": "{}", "status": "completed"})
        done = status not in ("queued", "in_progress")
        return {"id": body["request_id"], "object": "response", "model": "stub",
                "status": status, "output": output if done else [],
                "previous_response_id": body.get("previous_response_id"),
                "store": body.get("store", True), "error": None,
                "usage": {"input_tokens": 40, "output_tokens": 2, "total_tokens": 42,
                          "input_tokens_details": {"cached_tokens": 32},
                          "output_tokens_details": {"reasoning_tokens": 0}} if done else None}

    async def _create(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.received.append(body)
        previous = body.get("previous_response_id")
        if previous is not None and previous not in self.store:
            return _not_found(previous)
        if self.mode == "background":
            response = self._response(body, "queued")
            self.store[response["id"]] = response
            return web.json_response(response)
        final = self._response(body, "failed" if self.mode == "failed" else "completed")
        if self.mode == "failed":
            final["error"] = {"code": "server_error", "message": "generation failed"}
        if self.stores(body):
            self.store[final["id"]] = final
        if not body.get("stream"):
            return web.json_response(final)
        stream = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await stream.prepare(request)
        created = self._response(body, "in_progress")
        events = [("response.created", {"response": created}),
                  ("response.in_progress", {"response": created}),
                  ("response.output_text.delta", {"item_id": "msg_1", "output_index": 0,
                                                  "content_index": 0, "delta": "hel"}),
                  ("response.output_text.delta", {"item_id": "msg_1", "output_index": 0,
                                                  "content_index": 0, "delta": "lo"}),
                  ("response.completed", {"response": final})]
        for number, (kind, data) in enumerate(events):
            event = {"type": kind, "sequence_number": number, **data}
            await stream.write(f"event: {kind}\ndata: {json.dumps(event)}\n\n".encode())
            if self.mode == "die_mid_stream" and number == 1:
                await asyncio.sleep(0.1)  # both events reach the router first
                request.transport.close()  # type: ignore[union-attr]
                return stream
        if self.mode == "die_after_end":  # every event sent, not the stream's own end
            await asyncio.sleep(0.1)
            request.transport.close()  # type: ignore[union-attr]
            return stream
        await stream.write_eof()
        return stream

    def stores(self, body: dict[str, Any]) -> bool:
        """Whether this worker stores the response ``body`` asks for (vLLM's own reading
        of ``store``: test_service_responses_learning.py)."""
        return bool(body.get("store", True))

    async def _get(self, request: web.Request) -> web.StreamResponse:
        response_id = request.match_info["id"]
        self.fetched.append(response_id)
        if response_id not in self.store:
            return _not_found(response_id)
        if request.query.get("stream") == "true":
            # A background response's events (vLLM's background stream generator): the
            # one stored so far, then nothing while the response is still queued.
            stream = await self._stream_created(request, response_id)
            for _ in range(600):  # silent until the router closes the connection
                if request.transport is None or request.transport.is_closing():
                    break
                await asyncio.sleep(0.05)
            return stream
        return web.json_response(self.store[response_id])

    async def _stream_created(self, request: web.Request,
                              response_id: str) -> web.StreamResponse:
        """An event stream opened on ``request``, its first event the stored response's
        ``response.created`` (sequence 0): how vLLM begins a GET streaming a stored
        response."""
        stream = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await stream.prepare(request)
        event = {"type": "response.created", "sequence_number": 0,
                 "response": self.store[response_id]}
        await stream.write(f"event: response.created\ndata: {json.dumps(event)}\n\n".encode())
        return stream

    async def _cancel(self, request: web.Request) -> web.Response:
        response = self.store.get(request.match_info["id"])
        if response is None:
            return _not_found(request.match_info["id"])
        if response["status"] not in ("queued", "in_progress"):
            return web.json_response({"error": {
                "message": "Cannot cancel a synchronous response.",
                "type": "invalid_request_error", "param": "response_id", "code": 400}},
                status=400)
        response["status"] = "cancelled"
        return web.json_response(response)


def _not_found(response_id: str) -> web.Response:
    return web.json_response({"error": {
        "message": f"Response with id '{response_id}' not found.",
        "type": "invalid_request_error", "param": "response_id", "code": 404}}, status=404)


@pytest.fixture
async def stubs(tiny_model_dir: Path) -> AsyncIterator[list[ResponsesStub]]:
    async with serving([ResponsesStub(str(tiny_model_dir)),
                        ResponsesStub(str(tiny_model_dir))]) as workers:
        yield workers


def create(**extra: Any) -> dict[str, Any]:
    return {"model": "stub", "input": "tell me about caches", "max_output_tokens": 4} | extra


def events(text: str) -> list[tuple[str, dict[str, Any]]]:
    """An SSE body's (event type, data) pairs."""
    out = []
    for block in text.split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line)
        if "data" in lines:
            out.append((lines.get("event", ""), json.loads(lines["data"])))
    return out


async def test_a_response_whole_and_streamed_is_routed_named_and_accounted(
        tmp_path: Path, stubs: list[ResponsesStub]) -> None:
    stub = stubs[0]
    settings = router_settings(tmp_path, [("w0", stub.url)])
    async with running_router(settings) as router, httpx.AsyncClient(timeout=30) as client:
        url = f"{router.url}/v1/responses"
        whole = await client.post(url, json=create(session_id="s1", request_id="mine",
                                                   cache_salt="x"))
        assert whole.status_code == 200, whole.text
        assert whole.headers["x-kvhint-worker"] == "w0"
        sent = stub.received[0]
        # The router names the response (never the client), and owns session and salt.
        assert sent["request_id"] == whole.json()["id"] != "mine"
        assert sent["request_id"].startswith("resp_")
        assert sent["session_id"] == "default/s1" and "cache_salt" not in sent
        assert "stream_options" not in sent  # no such field in the Responses API
        async with client.stream("POST", url, json=create(stream=True),
                                 headers={"X-Session-ID": "s1"}) as streamed:
            assert streamed.status_code == 200
            text = (await streamed.aread()).decode()
        kinds = [kind for kind, _data in events(text)]
        assert kinds == ["response.created", "response.in_progress",
                         "response.output_text.delta", "response.output_text.delta",
                         "response.completed"]
        assert stub.received[1]["session_id"] == "default/s1"
        samples = await scrape(client, router.url)
        assert sample(samples, "kvhint_router_requests_total", endpoint="responses",
                      worker="w0", code="200") == 2
        assert sample(samples, "kvhint_router_prompt_tokens_total", worker="w0") == 80
        # Predicted: the router hashed the Responses input exactly (a string input).
        assert sample(samples, "kvhint_router_cached_tokens_actual_total", worker="w0",
                      predicted="true") == 64
        session = (await client.get(f"{router.url}/admin/sessions/default/s1")).json()
        assert session["turns"] == 2 and session["cached_tokens"] == 64
        assert session["prompt_tokens"] == 80


async def test_stored_responses_are_reached_on_the_worker_that_holds_them(
        tmp_path: Path, stubs: list[ResponsesStub]) -> None:
    settings = router_settings(tmp_path, [("w0", stubs[0].url), ("w1", stubs[1].url)])
    by_worker = {"w0": stubs[0], "w1": stubs[1]}
    async with running_router(settings) as router, httpx.AsyncClient(timeout=30) as client:
        url = f"{router.url}/v1/responses"
        made: dict[str, tuple[str, str]] = {}  # id -> (worker, session)
        number = 0
        while {worker for worker, _s in made.values()} != {"w0", "w1"}:
            number += 1
            assert number < 40, "every new session went to one worker"
            answer = await client.post(url, json=create(session_id=f"s{number}"))
            assert answer.status_code == 200, answer.text
            made[answer.json()["id"]] = (answer.headers["x-kvhint-worker"], f"s{number}")
        for response_id, (worker, session) in made.items():
            before = {w: len(s.received) for w, s in by_worker.items()}
            session_url = f"{router.url}/admin/sessions/default/{session}"
            turns = (await client.get(session_url)).json()["turns"]
            # No session named: the follow-up continues its response's.
            follow = await client.post(url, json=create(previous_response_id=response_id,
                                                        stream=True))
            assert follow.status_code == 200, follow.text
            assert follow.headers["x-kvhint-worker"] == worker
            assert by_worker[worker].received[-1]["session_id"] == f"default/{session}"
            assert {w: len(s.received) - before[w] for w, s in by_worker.items()} == {
                w: int(w == worker) for w in by_worker}
            assert (await client.get(session_url)).json()["turns"] == turns + 1
            streamed_id = events(follow.text)[0][1]["response"]["id"]
            # In a session whose turns ran on the other worker: the response's worker
            # still wins over the session's affinity.
            elsewhere = next(s for w, s in made.values() if w != worker)
            pinned = await client.post(url, json=create(previous_response_id=response_id,
                                                        session_id=elsewhere))
            assert pinned.status_code == 200, pinned.text
            assert pinned.headers["x-kvhint-worker"] == worker
            got = await client.get(f"{url}/{response_id}")
            assert got.status_code == 200 and got.json()["id"] == response_id
            assert got.headers["x-kvhint-worker"] == worker
            assert by_worker[worker].fetched[-1] == response_id
            # vLLM's own answer for a finished response passes through.
            cancel = await client.post(f"{url}/{response_id}/cancel",
                                       headers={"Authorization": "Bearer x"})
            assert cancel.status_code == 400 and "synchronous" in cancel.text
            # A follow-up of a follow-up: the streamed one's id was learnt as well.
            again = await client.post(url, json=create(previous_response_id=streamed_id))
            assert again.status_code == 200 and again.headers["x-kvhint-worker"] == worker
        # An id the router never relayed: vLLM's 404, from the router, sent nowhere.
        sent = sum(len(s.received) for s in stubs)
        unknown = await client.post(url, json=create(previous_response_id="resp_nope"))
        assert unknown.status_code == 404
        assert unknown.json()["error"]["message"] == "Response with id 'resp_nope' not found."
        assert sum(len(s.received) for s in stubs) == sent
        missing = await client.get(f"{url}/resp_nope")
        assert missing.status_code == 404 and missing.json() == unknown.json()
        samples = await scrape(client, router.url)
        assert sample(samples, "kvhint_router_response_id_misses_total", reason="unknown") == 2
        assert sample(samples, "kvhint_router_response_id_requests_total", op="get",
                      code="200") == len(made)
        assert sample(samples, "kvhint_router_response_ids") == 4 * len(made)


async def test_a_tenant_never_reaches_another_tenants_response(
        tmp_path: Path, stubs: list[ResponsesStub]) -> None:
    settings = router_settings(tmp_path, [("w0", stubs[0].url)], tenants=TENANTS)
    acme, beta = {"Authorization": "Bearer ka"}, {"Authorization": "Bearer kb"}
    async with running_router(settings) as router, httpx.AsyncClient(timeout=30) as client:
        url = f"{router.url}/v1/responses"
        made = await client.post(url, json=create(), headers=acme)
        assert made.status_code == 200, made.text
        response_id = made.json()["id"]
        assert (await client.get(f"{url}/{response_id}", headers=acme)).status_code == 200
        sent, fetched = len(stubs[0].received), len(stubs[0].fetched)
        unknown = (await client.get(f"{url}/resp_nope", headers=beta)).json()
        # To another tenant the id is unknown: the same 404, word for word, and nothing
        # reaches the worker that holds it.
        for answer in (
                await client.get(f"{url}/{response_id}", headers=beta),
                await client.post(f"{url}/{response_id}/cancel", headers=beta),
                await client.post(url, json=create(previous_response_id=response_id),
                                  headers=beta)):
            assert answer.status_code == 404
            assert answer.json() == json.loads(json.dumps(unknown).replace(
                "resp_nope", response_id))
        assert (len(stubs[0].received), len(stubs[0].fetched)) == (sent, fetched)
        assert (await client.get(f"{url}/{response_id}")).status_code == 401  # no key
        # A media uuid names the tenant's own cache entry (vLLM keys its media caches by
        # it alone), as on chat.
        image = {"type": "input_image", "image_url": "http://x/y.png", "uuid": "U1"}
        await client.post(url, headers=beta, json=create(input=[
            {"role": "user", "content": [image, {"type": "input_text", "text": "hi"}]}]))
        sent_image = stubs[0].received[-1]["input"][0]["content"][0]
        assert sent_image["uuid"] not in ("U1", None) and len(sent_image["uuid"]) == 64
        samples = await scrape(client, router.url)
        assert sample(samples, "kvhint_router_response_id_misses_total",
                      reason="other_tenant") == 3
        assert sample(samples, "kvhint_router_requests_total", endpoint="responses",
                      worker="none", code="404") == 1


async def test_a_response_retried_elsewhere_is_named_for_the_worker_that_made_it(
        tmp_path: Path, stubs: list[ResponsesStub]) -> None:
    """The id says its worker (responses_id_codec.py): a new response whose first worker
    fails before taking it is named again for the worker the retry reaches."""
    settings = router_settings(tmp_path, [("w0", stubs[0].url), ("w1", stubs[1].url)],
                               responses={"max_ids": 1})
    by_worker = {"w0": stubs[0], "w1": stubs[1]}
    async with running_router(settings) as router, httpx.AsyncClient(timeout=30) as client:
        url = f"{router.url}/v1/responses"
        first = await client.post(url, json=create(session_id="agent"))
        gone = first.headers["x-kvhint-worker"]
        other = next(w for w in by_worker if w != gone)
        await by_worker[gone].stop()  # the session's worker, not yet known down
        retried = await client.post(url, json=create(session_id="agent"))
        assert retried.status_code == 200, retried.text
        assert retried.headers["x-kvhint-worker"] == other
        response_id = retried.json()["id"]
        assert response_id == by_worker[other].received[-1]["request_id"]
        assert response_id.startswith(f"resp_{other}_")
        # Forgotten (max_ids 1), as on a replica that did not relay it: read from the id.
        assert (await client.post(url, json=create())).status_code == 200
        got = await client.get(f"{url}/{response_id}")
        assert got.status_code == 200 and got.headers["x-kvhint-worker"] == other
        samples = await scrape(client, router.url)
        assert sample(samples, "kvhint_router_retries_total", worker=gone) == 1
        assert sample(samples, "kvhint_router_response_ids_read_total") == 1


async def test_a_response_whose_worker_is_down_is_not_sent_elsewhere(
        tmp_path: Path, stubs: list[ResponsesStub]) -> None:
    holder, other = stubs
    settings = router_settings(tmp_path, [("w0", holder.url)])
    async with running_router(settings) as router, httpx.AsyncClient(timeout=30) as client:
        url = f"{router.url}/v1/responses"
        response_id = (await client.post(url, json=create())).json()["id"]
        # A second worker joins; the one holding the response goes away.
        router.runtime.workers.ensure("w1", other.url)
        await holder.stop()
        first = await client.post(url, json=create(previous_response_id=response_id))
        # It was not known down yet: tried there, once, and not elsewhere.
        assert first.status_code == 502 and "worker unavailable" in first.text
        down = await client.post(url, json=create(previous_response_id=response_id))
        assert down.status_code == 503
        error = down.json()["error"]
        assert "held by worker w0, which is unavailable now" in error["message"]
        assert error["type"] == "server_error" and error["param"] == "response_id"
        assert (await client.get(f"{url}/{response_id}")).status_code == 503
        assert other.received == [] and other.fetched == []
        # New responses still go to the worker that is up.
        assert (await client.post(url, json=create())).headers["x-kvhint-worker"] == "w1"
        samples = await scrape(client, router.url)
        assert sample(samples, "kvhint_router_response_id_misses_total",
                      reason="worker_down") == 2
        assert not any(name == "kvhint_router_retries_total" and v
                       for (name, _l), v in samples.items())


async def test_failures_end_the_turn_failed_in_the_responses_shape(
        tmp_path: Path, stubs: list[ResponsesStub]) -> None:
    stub = stubs[0]
    settings = router_settings(tmp_path, [("w0", stub.url)])
    async with running_router(settings) as router, httpx.AsyncClient(timeout=30) as client:
        url = f"{router.url}/v1/responses"
        stub.mode = "tools"
        made = await client.post(url, json=create(session_id="agent"))
        session = (await client.get(f"{router.url}/admin/sessions/default/agent")).json()
        assert session["state"] == "tool_gap" and session["open_gap"]["tools"] == ["get_weather"]
        # A worker whose connection dies mid-stream: the stream ends with the terminal
        # event Responses clients wait for, response.failed, on the response announced.
        stub.mode = "die_mid_stream"
        async with client.stream("POST", url, json=create(
                stream=True, session_id="agent",
                previous_response_id=made.json()["id"])) as streamed:
            got = events((await streamed.aread()).decode())
        assert [kind for kind, _d in got] == ["response.created", "response.in_progress",
                                              "response.failed"]
        failed = got[-1][1]
        assert failed["sequence_number"] == 2
        assert failed["response"]["id"] == got[0][1]["response"]["id"]
        assert failed["response"]["status"] == "failed"
        assert "worker failed mid-stream" in failed["response"]["error"]["message"]
        # vLLM's own failed response (a 200 whose response.completed says failed).
        stub.mode = "failed"
        async with client.stream("POST", url, json=create(
                stream=True, session_id="agent")) as streamed:
            await streamed.aread()
        whole = await client.post(url, json=create(session_id="agent"))
        assert whole.status_code == 200 and whole.json()["status"] == "failed"
        session = (await client.get(f"{router.url}/admin/sessions/default/agent")).json()
        assert session["turns"] == 1  # none of the failed ones counts
        # A background response is answered at once, queued: no usage yet, not lost.
        stub.mode = "background"
        queued = await client.post(url, json=create(background=True))
        assert queued.json()["status"] == "queued"
        samples = await scrape(client, router.url)
        code = {c: sample(samples, "kvhint_router_requests_total", endpoint="responses",
                          worker="w0", code=c) for c in ("200", "502", "500")}
        assert code == {"200": 2, "502": 1, "500": 2}
        assert sample(samples, "kvhint_router_responses_background_total") == 1
        assert sample(samples, "kvhint_router_drops_total",
                      what="response_usage_missing") is None


async def test_the_inference_endpoints_checks_hold_for_responses(
        tmp_path: Path, stubs: list[ResponsesStub]) -> None:
    stub = stubs[0]
    settings = router_settings(tmp_path, [("w0", stub.url)], max_body_bytes=4096,
                               cors_allowed_origins=["https://app.example"])
    origin = {"Origin": "https://app.example"}
    async with running_router(settings) as router, httpx.AsyncClient(timeout=30) as client:
        url = f"{router.url}/v1/responses"
        too_large = await client.post(url, json=create(input="x" * 5000))
        assert too_large.status_code == 413
        untyped = await client.post(url, content=json.dumps(create()),
                                    headers={"Content-Type": "text/plain"})
        assert untyped.status_code == 400 and "Content-Type" in untyped.text
        no_input = await client.post(url, json={"model": "stub"})
        assert no_input.status_code == 400 and no_input.json()["error"]["param"] == "input"
        assert stub.received == []
        # CORS as on the other inference endpoints, the stored response's paths too.
        made = await client.post(url, json=create(), headers=origin)
        assert made.headers["access-control-allow-origin"] == "https://app.example"
        response_id = made.json()["id"]
        for path, method in ((url, "POST"), (f"{url}/{response_id}", "GET"),
                             (f"{url}/{response_id}/cancel", "POST")):
            preflight = await client.options(path, headers={
                **origin, "Access-Control-Request-Method": method})
            assert preflight.status_code == 204, path
        got = await client.get(f"{url}/{response_id}", headers=origin)
        assert got.headers["access-control-allow-origin"] == "https://app.example"
        # A cancel changes state: without a key, a form-like POST is refused (dev mode).
        refused = await client.post(f"{url}/{response_id}/cancel",
                                    headers={"Content-Type": "text/plain"})
        assert refused.status_code == 403
        samples = await scrape(client, router.url)
        assert sample(samples, "kvhint_router_cross_site_refusals_total",
                      endpoint="responses_cancel", reason="no_marker") == 1
        assert sample(samples, "kvhint_router_requests_total", endpoint="responses",
                      worker="none", code="413") == 1

