"""The runtime's background tasks (task_set.py): closed, each running one is cancelled and
awaited, and none starts after (a NATS reconnect during the stop)."""

from __future__ import annotations

import asyncio
import logging
import warnings

import pytest

from kvhint.router.service.task_set import TaskSet


def test_close_cancels_and_awaits_running_tasks_and_refuses_new_ones() -> None:
    async def scenario() -> None:
        tasks = TaskSet()
        ended: list[str] = []

        async def waits() -> None:
            try:
                await asyncio.sleep(60)
            finally:
                ended.append("waits")

        running = tasks.spawn(waits(), "waits")
        assert running is not None and len(tasks) == 1
        await asyncio.sleep(0)
        await tasks.close()
        assert running.cancelled() and ended == ["waits"] and len(tasks) == 0
        late = waits()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # "coroutine ... was never awaited" would raise
            assert tasks.spawn(late) is None
        assert late.cr_frame is None  # closed, never started
    asyncio.run(scenario())


def test_a_failed_task_is_logged_with_its_traceback(caplog: pytest.LogCaptureFixture) -> None:
    async def scenario() -> None:
        failures: list[None] = []
        tasks = TaskSet(on_failed=lambda: failures.append(None))

        async def fails() -> None:
            raise ValueError("boom")

        task = tasks.spawn(fails(), "fails")
        assert task is not None
        await asyncio.gather(task, return_exceptions=True)
        await asyncio.sleep(0)
        assert len(tasks) == 0
        assert len(failures) == 1  # counted once (the runtime: periodic_job_error)
        waits = tasks.spawn(asyncio.sleep(60), "waits")
        await tasks.close()
        assert waits is not None and waits.cancelled() and len(failures) == 1
    with caplog.at_level(logging.ERROR):
        asyncio.run(scenario())
    assert "background task fails failed" in caplog.text and "boom" in caplog.text
