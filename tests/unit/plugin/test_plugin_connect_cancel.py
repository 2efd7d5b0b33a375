"""A connect attempt that swallows a cancellation still ends when the transport stops.

nats-py's connect can swallow one cancellation between two tries (its ``_close`` catches
CancelledError while it waits for its reconnection task) and go on trying. The attempt
here is a stand-in that does exactly that, because the real window is one await inside
nats-py that no test can hit on cue; CI once hit it, and the transport's thread outlived
``stop()`` by its whole 5 s join."""

from __future__ import annotations

import asyncio
import time

from kvhint.engine_plugin.transport_connect import _cancelled


async def _swallows_one_cancellation() -> None:
    try:
        await asyncio.sleep(30)
    except asyncio.CancelledError:
        pass  # what nats-py's _close does with it
    await asyncio.sleep(30)  # the next try


async def test_an_attempt_that_swallows_a_cancellation_is_cancelled_until_it_ends() -> None:
    attempt = asyncio.ensure_future(_swallows_one_cancellation())
    await asyncio.sleep(0)  # started
    started = time.monotonic()
    await asyncio.wait_for(_cancelled(attempt), 5)
    assert attempt.cancelled()
    assert time.monotonic() - started < 1.0
