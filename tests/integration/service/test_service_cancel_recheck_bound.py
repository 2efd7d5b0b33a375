"""A cancel recheck (responses_cancel_rechecks.py) reads a worker's stored Responses
object: an answer whose size is that of any non-streamed answer, bounded by
``upstream_answer_max_bytes`` (the pool's), not by the 1 MiB bound of a model listing
(``SMALL_ANSWER_MAX_BYTES``). A stored response echoes its request's instructions and
tools (up to ``max_body_bytes``) and holds its whole output: one past 1 MiB was read as
no answer, counted ``response_cancel_recheck_failed``, and its streams here waited for
events vLLM never sends until ``background_idle_s`` / ``request_timeout_s``.

A stand-in worker (aiohttp): a real vLLM server holding a cancelled response of that
size needs a generation of that length first."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from aiohttp import web
from conftest import serving_app

from kvhint.router.service.metrics import RouterMetrics
from kvhint.router.service.responses_cancel_rechecks import recheck_streams
from kvhint.router.service.responses_cancels import CancelWatches
from kvhint.router.service.upstream import SMALL_ANSWER_MAX_BYTES, UpstreamPool
from kvhint.router.service.workers import WorkerRegistry

# A stored response's instructions, past the small bound (well within max_body_bytes).
INSTRUCTIONS = "x" * (2 * SMALL_ANSWER_MAX_BYTES)


async def _stored(request: web.Request) -> web.Response:
    return web.json_response({"id": request.match_info["id"], "object": "response",
                              "status": "cancelled", "instructions": INSTRUCTIONS,
                              "output": []})


@pytest.fixture
async def worker_url() -> AsyncIterator[str]:
    app = web.Application(client_max_size=0)
    app.router.add_get("/v1/responses/{id}", _stored)
    async with serving_app(app) as url:
        yield url


async def test_a_large_stored_response_is_rechecked_within_the_answer_bound(
        worker_url: str) -> None:
    metrics = RouterMetrics()
    pool = UpstreamPool(1.0, 30.0, keepalive_s=1.0)  # upstream_answer_max_bytes default
    await pool.start()
    watches = CancelWatches(grace_s=5.0)
    watch = watches.watch("resp_big", lambda: None, "w0")
    found: list[str] = []

    def on_cancelled(response_id: str, answer: dict[str, object]) -> int:
        found.append(response_id)
        return watches.cancelled(response_id, answer)

    try:
        recovered = await asyncio.wait_for(recheck_streams(
            watches, WorkerRegistry([("w0", worker_url)]), pool, metrics, on_cancelled), 20)
    finally:
        watch.end()
        await pool.close()
    assert recovered == 1 and found == ["resp_big"]
    assert not metrics.registry.get_sample_value(
        "kvhint_router_drops_total", {"what": "response_cancel_recheck_failed"})
    assert metrics.registry.get_sample_value(
        "kvhint_router_responses_cancel_notices_total", {"outcome": "recovered"}) == 1
