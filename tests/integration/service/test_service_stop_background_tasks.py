"""The router's stop ends its background tasks (task_set.py) before it closes what they
use: a cancel recheck (responses_cancel_rechecks.py) still waiting on its worker when the
router stops is cancelled and awaited, not left to run on against a closed HTTP pool (a
failed check counted, a warning logged) or destroyed pending when the loop closes.

The recheck is started the way the NATS link's coming back starts it (CancelNotices'
on_link_up, the Responses gateway's); the stream it checks is a watch the gateway keeps
for an open stream (responses_cancels.py), made directly: what is tested is the task's
lifetime, not how a stream is relayed (test_service_responses_cancel_outage.py)."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

import pytest
from aiohttp import web

from conftest import router_settings, running_router, serving_app
from feed_helpers import until


async def test_a_cancel_recheck_in_flight_at_stop_is_cancelled_and_awaited(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    asked, released = asyncio.Event(), asyncio.Event()

    async def hanging_get(_request: web.Request) -> web.Response:
        asked.set()
        await released.wait()  # a worker that does not answer the check (till the end)
        return web.json_response({"status": "in_progress"})

    async def models(_request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": []})

    async def health(_request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_get("/v1/responses/{id}", hanging_get)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    async with serving_app(app) as worker_url:
        caplog.set_level(logging.WARNING)
        try:
            settings = router_settings(tmp_path, [("w0", worker_url)])
            async with running_router(settings) as router:
                runtime = router.app.state.runtime
                gateway = router.app.state.responses
                gateway.cancels.watch("resp_open", lambda: None, "w0")
                before = asyncio.all_tasks()
                runtime.cancel_notices.on_link_up()
                started = asyncio.all_tasks() - before
                assert started  # the recheck
                await asyncio.wait_for(asked.wait(), 5)
                stopping_at = time.monotonic()
                caplog.clear()
            assert time.monotonic() - stopping_at < 3.0
            # Ended by the stop; before, still pending (or failed on the closed pool).
            await until(lambda: all(task.done() for task in started), timeout_s=0.5)
            assert all(task.cancelled() for task in started)
            assert runtime.metrics.drops.labels(
                "response_cancel_recheck_failed")._value.get() == 0
            assert not [r for r in caplog.records if "cancel not checked" in r.getMessage()
                        or r.levelno >= logging.ERROR], caplog.text
        finally:
            released.set()


async def test_a_background_task_that_raises_is_counted(
        tmp_path: Path, stub_workers: list) -> None:
    """A background task of the runtime's (a feed check, a cancel recheck or resend) that
    raised lost its work: counted as a periodic job's failed round
    (``drops_total{what="periodic_job_error"}``); before, only a log line said so."""
    settings = router_settings(tmp_path, [("w0", stub_workers[0].url)])
    async with running_router(settings) as router:
        runtime = router.app.state.runtime
        failed = runtime.metrics.drops.labels("periodic_job_error")

        async def fails() -> None:
            raise RuntimeError("a background task's bug")

        before = failed._value.get()
        task = runtime.tasks.spawn(fails(), "fails")
        assert task is not None
        await asyncio.gather(task, return_exceptions=True)
        await until(lambda: failed._value.get() == before + 1, timeout_s=1.0)
