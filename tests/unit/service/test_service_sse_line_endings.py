"""Both SSE relays in each line ending the SSE spec allows: ``\\n``, ``\\r\\n`` and
``\\r`` (a proxy between the router and its worker may rewrite vLLM's ``\\n``). The same
events, however the stream is cut into reads, go out byte for byte as they came (or,
where the router changes a chat event, changed as in the ``\\n`` stream, in the stream's
own line ending), each as soon as it is whole, and are read the same: usage, finish
reason, the Responses id and status.

Before, the relays cut events at ``\\n\\n`` only: a ``\\r\\n`` or ``\\r`` stream had no
event end, so the whole stream was held until the worker closed it (the client got no
token before the last), and nothing in it was read (its usage lost)."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import AsyncIterator

import pytest

from kvhint.router.service.response_scan import ResponseObservation, SseRelay, line_ending
from kvhint.router.service.responses_scan import ResponsesObservation, ResponsesRelay

SEED = 20261205
ENDINGS = [b"\n", b"\r\n", b"\r"]


def _data(obj: object) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def _chunk(content: str, finish: str | None = None) -> bytes:
    return _data({"id": "c1", "object": "chat.completion.chunk", "choices": [
        {"index": 0, "delta": {"content": content}, "finish_reason": finish}],
        "system_fingerprint": None})


CHAT = b"".join([
    b": ping\n\n", _chunk("he"), _chunk("llo"), _chunk("", "stop"),
    _data({"id": "c1", "choices": [], "system_fingerprint": "fp-1",
           "usage": {"prompt_tokens": 9, "completion_tokens": 3,
                     "prompt_tokens_details": {"cached_tokens": 4}}}),
    b"data: [DONE]\n\n"])


def _event(kind: str, number: int, **data: object) -> bytes:
    body = {"type": kind, "sequence_number": number, **data}
    return f"event: {kind}\ndata: {json.dumps(body)}\n\n".encode()


_RUNNING = {"id": "resp_x", "object": "response", "status": "in_progress", "output": []}
_DONE = {"id": "resp_x", "object": "response", "status": "completed", "output": [
    {"id": "msg_1", "type": "message", "role": "assistant", "status": "completed",
     "content": [{"type": "output_text", "text": "hello", "annotations": []}]}],
    "usage": {"input_tokens": 40, "output_tokens": 2, "total_tokens": 42,
              "input_tokens_details": {"cached_tokens": 32},
              "output_tokens_details": {"reasoning_tokens": 0}}}
RESPONSES = b"".join([
    _event("response.created", 0, response=_RUNNING),
    _event("response.in_progress", 1, response=_RUNNING),
    _event("response.output_text.delta", 2, item_id="msg_1", output_index=0,
           content_index=0, delta="hello"),
    _event("response.completed", 3, response=_DONE)])


def _cuts(rng: random.Random, stream: bytes) -> list[bytes]:
    cuts = sorted(rng.randrange(len(stream) + 1) for _ in range(rng.randrange(1, 12)))
    return [stream[a:b] for a, b in zip([0, *cuts], [*cuts, len(stream)])]


async def _source(reads: list[bytes]) -> AsyncIterator[bytes]:
    for read in reads:
        yield read


async def _relayed(relay: SseRelay | ResponsesRelay, reads: list[bytes]) -> bytes:
    return b"".join([out async for out in relay.relay(_source(reads))])


def _chat_read(observation: ResponseObservation) -> tuple[object, ...]:
    return (observation.prompt_tokens, observation.completion_tokens,
            observation.cached_tokens, observation.finish_reason,
            observation.malformed_chunks)


@pytest.mark.parametrize("strip", [False, True])
def test_the_chat_relay_reads_and_relays_every_line_ending_alike(strip: bool) -> None:
    rng = random.Random(SEED)
    reference = ResponseObservation()
    expected = asyncio.run(_relayed(SseRelay(reference, strip), [CHAT]))
    assert reference.prompt_tokens == 9 and reference.finish_reason == "stop"
    if strip:  # the router's own usage chunk out, its fingerprint on the finish chunk
        assert b'"usage"' not in expected and b"fp-1" in expected
    for nl in ENDINGS:
        stream = CHAT.replace(b"\n", nl)
        for _ in range(40):
            observation = ResponseObservation()
            relay = SseRelay(observation, strip)
            out = asyncio.run(_relayed(relay, _cuts(rng, stream)))
            assert out == expected.replace(b"\n", nl), nl
            assert _chat_read(observation) == _chat_read(reference), nl
            assert relay.finished


def test_the_responses_relay_reads_and_relays_every_line_ending_alike() -> None:
    rng = random.Random(SEED)
    for nl in ENDINGS:
        stream = RESPONSES.replace(b"\n", nl)
        for _ in range(40):
            observation = ResponsesObservation()
            relay = ResponsesRelay(observation)
            assert asyncio.run(_relayed(relay, _cuts(rng, stream))) == stream, nl
            assert relay.finished and observation.events == 4
            assert observation.snapshot is not None
            assert observation.snapshot["id"] == "resp_x"
            assert (observation.prompt_tokens, observation.completion_tokens,
                    observation.cached_tokens, observation.finish_reason) == (
                40, 2, 32, "stop"), nl


@pytest.mark.parametrize("nl", ENDINGS)
def test_each_event_goes_out_as_soon_as_it_is_whole(nl: bytes) -> None:
    """Not held until the stream's end: the first event alone is relayed at once, and a
    line ending cut between two reads (``\\r`` | ``\\n``) ends it when the next comes."""
    first = _event("response.created", 0, response=_RUNNING).replace(b"\n", nl)
    relay = ResponsesRelay(ResponsesObservation())
    assert relay.feed(first) == first
    chat = SseRelay(ResponseObservation(), False)
    event = _chunk("he").replace(b"\n", nl)
    assert chat.feed(event[:-1]) == b""
    assert chat.feed(event[-1:]) == event


def test_the_line_ending_is_read_from_the_first_line() -> None:
    assert line_ending(b"", b"data: x\n") == b"\n"
    assert line_ending(b"", b"data: x\r\n") == b"\r\n"
    assert line_ending(b"", b"data: x\rdata") == b"\r"
    assert line_ending(b"", b"data: x") is None
    assert line_ending(b"", b"data: x\r") is None  # \r or \r\n: the next byte says
    assert line_ending(b"data: x\r", b"\n") == b"\r\n"
    assert line_ending(b"data: x\r", b"d") == b"\r"
    assert line_ending(b"data: x\r", b"") is None
