"""Reading a worker's Responses API answer (responses_scan.py): the stream relayed byte
for byte however it is cut, and what it says in the chat observation's terms."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from kvhint.router.policy import FinishReason
from kvhint.router.service.responses_scan import ResponsesObservation, ResponsesRelay


def _event(kind: str, number: int, **data: object) -> bytes:
    body = {"type": kind, "sequence_number": number, **data}
    return f"event: {kind}\ndata: {json.dumps(body)}\n\n".encode()


def _response(status: str, **extra: object) -> dict:
    return {"id": "resp_1", "object": "response", "status": status, "output": [],
            "usage": None, "error": None} | extra


USAGE = {"input_tokens": 40, "output_tokens": 3,
         "input_tokens_details": {"cached_tokens": 32}}
CALL = {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"}


async def _relay(relay: ResponsesRelay, chunks: list[bytes]) -> bytes:
    async def source() -> AsyncIterator[bytes]:
        for chunk in chunks:
            yield chunk
    return b"".join([out async for out in relay.relay(source())])


async def test_the_stream_passes_unchanged_however_it_is_cut() -> None:
    stream = b"".join([
        _event("response.created", 0, response=_response("in_progress")),
        _event("response.output_text.delta", 1, delta="he"),
        _event("response.completed", 2, response=_response(
            "completed", output=[CALL], usage=USAGE))])
    for size in (1, 7, len(stream)):
        observation = ResponsesObservation()
        relay = ResponsesRelay(observation)
        chunks = [stream[i:i + size] for i in range(0, len(stream), size)]
        assert await _relay(relay, chunks) == stream
        assert relay.finished and observation.events == 3
        assert (observation.prompt_tokens, observation.cached_tokens,
                observation.completion_tokens) == (40, 32, 3)
        assert observation.finish() is FinishReason.TOOL_CALLS
        assert observation.tool_names == ["get_weather"]
        assert observation.turn_status(200) == 200 and observation.usage_lost(200) is None


async def test_failed_incomplete_and_error_answers() -> None:
    failed = ResponsesObservation()
    relay = ResponsesRelay(failed)
    await _relay(relay, [_event("response.completed", 0, response=_response(
        "failed", error={"code": "rate_limit_exceeded", "message": "slow down"}))])
    assert failed.turn_status(200) == 429 and relay.finished
    short = ResponsesObservation()
    short.observe_json(json.dumps(_response("incomplete", usage=USAGE, incomplete_details={
        "reason": "max_output_tokens"})).encode())
    assert short.finish() is FinishReason.LENGTH and short.turn_status(200) == 200
    errored = ResponsesObservation()
    await _relay(ResponsesRelay(errored), [_event("error", 0, code="503", message="x")])
    assert errored.turn_status(200) == 503 and errored.usage_lost(200) is None
    unreadable = ResponsesObservation()
    unreadable.observe_json(b"{not json")
    assert unreadable.usage_lost(200) == "response_unparsable"
    background = ResponsesObservation()
    background.observe_json(json.dumps(_response("queued")).encode())
    assert background.background and background.usage_lost(200) is None
    assert ResponsesObservation().usage_lost(200) == "response_usage_missing"


def test_the_routers_own_failure_event() -> None:
    observation = ResponsesObservation()
    relay = ResponsesRelay(observation)
    # Broken before anything was announced: an error event.
    kind, data = relay.failure_event("worker failed", 502).decode().split("\n")[:2]
    assert kind == "event: error"
    assert json.loads(data.removeprefix("data: ")) == {
        "type": "error", "sequence_number": 0, "param": None, "code": "server_error",
        "message": "worker failed (HTTP 502)"}
    relay.feed(_event("response.created", 0, response=_response("in_progress")))
    kind, data = relay.failure_event("worker failed", 504).decode().split("\n")[:2]
    body = json.loads(data.removeprefix("data: "))
    assert kind == "event: response.failed" and body["sequence_number"] == 1
    assert body["response"] == _response("in_progress") | {"status": "failed", "error": {
        "code": "server_error", "message": "worker failed (HTTP 504)"}}


def test_a_large_event_cut_small_is_searched_once() -> None:
    """The terminal event carries the whole response (its output, the tools and
    instructions echoed, input and output messages where asked): megabytes, which a
    worker's connection delivers in small reads. Each read is searched for an event's
    end alone (with the byte before it, where an end may straddle two reads), not the
    whole event again: 8 MB in 4 KB reads took seconds of the event loop when the
    waiting bytes were copied and searched at every read (quadratic: ~7.8 GB searched
    here). The bytes searched are counted, so the bound holds on any machine; the time
    it saves is in BENCHMARKS.md (router, "Large events cut small")."""
    text = "x" * 8_000_000
    event = _event("response.completed", 5, response=_response(
        "completed", output=[{"type": "message", "content": [
            {"type": "output_text", "text": text}]}], usage=USAGE))
    relay = ResponsesRelay(ResponsesObservation())
    reads = range(0, len(event), 4096)
    out = b"".join(relay.feed(event[i:i + 4096]) for i in reads)
    assert out == event
    assert relay.finished and relay.observation.prompt_tokens == 40
    assert relay.searched <= len(event) + len(reads) < 2 * len(event), relay.searched
