"""How the forwarder counts a stream whose worker response it closed for a client gone.

The disconnect callback closes the worker's response at once. If no read was pending
then, the response may still end as a clean end of stream rather than an error (what
aiohttp does with a response it has fully received). That is not a stream served:
unless the client got the terminal [DONE], it counts as 499, not as the worker's 200."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from types import SimpleNamespace

from kvhint.router.service.flight_accounting import Flight
from kvhint.router.service.forwarding import Forwarder
from kvhint.router.service.inbound import Endpoint
from kvhint.router.service.metrics import RouterMetrics
from kvhint.router.service.upstream import UpstreamBroken

EVENT = b"data: " + json.dumps(
    {"choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": None}]}
).encode() + b"\n\n"
DONE = b"data: [DONE]\n\n"


class _ClosedBetweenReads:
    """A worker response closed for a client gone after its ``parts`` were read, while
    no read was pending: it ends cleanly."""

    worker_id = "w0"
    status = 200
    headers = {"content-type": "text/event-stream"}

    def __init__(self, flight: Flight, parts: list[bytes]) -> None:
        self._flight = flight
        self._parts = parts

    async def chunks(self) -> AsyncIterator[bytes]:
        for part in self._parts:
            yield part
        self._flight.client_gone = True  # the disconnect callback ran meanwhile

    def close(self) -> None:
        pass


async def _status_counted(parts: list[bytes]) -> tuple[str, list[bytes]]:
    metrics = RouterMetrics()
    forwarder = Forwarder(None, None, None, None, metrics,  # type: ignore[arg-type]
                          on_worker_down=lambda _w: None)
    inbound = SimpleNamespace(endpoint=Endpoint.CHAT, stream=True, strip_usage_chunk=False)
    flight = Flight(inbound, None, None, time.perf_counter())  # type: ignore[arg-type]
    upstream = _ClosedBetweenReads(flight, parts)
    relayed = [chunk async for chunk in
               forwarder._relay(flight, upstream)]  # type: ignore[arg-type]
    text = metrics.render().decode()
    codes = [line.split('code="')[1].split('"')[0] for line in text.splitlines()
             if line.startswith("kvhint_router_requests_total{")]
    assert len(codes) == 1, codes
    return codes[0], relayed


def test_a_stream_closed_for_a_client_gone_before_done_counts_as_499() -> None:
    code, relayed = asyncio.run(_status_counted([EVENT]))
    assert relayed == [EVENT]
    assert code == "499"


def test_a_stream_closed_for_a_client_gone_after_done_was_served() -> None:
    code, relayed = asyncio.run(_status_counted([EVENT, DONE]))
    assert relayed == [EVENT, DONE]
    assert code == "200"


class _BrokenAfter:
    """A worker whose stream breaks after ``parts`` (a fake: a connection lost right
    after one given event cannot be caused on demand from a real worker)."""

    worker_id = "w0"
    status = 200
    headers = {"content-type": "text/event-stream"}

    def __init__(self, parts: list[bytes]) -> None:
        self._parts = parts

    async def chunks(self) -> AsyncIterator[bytes]:
        for part in self._parts:
            yield part
        raise UpstreamBroken("worker w0: connection reset")

    def close(self) -> None:
        pass


def test_a_finish_chunk_held_for_its_fingerprint_precedes_a_mid_stream_error() -> None:
    """The relay holds a finish chunk until the usage chunk it strips (response_scan);
    a worker that breaks in between: the client gets the finish chunk, then the error."""
    finish = b"data: " + json.dumps({"choices": [
        {"index": 0, "delta": {"content": "x"}, "finish_reason": "stop"}],
        "system_fingerprint": None}).encode() + b"\n\n"
    forwarder = Forwarder(None, None, None, None, RouterMetrics(),  # type: ignore[arg-type]
                          on_worker_down=lambda _w: None)
    inbound = SimpleNamespace(endpoint=Endpoint.CHAT, stream=True, strip_usage_chunk=True,
                              session_end=False, tenant=SimpleNamespace(name="default"))
    flight = Flight(inbound, None, None, time.perf_counter())  # type: ignore[arg-type]

    async def relayed() -> bytes:
        return b"".join([c async for c in forwarder._relay(
            flight, _BrokenAfter([EVENT, finish]))])  # type: ignore[arg-type]

    out = asyncio.run(relayed())
    assert out.startswith(EVENT + finish), out
    assert b'"error"' in out[len(EVENT + finish):] and b"connection reset" in out
