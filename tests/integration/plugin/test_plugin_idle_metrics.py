"""What the plugin shows on vLLM's /metrics must not stay behind once the engine is idle.

vLLM reads connector stats in ``update_from_output`` before it drains the step's KV
events, and an idle engine runs no step: figures that changed after the last reading (the
last step's events, NATS going away or coming back) reach /metrics only through one more
step, which the connector asks for (``has_pending_push_work``) and the transport wakes an
idle engine for. Checked on vLLM's real Scheduler, stepping it as EngineCore's busy loop
does: while ``has_requests()`` (which asks the connector), and not after.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

from scheduler_fixtures import nats_plugin, prompt, sched, until

from kvhint.engine_plugin.headless import HeadlessScheduler
from kvhint.router.devstack.nats_server import NatsServerProcess

MAX_STEPS = 50  # an idle engine must come to rest, not spin


def _step_until_idle(h: HeadlessScheduler, shown: dict[str, Any]) -> int:
    """Step as EngineCore does until the scheduler says there is no work; fold what each
    step shipped to the front end into ``shown`` (counters summed, gauges replaced), as
    the API server's /metrics does. Returns the steps taken."""
    steps = 0
    while h.scheduler.has_requests():
        assert steps < MAX_STEPS, "the engine never came to rest"
        _, outputs = h.step()
        steps += 1
        for eco in outputs.values():
            stats = eco.scheduler_stats
            data = stats.kv_connector_stats if stats is not None else None
            for key, value in (data or {}).items():
                if key in ("index_blocks", "index_sessions", "nats_connected"):
                    shown[key] = value
                elif isinstance(value, int):
                    shown[key] = shown.get(key, 0) + value
    return steps


def test_an_idle_engine_shows_its_last_steps_index_without_nats() -> None:
    """Before, /metrics showed the index as it was before the last step's events: 0
    blocks after a worker's first requests, and without NATS (or with NATS unreachable)
    nothing ever woke the idle engine to ship the rest, until the next request."""
    h = sched()
    core = h.connector.core
    shown: dict[str, Any] = {}
    for session, blocks in (("s", [1, 2, 3]), ("t", [1, 2, 7, 8])):
        h.add(h.make_request(prompt(blocks), session_id=session, max_tokens=2))
        _step_until_idle(h, shown)
        assert len(core.index) > 0
        assert shown["index_blocks"] == len(core.index)
        assert shown["index_sessions"] == core.index.num_sessions
        assert shown["index_events"] == core.index.counters.events
    assert shown["index_sessions"] == 2
    # At rest: no step asked for, none taken.
    assert not h.scheduler.has_requests()
    assert _step_until_idle(h, shown) == 0


async def test_nats_leaving_and_coming_back_reaches_metrics_of_an_idle_engine(
        own_nats: NatsServerProcess, subject_prefix: str) -> None:
    """Before, ``kvhint:nats_connected`` stayed at its last value on an idle engine: 0
    for good after NATS came back (until a request came), 1 while it was down."""
    with nats_plugin(own_nats.url, subject_prefix, create_events_stream=False) as h:
        woken = threading.Event()
        h.connector.core.mailbox.wake_engine = woken.set  # vLLM's waker, in a server
        await until(lambda: h.connector.transport.connected)
        shown: dict[str, Any] = {}
        await until(lambda: _step_until_idle(h, shown) >= 0 and shown.get("nats_connected") == 1)
        for up in (False, True):
            woken.clear()
            if up:
                own_nats.start()
            else:
                own_nats.stop()
            await until(lambda: h.connector.transport.connected is up, timeout_s=20)
            await until(woken.is_set)  # the idle engine is woken, and steps:

            def shown_now() -> bool:
                _step_until_idle(h, shown)  # while the scheduler asks for a step
                return shown.get("nats_connected") == int(up)

            await until(shown_now)
            assert not h.scheduler.has_requests()


async def test_an_outage_wakes_an_idle_engine_for_the_connection_not_each_reconnect(
        own_nats: NatsServerProcess, subject_prefix: str) -> None:
    """Each step of an idle engine keeps vLLM's worker busy-polling for a second (its
    shared-memory queue): woken for every NATS error of an outage (one per reconnect
    attempt), a CPU worker burnt a core for as long as NATS was down. The connection's
    change wakes it at once; other changes at most every METRICS_WAKE_EVERY_S."""
    with nats_plugin(own_nats.url, subject_prefix, create_events_stream=False) as h:
        transport = h.connector.transport
        wakes: list[float] = []
        h.connector.core.mailbox.wake_engine = lambda: wakes.append(time.monotonic())
        await until(lambda: transport.connected)
        shown: dict[str, Any] = {}
        await until(lambda: _step_until_idle(h, shown) >= 0 and shown.get("nats_connected") == 1)
        own_nats.stop()
        await until(lambda: not transport.connected)
        wakes.clear()
        errors = transport.counters.nats_other_errors
        end = time.monotonic() + 4.0
        while time.monotonic() < end:  # the engine steps whenever it is asked to
            _step_until_idle(h, shown)
            await asyncio.sleep(0.05)
        assert transport.counters.nats_other_errors >= errors + 2  # reconnect attempts
        assert shown["nats_connected"] == 0
        assert len(wakes) <= 1
