"""The watches on background responses' streams (responses_cancels.py) and the event a
relay ends a cancelled one's stream with (responses_scan.py ``cancelled_event``)."""

from __future__ import annotations

import asyncio
import json

from kvhint.router.service.responses_cancels import MAX_CANCELLED_IDS, CancelWatches
from kvhint.router.service.responses_scan import ResponsesObservation, ResponsesRelay


def _data(event: bytes) -> tuple[str, dict[str, object]]:
    kind, data = event.decode().rstrip("\n").split("\n")
    return kind.removeprefix("event: "), json.loads(data.removeprefix("data: "))


def test_a_cancel_closes_each_stream_of_its_response_once_the_grace_is_past() -> None:
    async def scenario() -> None:
        watches = CancelWatches(grace_s=0.05)
        closed: list[str] = []
        first = watches.watch("resp_a", lambda: closed.append("first"))
        second = watches.watch("resp_a", lambda: closed.append("second"))
        other = watches.watch("resp_b", lambda: closed.append("other"))
        assert len(watches) == 3
        answer = {"id": "resp_a", "status": "cancelled"}
        assert watches.cancelled("resp_a", answer) == 2
        assert watches.cancelled("resp_a", None) == 2  # a second cancel: grace not reset
        second.end()  # this one ended on its own within the grace: never closed
        await asyncio.sleep(0.15)
        assert closed == ["first"] and first.fired and not second.fired
        assert first.answer == answer
        assert not other.fired and watches.cancelled("resp_nope", None) == 0
        first.end()
        other.end()
        assert len(watches) == 0
    asyncio.run(scenario())


def test_the_cancelled_event_names_the_cancelled_response() -> None:
    created = {"id": "resp_a", "object": "response", "status": "in_progress", "output": []}
    relay = ResponsesRelay(ResponsesObservation())
    relay.feed(b"event: response.created\ndata: " + json.dumps(
        {"type": "response.created", "sequence_number": 0, "response": created}).encode()
        + b"\n\n")
    # From the cancel's answer where there is one, else from response.created.
    answered = {**created, "status": "cancelled", "model": "m"}
    kind, data = _data(relay.cancelled_event(answered))
    assert kind == "response.failed" and data["sequence_number"] == 1
    assert data["response"] == answered
    assert relay.finished and relay.observation.error_status == 499
    kind, data = _data(ResponsesRelay(relay.observation).cancelled_event(None))
    assert kind == "response.failed"
    assert data["response"] == {**created, "status": "cancelled"}
    # Neither known (a GET from past response.created, no answer): an error event.
    late = ResponsesRelay(ResponsesObservation(events=7))
    kind, data = _data(late.cancelled_event(None))
    assert kind == "error" and data["sequence_number"] == 7
    assert data["code"] == "cancelled"


def test_a_silent_stream_fires_past_the_idle_bound_and_events_keep_it_open() -> None:
    """``idle_s``: each event starts the wait again (one timer per wait, re-armed for
    what is left); past it without one, the worker's side is closed (reason
    background_idle). None: no bound of its own."""
    async def scenario() -> None:
        watches = CancelWatches(grace_s=5.0, idle_s=0.1)
        closed: list[str] = []
        talking = watches.watch("resp_a", lambda: closed.append("talking"))
        silent = watches.watch("resp_b", lambda: closed.append("silent"))
        for _ in range(6):  # 0.3 s, an event every 0.05 s
            await asyncio.sleep(0.05)
            talking.heard()
        assert closed == ["silent"] and silent.fired and silent.reason == "background_idle"
        assert not talking.fired
        await asyncio.sleep(0.2)
        assert closed == ["silent", "talking"] and talking.reason == "background_idle"
        unbounded = CancelWatches(grace_s=5.0).watch("resp_c", lambda: closed.append("c"))
        await asyncio.sleep(0.15)
        assert not unbounded.fired
        for watch in (talking, silent, unbounded):
            watch.end()
    asyncio.run(scenario())


def test_cancels_are_remembered_for_later_streams_within_a_bound() -> None:
    forgotten: list[int] = []
    watches = CancelWatches(grace_s=1.0, on_forgotten=lambda: forgotten.append(1))
    assert not watches.was_cancelled("resp_0")
    for number in range(MAX_CANCELLED_IDS + 1):
        watches.cancelled(f"resp_{number}", None)
    assert len(forgotten) == 1  # the oldest let go of, counted
    assert not watches.was_cancelled("resp_0")
    assert watches.was_cancelled("resp_1") and watches.was_cancelled(f"resp_{MAX_CANCELLED_IDS}")


def test_the_streams_a_recheck_asks_about_are_those_no_cancel_reached() -> None:
    """After a NATS outage the router asks the workers about these only
    (responses_cancel_rechecks.py): one per response, from a known worker, neither in a
    cancel's grace nor ended."""
    async def scenario() -> None:
        watches = CancelWatches(grace_s=5.0)
        open_one = watches.watch("resp_a", lambda: None, "w0")
        twice = watches.watch("resp_a", lambda: None, "w0")
        in_grace = watches.watch("resp_b", lambda: None, "w1")
        unknown = watches.watch("resp_c", lambda: None)
        ended = watches.watch("resp_d", lambda: None, "w1")
        watches.cancelled("resp_b", None)
        ended.end()
        assert watches.unsettled() == {"resp_a": "w0"}
        for watch in (open_one, twice, in_grace, unknown):
            watch.end()
        assert watches.unsettled() == {}
    asyncio.run(scenario())
