"""Faults of a stored response's worker, against stand-in workers in vLLM 0.32's shapes
(test_service_responses_api.py): a worker that is gone when a GET or cancel reaches it,
a cancel after which vLLM never ends the response's streams, and a stream that breaks
before vLLM stored its response. Stand-ins because a real vLLM server cannot be made to
do these on cue cheaply (a CPU server's background response finishes, or is cancelled,
within a fraction of a second; its death is a process kill)."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from aiohttp import web

from conftest import router_settings, running_router, sample, scrape
from test_service_responses_api import ResponsesStub, create, events

# What a cancel carries not to be refused as a cross-site form post (dev mode: any key).
MARKED = {"Authorization": "Bearer x"}


@dataclass
class BackgroundStreamStub(ResponsesStub):
    """A background ``stream: true`` request answered as vLLM 0.32 does: its events
    (responses_background_stream_generator) come until ``response.completed``. After a
    cancel vLLM's task is cancelled and no event comes any more: here, the stream stays
    silent until the router closes it (the fault the router must not wait on forever).
    ``fail``: its generation fails after the first delta: vLLM's ``error`` event, then the
    same silence (its background stream ends at ``response.completed`` only)."""

    fail: bool = False
    # Each response's events so far (vLLM's event_store), replayed to a GET streaming it.
    sent_events: dict[str, list[bytes]] = field(default_factory=dict)

    async def _create(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if not (body.get("background") and body.get("stream")):
            return await super()._create(request)
        self.received.append(body)
        response = self._response(body, "queued")
        self.store[response["id"]] = response
        stream = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await stream.prepare(request)
        running = {**response, "status": "in_progress"}
        sent: list[tuple[str, dict[str, Any]]] = [
            ("response.created", {"response": running}),
            ("response.in_progress", {"response": running}),
            ("response.output_text.delta", {"item_id": "msg_1", "output_index": 0,
                                            "content_index": 0, "delta": "hel"})]
        if self.fail:
            sent.append(("error", {"code": "server_error", "message": "boom", "param": None}))
        replay = self.sent_events[response["id"]] = []
        for number, (kind, data) in enumerate(sent):
            event = {"type": kind, "sequence_number": number, **data}
            replay.append(f"event: {kind}\ndata: {json.dumps(event)}\n\n".encode())
            await stream.write(replay[-1])
        return await _silent(request, stream)

    async def _get(self, request: web.Request) -> web.StreamResponse:
        replay = self.sent_events.get(request.match_info["id"])
        if request.query.get("stream") != "true" or replay is None:
            return await super()._get(request)
        self.fetched.append(request.match_info["id"])
        stream = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await stream.prepare(request)
        for event in replay:
            await stream.write(event)
        return await _silent(request, stream)


async def _silent(request: web.Request, stream: web.StreamResponse) -> web.StreamResponse:
    """Nothing more, as vLLM's background stream after a cancel or an error event, until
    the router closes the connection."""
    for _ in range(600):
        if request.transport is None or request.transport.is_closing():
            break
        await asyncio.sleep(0.05)
    return stream


async def _read_until(stream: httpx.Response, seen: list[str], first: asyncio.Event) -> None:
    async for text in stream.aiter_text():
        seen.append(text)
        if "response.created" in "".join(seen):
            first.set()


async def test_a_get_or_cancel_that_finds_its_worker_gone_marks_it_down(
        tmp_path: Path, tiny_model_dir: Path) -> None:
    """As a chat request's failure does (forwarding.py): the worker marked down (the
    next request naming its responses is told 503 without trying it) and probed; the
    client told which response and worker, and to retry later. Before, the worker stayed
    up: every GET and cancel tried it again and got the same 502."""
    stub = ResponsesStub(str(tiny_model_dir))
    await stub.start()
    settings = router_settings(tmp_path, [("w0", stub.url)])
    async with running_router(settings) as router, httpx.AsyncClient(timeout=30) as client:
        url = f"{router.url}/v1/responses"
        response_id = (await client.post(url, json=create())).json()["id"]
        await stub.stop()
        got = await client.get(f"{url}/{response_id}")
        assert got.status_code == 502, got.text
        error = got.json()["error"]
        assert error["param"] == "response_id"
        assert (f"Response with id '{response_id}' is held by worker w0, which could not "
                "be reached") in error["message"] and "retry later" in error["message"]
        worker = router.runtime.workers.get("w0")
        assert worker is not None and not worker.routable
        assert "Connect" in (worker.last_http_error or "")
        again = await client.post(f"{url}/{response_id}/cancel", headers=MARKED)
        assert again.status_code == 503
        assert "which is unavailable now" in again.json()["error"]["message"]
        samples = await scrape(client, router.url)
        assert sample(samples, "kvhint_router_response_id_requests_total", op="get",
                      code="502") == 1
        assert sample(samples, "kvhint_router_response_id_misses_total",
                      reason="worker_down") == 1


async def test_a_cancelled_background_response_s_streams_are_ended_by_the_router(
        tmp_path: Path, tiny_model_dir: Path) -> None:
    """vLLM sends nothing after a cancel (responses_cancels.py): the stream that started
    the response and a GET streaming it end within ``cancel_grace_s`` of the cancel
    with a terminal event, ``response.failed`` on the cancelled response, and so does a
    GET streaming it after the cancel. Before, each stayed open, silent, until
    request_timeout_s (600 s) or the client gave up."""
    stub = BackgroundStreamStub(str(tiny_model_dir))
    await stub.start()
    settings = router_settings(tmp_path, [("w0", stub.url)],
                               responses={"cancel_grace_s": 0.3})
    try:
        async with running_router(settings) as router, \
                httpx.AsyncClient(timeout=30) as client:
            url = f"{router.url}/v1/responses"
            started, fetched = asyncio.Event(), asyncio.Event()
            made: list[str] = []
            got: list[str] = []
            async with client.stream("POST", url, json=create(
                    background=True, stream=True)) as original:
                assert original.status_code == 200
                reading = asyncio.create_task(_read_until(original, made, started))
                await asyncio.wait_for(started.wait(), 10)
                response_id = events("".join(made))[0][1]["response"]["id"]
                async with client.stream("GET", f"{url}/{response_id}",
                                         params={"stream": "true"}) as watching:
                    assert watching.status_code == 200
                    following = asyncio.create_task(_read_until(watching, got, fetched))
                    await asyncio.wait_for(fetched.wait(), 10)
                    cancel = await client.post(f"{url}/{response_id}/cancel",
                                               headers=MARKED)
                    assert cancel.status_code == 200, cancel.text
                    assert cancel.json()["status"] == "cancelled"
                    # Ended by the router, well within request_timeout_s.
                    await asyncio.wait_for(asyncio.gather(reading, following), 10)
            # A stream of it opened after the cancel gets no terminal event from vLLM
            # either (its events replayed, then silence): ended within the grace too.
            async with client.stream("GET", f"{url}/{response_id}",
                                     params={"stream": "true"}) as late:
                later = (await asyncio.wait_for(late.aread(), 10)).decode()
            for text, count in (("".join(made), 3), ("".join(got), 3), (later, 3)):
                relayed = events(text)
                assert len(relayed) == count + 1, relayed
                kind, last = relayed[-1]
                assert kind == "response.failed"
                assert last["sequence_number"] == count
                assert last["response"]["id"] == response_id
                assert last["response"]["status"] == "cancelled"
            assert len(router.app.state.responses.cancels) == 0  # none left watched
            samples = await scrape(client, router.url)
            assert sample(samples, "kvhint_router_responses_cancel_ends_total") == 3
            assert sample(samples, "kvhint_router_response_id_requests_total", op="get",
                          code="200") == 2
            # Cancelled by its client: a 499, not a broken response (the worker did what
            # it was asked; before, the POST's stream counted as one).
            assert sample(samples, "kvhint_router_requests_total", endpoint="responses",
                          worker="w0", code="499") == 1
            assert not sample(samples, "kvhint_router_broken_responses_total", worker="w0")
    finally:
        await stub.stop()


async def test_a_background_response_s_stream_ends_at_its_error_event(
        tmp_path: Path, tiny_model_dir: Path) -> None:
    """vLLM's background stream ends at response.completed only: after an ``error``
    event nothing comes, for good. The router ends the stream there (the client has its
    answer), the one that started the response and a GET of it alike. Before, both
    stayed open until request_timeout_s."""
    stub = BackgroundStreamStub(str(tiny_model_dir))
    stub.fail = True
    await stub.start()
    settings = router_settings(tmp_path, [("w0", stub.url)])
    try:
        async with running_router(settings) as router, \
                httpx.AsyncClient(timeout=30) as client:
            url = f"{router.url}/v1/responses"
            async with client.stream("POST", url, json=create(
                    background=True, stream=True)) as original:
                made = events((await asyncio.wait_for(original.aread(), 10)).decode())
            response_id = made[0][1]["response"]["id"]
            async with client.stream("GET", f"{url}/{response_id}",
                                     params={"stream": "true"}) as got:
                await asyncio.wait_for(got.aread(), 10)
            assert [kind for kind, _d in made][-1] == "error"
            samples = await scrape(client, router.url)
            assert sample(samples, "kvhint_router_response_id_requests_total", op="get",
                          code="200") == 1
            assert not sample(samples, "kvhint_router_responses_cancel_ends_total")
    finally:
        await stub.stop()


@pytest.mark.parametrize("mode", ["die_mid_stream", "ok"])
async def test_a_streamed_response_is_learnt_once_its_worker_stored_it(
        tmp_path: Path, tiny_model_dir: Path, mode: str) -> None:
    """vLLM stores a streamed response just before its response.completed, never one
    whose stream broke first: the router learns its id (and its session, for the
    store) at that event, not when the stream starts. Before, a stream that broke after
    response.created left the router holding an id its worker never stored."""
    stub = ResponsesStub(str(tiny_model_dir), mode=mode)
    await stub.start()
    settings = router_settings(tmp_path, [("w0", stub.url)])
    try:
        async with running_router(settings) as router, \
                httpx.AsyncClient(timeout=30) as client:
            async with client.stream("POST", f"{router.url}/v1/responses", json=create(
                    stream=True, session_id="s1")) as streamed:
                relayed: list[tuple[str, dict[str, Any]]] = events(
                    (await streamed.aread()).decode())
            response_id = relayed[0][1]["response"]["id"]
            ids = router.app.state.responses.ids
            samples = await scrape(client, router.url)
            if mode == "ok":
                assert relayed[-1][0] == "response.completed"
                assert len(ids) == 1 and ids.find(response_id, "default").session_id == "s1"
                assert sample(samples, "kvhint_router_response_ids") == 1
            else:
                assert relayed[-1][0] == "response.failed"
                assert len(ids) == 0
                assert not sample(samples, "kvhint_router_response_ids")
    finally:
        await stub.stop()
