"""A relayed stream whose worker sends one event without end (no blank line, for good):
the router's relay held its bytes for as long as they came, growing its memory without
bound. Past ``stream_event_max_bytes`` it now drops them, closes the worker's stream and
ends the client's as a broken one (relay_end.py ``RelayEnd.broken``, response_scan.py
``EventTooLarge``): an OpenAI error event (chat), ``response.failed`` (Responses, a POST's
stream and a streamed GET), 502, counted.

Stand-in workers (aiohttp servers speaking vLLM's event shapes): a real vLLM server never
sends an event without its end; a worker gone wrong or a proxy in front of it may."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
from aiohttp import web

from conftest import StubWorker, router_settings, running_router, sample, scrape
from test_service_responses_api import ResponsesStub, create, events

LIMIT = 256 * 1024
# What the worker sends of its endless event before it waits (holding the stream open):
# past LIMIT, so a bounded relay ends the stream; an unbounded one waited on.
SENT = 4 * LIMIT
PIECE = b"x" * (16 * 1024)
HOLD_S = 60.0
_RESPONSES_HEAD = b'event: response.output_text.delta\ndata: {"cut-here": "'


async def _endless_event(request: web.Request, stream: web.StreamResponse, head: bytes
                         ) -> None:
    """``head`` then SENT bytes of the same event with no end, then the stream held
    open (silent) for HOLD_S, or until the router closes it: the router must not wait
    for the rest."""
    await stream.write(head)
    for _ in range(SENT // len(PIECE)):
        await stream.write(PIECE)
    for _ in range(int(HOLD_S / 0.1)):
        if request.transport is None or request.transport.is_closing():
            return
        await asyncio.sleep(0.1)


class EndlessChat(StubWorker):
    """Streams one content delta, then an event that never ends."""

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        self.received.append(await request.json())
        stream = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await stream.prepare(request)
        delta = {"id": "x", "choices": [{"index": 0, "delta": {"content": "hel"},
                                         "finish_reason": None}]}
        await stream.write(b"data: " + json.dumps(delta).encode() + b"\n\n")
        await _endless_event(request, stream, b'data: {"id": "x", "cut-here": "')
        return stream


class EndlessResponses(ResponsesStub):
    """Streams ``response.created`` and one delta, then an event that never ends; a GET
    streaming a stored response likewise after its ``response.created``."""

    async def _create(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.received.append(body)
        response = self._response(body, "in_progress")
        self.store[response["id"]] = response
        stream = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await stream.prepare(request)
        sent: list[tuple[str, dict[str, Any]]] = [
            ("response.created", {"response": response}),
            ("response.output_text.delta", {"item_id": "msg_1", "output_index": 0,
                                            "content_index": 0, "delta": "hel"})]
        for number, (kind, data) in enumerate(sent):
            event = {"type": kind, "sequence_number": number, **data}
            await stream.write(f"event: {kind}\ndata: {json.dumps(event)}\n\n".encode())
        await _endless_event(request, stream, _RESPONSES_HEAD)
        return stream

    async def _get(self, request: web.Request) -> web.StreamResponse:
        response_id = request.match_info["id"]
        if request.query.get("stream") != "true" or response_id not in self.store:
            return await super()._get(request)
        stream = await self._stream_created(request, response_id)
        await _endless_event(request, stream, _RESPONSES_HEAD)
        return stream


async def test_a_chat_event_past_the_bound_ends_the_stream_broken(tmp_path: Path) -> None:
    """The client gets the delta, then an OpenAI error event (502) naming the bound, at
    once rather than after the worker's HOLD_S; none of the endless event's bytes; the
    request is accounted as a 502 and counted as a broken response."""
    stub = EndlessChat()
    await stub.start()
    settings = router_settings(tmp_path, [("w0", stub.url)], stream_event_max_bytes=LIMIT)
    body = {"model": "stub", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    try:
        async with running_router(settings) as router, \
                httpx.AsyncClient(timeout=30) as client:
            async with client.stream("POST", f"{router.url}/v1/chat/completions",
                                     json=body) as streamed:
                assert streamed.status_code == 200
                text = (await asyncio.wait_for(streamed.aread(), 10)).decode()
            relayed = [e.removeprefix("data: ") for e in text.split("\n\n") if e.strip()]
            assert len(relayed) == 2, text[:500]
            assert json.loads(relayed[0])["choices"][0]["delta"]["content"] == "hel"
            error = json.loads(relayed[1])["error"]
            assert error["code"] == 502, error
            assert "stream_event_max_bytes" in error["message"]
            assert "cut-here" not in text and len(text) < LIMIT
            samples = await scrape(client, router.url)
            assert sample(samples, "kvhint_router_broken_responses_total", worker="w0") == 1
            assert sample(samples, "kvhint_router_requests_total", endpoint="chat",
                          worker="w0", code="502") == 1
    finally:
        await stub.stop()


async def test_a_responses_event_past_the_bound_ends_the_stream_failed(
        tmp_path: Path, tiny_model_dir: Path) -> None:
    """A POST's stream and a streamed GET: ``response.failed`` (the announced response,
    status failed, the next sequence number) naming the bound, at once; none of the
    endless event's bytes; each accounted as a 502 and counted, with reason
    ``event_too_large``."""
    stub = EndlessResponses(str(tiny_model_dir))
    await stub.start()
    settings = router_settings(tmp_path, [("w0", stub.url)], stream_event_max_bytes=LIMIT)
    try:
        async with running_router(settings) as router, \
                httpx.AsyncClient(timeout=30) as client:
            url = f"{router.url}/v1/responses"
            async with client.stream("POST", url, json=create(stream=True)) as streamed:
                assert streamed.status_code == 200
                text = (await asyncio.wait_for(streamed.aread(), 10)).decode()
            relayed = events(text)
            assert [kind for kind, _d in relayed] == [
                "response.created", "response.output_text.delta", "response.failed"]
            response_id = relayed[0][1]["response"]["id"]
            async with client.stream("GET", f"{url}/{response_id}",
                                     params={"stream": "true"}) as got:
                fetched_text = (await asyncio.wait_for(got.aread(), 10)).decode()
            fetched = events(fetched_text)
            assert [kind for kind, _d in fetched] == ["response.created", "response.failed"]
            for stream, whole in ((relayed, text), (fetched, fetched_text)):
                last = stream[-1][1]
                assert last["sequence_number"] == len(stream) - 1
                assert last["response"]["id"] == response_id
                assert last["response"]["status"] == "failed"
                assert "stream_event_max_bytes" in last["response"]["error"]["message"]
                assert "cut-here" not in whole and len(whole) < LIMIT
            samples = await scrape(client, router.url)
            assert sample(samples, "kvhint_router_responses_router_ends_total",
                          reason="event_too_large") == 2
            assert sample(samples, "kvhint_router_broken_responses_total", worker="w0") == 2
            assert sample(samples, "kvhint_router_requests_total", endpoint="responses",
                          worker="w0", code="502") == 1
            assert sample(samples, "kvhint_router_response_id_requests_total", op="get",
                          code="502") == 1
    finally:
        await stub.stop()
