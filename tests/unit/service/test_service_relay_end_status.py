"""A stream the worker failed keeps its 502/504 in the router's accounting when the
client leaves while the router's own terminal event goes out (relay_end.RelayEnd.left:
closed at that yield). Before, ``broken`` left the relay unfinished and the client's
leaving turned the 502 into a 499 (requests_total, the session's turn, the trace).

The upstream stand-in carries only the two fields RelayEnd reads (worker id, status): a
real aiohttp response adds nothing to what is tested."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvhint.router.service.metrics import RouterMetrics
from kvhint.router.service.relay_end import RelayEnd
from kvhint.router.service.response_scan import ResponseObservation, SseRelay
from kvhint.router.service.responses_scan import ResponsesObservation, ResponsesRelay
from kvhint.router.service.upstream import UpstreamBroken


def _end(relay: SseRelay | ResponsesRelay, served_once_finished: bool) -> RelayEnd:
    upstream = SimpleNamespace(worker_id="w0", status=200,
                               headers={"content-type": "text/event-stream"})
    return RelayEnd(relay, None, upstream, RouterMetrics(), served_once_finished)


def _relays() -> list[tuple[SseRelay | ResponsesRelay, bool]]:
    return [(SseRelay(ResponseObservation(), strip_usage_chunk=False), True),
            (ResponsesRelay(ResponsesObservation()), True),
            (ResponsesRelay(ResponsesObservation()), False)]


@pytest.mark.parametrize("index", range(3))
@pytest.mark.parametrize("timed_out", [False, True])
def test_a_broken_stream_stays_failed_when_the_client_leaves_at_its_error_event(
        index: int, timed_out: bool) -> None:
    relay, served_once_finished = _relays()[index]
    end = _end(relay, served_once_finished)
    last = end.broken(UpstreamBroken("reset", timed_out=timed_out), client_gone=False)
    assert last
    end.left()  # the client closed at the yield of that error event
    assert end.status == (504 if timed_out else 502)


@pytest.mark.parametrize("index", range(3))
def test_a_stream_ended_without_its_terminal_event_stays_failed(index: int) -> None:
    relay, served_once_finished = _relays()[index]
    end = _end(relay, served_once_finished)
    assert end.ended(client_gone=False)
    end.left()
    assert end.status == 502


def test_a_client_leaving_mid_stream_is_still_a_499() -> None:
    relay, served_once_finished = _relays()[0]
    end = _end(relay, served_once_finished)
    end.left()
    assert end.status == 499
