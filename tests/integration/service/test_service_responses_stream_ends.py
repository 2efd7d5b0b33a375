"""Responses streams that the worker leaves without a terminal event, which the router
ends itself with ``response.failed`` (relay_end.py ``RelayEnd``, responses_cancels.py):
a stream the worker closes cleanly before one, and a background
response's stream that goes silent for good (vLLM 0.32 when the response's background
task dies of an exception other than a ``GenerationError``: its
``responses_background_stream_generator`` then waits for an event that never comes).

Stand-in workers (aiohttp servers speaking vLLM 0.32's event shapes, from
test_service_responses_api.py / test_service_responses_faults.py): a real vLLM server
cannot be made to do either on demand (it never closes a stream early on its own, and its
background task dies only of an engine fault)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from aiohttp import web

from conftest import router_settings, running_router, sample, scrape
from test_service_responses_api import ResponsesStub, create, events
from test_service_responses_faults import BackgroundStreamStub


class CutShortStub(ResponsesStub):
    """Streams ``response.created``, ``response.in_progress`` and one delta, then ends
    the HTTP stream cleanly (its chunked end sent: no break) with no terminal event;
    ``mid_event``: half of one more event first. A GET streaming a stored response
    does the same after its ``response.created``."""

    mid_event = False

    async def _create(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.received.append(body)
        response = self._response(body, "in_progress")
        self.store[response["id"]] = response
        stream = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await stream.prepare(request)
        sent: list[tuple[str, dict[str, Any]]] = [
            ("response.created", {"response": response}),
            ("response.in_progress", {"response": response}),
            ("response.output_text.delta", {"item_id": "msg_1", "output_index": 0,
                                            "content_index": 0, "delta": "hel"})]
        for number, (kind, data) in enumerate(sent):
            event = {"type": kind, "sequence_number": number, **data}
            await stream.write(f"event: {kind}\ndata: {json.dumps(event)}\n\n".encode())
        if self.mid_event:
            await stream.write(b'event: response.output_text.delta\ndata: {"cut-here": ')
        await stream.write_eof()
        return stream

    async def _get(self, request: web.Request) -> web.StreamResponse:
        response_id = request.match_info["id"]
        if request.query.get("stream") != "true" or response_id not in self.store:
            return await super()._get(request)
        self.fetched.append(response_id)
        stream = await self._stream_created(request, response_id)
        await stream.write_eof()
        return stream


@pytest.mark.parametrize("mid_event", [False, True])
async def test_a_stream_closed_without_a_terminal_event_ends_failed(
        tmp_path: Path, tiny_model_dir: Path, mid_event: bool) -> None:
    """The worker closes the stream cleanly before any terminal event: the client gets
    ``response.failed`` (the response ``response.created`` announced, status failed,
    next sequence number), an unfinished last event is dropped rather than passed on
    glued to it, the request is accounted as a 502 and counted. Before, the stream just
    ended: the OpenAI SDK's stream had no terminal event (or choked on the cut one)."""
    stub = CutShortStub(str(tiny_model_dir))
    stub.mid_event = mid_event
    await stub.start()
    settings = router_settings(tmp_path, [("w0", stub.url)])
    try:
        async with running_router(settings) as router, \
                httpx.AsyncClient(timeout=30) as client:
            url = f"{router.url}/v1/responses"
            async with client.stream("POST", url, json=create(stream=True)) as streamed:
                assert streamed.status_code == 200
                text = (await asyncio.wait_for(streamed.aread(), 10)).decode()
            relayed = events(text)
            assert [kind for kind, _d in relayed] == [
                "response.created", "response.in_progress", "response.output_text.delta",
                "response.failed"], text
            last = relayed[-1][1]
            response_id = relayed[0][1]["response"]["id"]
            assert last["sequence_number"] == 3
            assert last["response"]["id"] == response_id
            assert last["response"]["status"] == "failed"
            message = last["response"]["error"]["message"]
            assert "without a terminal event" in message
            assert ("bytes dropped" in message) == mid_event
            assert "cut-here" not in text
            # A GET streaming it that the worker closes after response.created alike.
            async with client.stream("GET", f"{url}/{response_id}",
                                     params={"stream": "true"}) as got:
                fetched = events((await asyncio.wait_for(got.aread(), 10)).decode())
            assert [kind for kind, _d in fetched] == ["response.created",
                                                      "response.failed"]
            assert fetched[-1][1]["sequence_number"] == 1
            samples = await scrape(client, router.url)
            assert sample(samples, "kvhint_router_responses_router_ends_total",
                          reason="unterminated") == 2
            assert sample(samples, "kvhint_router_broken_responses_total", worker="w0") == 2
            assert sample(samples, "kvhint_router_requests_total", endpoint="responses",
                          worker="w0", code="502") == 1
            assert sample(samples, "kvhint_router_response_id_requests_total", op="get",
                          code="502") == 1
    finally:
        await stub.stop()


async def test_a_silent_background_stream_ends_failed_after_the_idle_bound(
        tmp_path: Path, tiny_model_dir: Path) -> None:
    """A background response's streams (the ``stream: true`` POST that started it and a
    GET of it) go silent after three events, as vLLM's do once its background task died
    of a non-generation error: each ends with ``response.failed`` (504, saying why)
    within ``responses.background_idle_s``, counted. Before, each stayed open until
    request_timeout_s (600 s)."""
    stub = BackgroundStreamStub(str(tiny_model_dir))
    await stub.start()
    settings = router_settings(tmp_path, [("w0", stub.url)],
                               responses={"background_idle_s": 0.5})
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
                fetched = events((await asyncio.wait_for(got.aread(), 10)).decode())
            for relayed in (made, fetched):
                assert len(relayed) == 4, relayed
                kind, last = relayed[-1]
                assert kind == "response.failed" and last["sequence_number"] == 3
                assert last["response"]["id"] == response_id
                assert last["response"]["status"] == "failed"
                assert "responses.background_idle_s" in last["response"]["error"]["message"]
            assert len(router.app.state.responses.cancels) == 0  # none left watched
            samples = await scrape(client, router.url)
            assert sample(samples, "kvhint_router_responses_router_ends_total",
                          reason="background_idle") == 2
            assert not sample(samples, "kvhint_router_responses_cancel_ends_total")
            # Accounted as the 504 the event says, once each as a broken response (the
            # POST's was counted twice, the GET's accounted as a 200).
            assert sample(samples, "kvhint_router_broken_responses_total", worker="w0") == 2
            assert sample(samples, "kvhint_router_requests_total", endpoint="responses",
                          worker="w0", code="504") == 1
            assert sample(samples, "kvhint_router_response_id_requests_total", op="get",
                          code="504") == 1
    finally:
        await stub.stop()
