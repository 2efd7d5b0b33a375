"""A worker's answer the router reads whole (a request without ``stream``, a plain
``GET /v1/responses/{id}``) was read with no bound: a worker, or a proxy in front of it,
answering a huge or endless body grew the router's memory for as long as it sent.
Past ``upstream_answer_max_bytes`` the router now stops reading, closes the worker's
connection and answers 502 (an OpenAI error naming the bound), counted as a broken
response; the request is accounted as any broken answer's 502, and the router serves on.

Stand-in workers (aiohttp servers): a real vLLM server never answers past the bound on
cue; a worker gone wrong or a proxy before it may."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from aiohttp import web

from conftest import StubWorker, router_settings, running_router, sample, scrape
from test_service_responses_api import ResponsesStub, create

LIMIT = 256 * 1024
# What an endless answer sends before it waits (holding the connection open): past
# LIMIT, so a bounded read stops; an unbounded one waits on, for HOLD_S.
SENT = 4 * LIMIT
PIECE = b"x" * (16 * 1024)
HOLD_S = 60.0


async def _endless(request: web.Request, head: bytes) -> tuple[web.StreamResponse, bool]:
    """A 200 JSON body sent chunked (no Content-Length): ``head`` then SENT bytes, then
    the connection held open for HOLD_S or until the router closes it (True)."""
    answer = web.StreamResponse(headers={"Content-Type": "application/json"})
    await answer.prepare(request)
    await answer.write(head)
    for _ in range(SENT // len(PIECE)):
        await answer.write(PIECE)
    for _ in range(int(HOLD_S / 0.05)):
        if request.transport is None or request.transport.is_closing():
            return answer, True
        await asyncio.sleep(0.05)
    return answer, False


@dataclass
class HugeChat(StubWorker):
    """``huge``: "endless" (a chunked body past the bound, then held open),
    "declared" (a whole body past the bound with its Content-Length), or None (the
    stub's own answers)."""

    huge: str | None = None
    # Whether the router closed the connection of an endless answer before its end.
    closed_early: list[bool] = field(default_factory=list)

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        if self.huge is None:
            return await super()._answer(request)
        self.received.append(await request.json())
        if self.huge == "declared":
            return web.Response(body=b'{"id": "x", "pad": "' + b"x" * SENT + b'"}',
                                content_type="application/json")
        answer, closed = await _endless(request, b'{"id": "x", "choices": [], "pad": "')
        self.closed_early.append(closed)
        return answer


@dataclass
class HugeResponses(ResponsesStub):
    """A plain GET of a stored response answered with an endless body (``huge``)."""

    huge: bool = False
    closed_early: list[bool] = field(default_factory=list)

    async def _get(self, request: web.Request) -> web.StreamResponse:
        if not self.huge or request.query.get("stream") == "true":
            return await super()._get(request)
        response_id = request.match_info["id"]
        self.fetched.append(response_id)
        answer, closed = await _endless(
            request, b'{"id": "' + response_id.encode() + b'", "instructions": "')
        self.closed_early.append(closed)
        return answer


def _assert_bound_error(answer: httpx.Response) -> None:
    assert answer.status_code == 502, answer.text[:300]
    assert len(answer.content) < LIMIT
    error = answer.json()["error"]
    assert error["code"] == 502, error
    assert "upstream_answer_max_bytes" in error["message"], error
    assert error["message"].startswith("worker failed while responding"), error


async def test_a_non_streamed_answer_past_the_bound_is_a_502(
        tmp_path: Path, tiny_model_dir: Path) -> None:
    """An endless chunked answer and one whose Content-Length is past the bound: each a
    502 naming the bound at once (not after the worker's HOLD_S), the worker's
    connection closed, accounted as a broken answer's 502 (its in-flight slot given back,
    the worker not marked down) and counted; the next request is served."""
    stub = HugeChat(model_root=str(tiny_model_dir))
    await stub.start()
    settings = router_settings(tmp_path, [("w0", stub.url)], upstream_answer_max_bytes=LIMIT)
    body = {"model": "stub", "messages": [{"role": "user", "content": "hi"}]}
    try:
        async with running_router(settings) as router, \
                httpx.AsyncClient(timeout=30) as client:
            url = f"{router.url}/v1/chat/completions"
            for huge in ("endless", "declared"):
                stub.huge = huge
                _assert_bound_error(await asyncio.wait_for(client.post(url, json=body), 10))
            await asyncio.sleep(0.2)  # the stand-in sees its connection closed
            assert stub.closed_early == [True]
            worker = router.runtime.workers.get("w0")
            assert worker is not None
            assert worker.inflight == 0 and worker.http_up
            stub.huge = None
            served = await client.post(url, json=body)
            assert served.status_code == 200, served.text
            assert served.json()["choices"][0]["message"]["content"] == "hello"
            samples = await scrape(client, router.url)
            assert sample(samples, "kvhint_router_broken_responses_total", worker="w0") == 2
            assert sample(samples, "kvhint_router_requests_total", endpoint="chat",
                          worker="w0", code="502") == 2
            assert sample(samples, "kvhint_router_requests_total", endpoint="chat",
                          worker="w0", code="200") == 1
    finally:
        await stub.stop()


async def test_a_stored_response_past_the_bound_is_a_502(
        tmp_path: Path, tiny_model_dir: Path) -> None:
    """A plain ``GET /v1/responses/{id}`` answered endlessly: a 502 naming the bound at
    once, the worker's connection closed, counted (``op="get"``, code 502, and as a
    broken response); the next GET is served."""
    stub = HugeResponses(str(tiny_model_dir))
    await stub.start()
    settings = router_settings(tmp_path, [("w0", stub.url)], upstream_answer_max_bytes=LIMIT)
    try:
        async with running_router(settings) as router, \
                httpx.AsyncClient(timeout=30) as client:
            url = f"{router.url}/v1/responses"
            made = await client.post(url, json=create())
            assert made.status_code == 200, made.text
            response_id = made.json()["id"]
            stub.huge = True
            _assert_bound_error(await asyncio.wait_for(
                client.get(f"{url}/{response_id}"), 10))
            await asyncio.sleep(0.2)
            assert stub.closed_early == [True]
            stub.huge = False
            fetched = await client.get(f"{url}/{response_id}")
            assert fetched.status_code == 200, fetched.text
            assert fetched.json()["id"] == response_id
            samples = await scrape(client, router.url)
            assert sample(samples, "kvhint_router_response_id_requests_total", op="get",
                          code="502") == 1
            assert sample(samples, "kvhint_router_response_id_requests_total", op="get",
                          code="200") == 1
            assert sample(samples, "kvhint_router_broken_responses_total", worker="w0") == 1
    finally:
        await stub.stop()
