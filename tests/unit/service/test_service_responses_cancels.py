"""The watches on background responses' streams (responses_cancels.py) and the event a
relay ends a cancelled one's stream with (responses_scan.py ``cancelled_event``)."""

from __future__ import annotations

import asyncio
import json

from kvhint.router.service.responses_cancels import CancelWatches
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
