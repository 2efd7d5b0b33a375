"""What the router reads whole from a worker that is small by nature is bounded by
``SMALL_ANSWER_MAX_BYTES`` (upstream.py): a ``/v1/models`` listing (model discovery at
start, the router's own ``/v1/models``) and the body of a 502/503/504 (passed to the
client where no other worker takes the request). Both were read with no bound: a worker
or a proxy before it answering an endless body grew the router's memory until the
read's timeout (``request_timeout_s``, 600 s by default), or for good while bytes kept
coming. A ``/health`` probe reads no body at all.

A stand-in server (aiohttp): a real vLLM server never answers so on cue."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from aiohttp import web
from conftest import serving_app

from kvhint.router.service.upstream import (
    SMALL_ANSWER_MAX_BYTES,
    AnswerTooLarge,
    UpstreamPool,
    UpstreamUnavailable,
)

PIECE = b"x" * (64 * 1024)
HOLD_S = 60.0


async def _endless(request: web.Request, status: int, head: bytes) -> web.StreamResponse:
    """``head``, then twice the bound chunked, then held open for HOLD_S or until the
    reader closes the connection."""
    answer = web.StreamResponse(status=status, headers={"Content-Type": "application/json"})
    await answer.prepare(request)
    await answer.write(head)
    for _ in range(2 * SMALL_ANSWER_MAX_BYTES // len(PIECE)):
        await answer.write(PIECE)
    for _ in range(int(HOLD_S / 0.05)):
        if request.transport is None or request.transport.is_closing():
            break
        await asyncio.sleep(0.05)
    return answer


async def _listing(request: web.Request) -> web.StreamResponse:
    return await _endless(request, 200, b'{"data": [{"id": "')


async def _small_listing(_request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [{"id": "m"}]})


async def _health(request: web.Request) -> web.StreamResponse:
    return await _endless(request, 200, b"")


async def _overloaded(request: web.Request) -> web.StreamResponse:
    return await _endless(request, 503, b"<html>overloaded")


@pytest.fixture
async def endless_worker() -> AsyncIterator[str]:
    """A server whose /v1/models, /health and chat answers never end; its URL."""
    app = web.Application()
    app.router.add_get("/v1/models", _listing)
    app.router.add_get("/small/v1/models", _small_listing)
    app.router.add_get("/health", _health)
    app.router.add_post("/v1/chat/completions", _overloaded)
    async with serving_app(app) as url:
        yield url


@pytest.fixture
async def pool() -> AsyncIterator[UpstreamPool]:
    # request_timeout_s far above the tests' own waits: an unbounded read would wait it.
    upstream = UpstreamPool(1.0, 120.0, keepalive_s=1.0)
    await upstream.start()
    try:
        yield upstream
    finally:
        await upstream.close()


async def test_a_model_listing_past_the_bound_fails_at_once(
        endless_worker: str, pool: UpstreamPool) -> None:
    """Past the bound: an AnswerTooLarge naming it, not a wait for the body's end (the
    callers take any failure as "no listing": discovery logs it, /v1/models answers 502
    where no worker listed). A listing within it is read as before."""
    with pytest.raises(AnswerTooLarge, match="a model listing's bound"):
        await asyncio.wait_for(pool.get_json(endless_worker + "/v1/models", timeout_s=60.0,
                                             worker_id="w0"), 10)
    listed = await pool.get_json(endless_worker + "/small/v1/models", timeout_s=5.0,
                                 worker_id="w0")
    assert listed == {"object": "list", "data": [{"id": "m"}]}


async def test_an_error_body_past_the_bound_is_left_unread(
        endless_worker: str, pool: UpstreamPool) -> None:
    """A 503 (a proxy's page) whose body never ends: the worker is unavailable at once,
    its status kept, its body dropped rather than read until request_timeout_s."""
    with pytest.raises(UpstreamUnavailable) as refused:
        await asyncio.wait_for(pool.open("w0", endless_worker + "/v1/chat/completions",
                                         b"{}"), 10)
    assert refused.value.status == 503
    assert refused.value.body == b""


async def test_a_probe_reads_no_body(endless_worker: str, pool: UpstreamPool) -> None:
    """A 200 is the answer; its body is not waited for."""
    result = await asyncio.wait_for(pool.probe(endless_worker + "/health", timeout_s=60.0,
                                               worker_id="w0"), 10)
    assert result.ok
