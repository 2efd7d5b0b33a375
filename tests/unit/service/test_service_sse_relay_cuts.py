"""Both SSE relays pass a worker's bytes faithfully however its stream is cut into reads:
random streams of events, comments and runs of blank lines (seeded), cut at random
points, relay the bytes they relay read whole; and, where the router changes nothing
(no usage chunk to strip, no finish chunk to hold), the worker's bytes exactly.

Before, a read holding several events that ended in three or more newlines lost its last
``\\n`` in the chat relay (``: a\\n\\n: b\\n\\n\\n`` went out as ``: a\\n\\n: b\\n\\n``), where
the same bytes cut across two reads kept it."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import AsyncIterator

from kvhint.router.service.response_scan import ResponseObservation, SseRelay
from kvhint.router.service.responses_scan import ResponsesObservation, ResponsesRelay

SEED = 20261205


def _data(obj: object) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def _chunk(index: int, content: str, finish: str | None = None) -> bytes:
    return _data({"id": "c1", "object": "chat.completion.chunk", "choices": [
        {"index": index, "delta": {"content": content}, "finish_reason": finish}],
        "system_fingerprint": None})


_USAGE = _data({"id": "c1", "choices": [], "system_fingerprint": "fp-1",
                "usage": {"prompt_tokens": 9, "completion_tokens": 3,
                          "prompt_tokens_details": {"cached_tokens": 0}}})
# What the router passes as it is, stripping or not: content deltas, comments (keep-alive
# pings), blank lines, events it cannot read or that carry no JSON, the worker's error.
_NEUTRAL = [_chunk(0, "a"), _chunk(1, "b"), b": ping\n\n", b":\n\n", b"\n", b"\n\n",
            b"\n\n\n", b"\n\n\n\n\n", b"data: [DONE]\n\n", b"data: {broken\n\n",
            b"event: note\ndata: x\n\n", b"id: 7\n", b": c\n",
            _data({"error": {"message": "boom", "code": 500}})]
# What the router changes where it asked for usage itself: the finish chunk it holds for
# the usage chunk's fingerprint, the usage chunk it strips.
_CHANGED = [_chunk(0, "z", "stop"), _chunk(1, "y", "length"), _USAGE]


def _stream(rng: random.Random, tokens: list[bytes]) -> bytes:
    parts = [rng.choice(tokens) for _ in range(rng.randrange(1, 30))]
    if rng.random() < 0.2:
        parts.append(b"data: tail-without-end")  # a worker that stopped mid-event
    return b"".join(parts)


def _cut(rng: random.Random, stream: bytes) -> list[bytes]:
    cuts = sorted(rng.randrange(len(stream) + 1) for _ in range(rng.randrange(1, 8)))
    return [stream[a:b] for a, b in zip([0, *cuts], [*cuts, len(stream)])]


async def _source(reads: list[bytes]) -> AsyncIterator[bytes]:
    for read in reads:
        yield read


def _chat(reads: list[bytes], strip: bool) -> tuple[bytes, tuple[object, ...]]:
    relay = SseRelay(ResponseObservation(), strip)

    async def collect() -> bytes:
        return b"".join([out async for out in relay.relay(_source(reads))])

    out = asyncio.run(collect())
    seen = relay.observation
    return out, (seen.finish_reason, seen.prompt_tokens, seen.malformed_chunks,
                 seen.error_status, seen.choices, relay.finished)


def _responses(reads: list[bytes]) -> tuple[bytes, tuple[object, ...]]:
    relay = ResponsesRelay(ResponsesObservation())

    async def collect() -> bytes:
        return b"".join([out async for out in relay.relay(_source(reads))])

    out = asyncio.run(collect())
    seen = relay.observation
    return out, (seen.events, seen.prompt_tokens, seen.finish_reason, seen.error_status,
                 seen.malformed_chunks, relay.finished)


def test_a_run_of_blank_lines_after_several_events_keeps_every_newline() -> None:
    """The review's case: in one read, or cut anywhere, the same bytes go out."""
    stream = b": a\n\n: b\n\n\n"
    for strip in (True, False):
        assert _chat([stream], strip)[0] == stream
        for cut in range(len(stream) + 1):
            assert _chat([stream[:cut], stream[cut:]], strip)[0] == stream
    finish = _chunk(0, "z", "stop")
    # The newline left over from the run starts the next event: a held finish chunk's,
    # kept where the fingerprint is written in; a stripped usage chunk's, gone with it.
    stream = _chunk(0, "a") + b"\n\n\n" + finish + _USAGE + b"\n\n\ndata: [DONE]\n\n"
    whole, _ = _chat([stream], strip=True)
    assert whole.startswith(_chunk(0, "a") + b"\n\n\ndata: {")
    assert b'"system_fingerprint":"fp-1"' in whole and b'"usage"' not in whole
    assert whole.endswith(b"\n\n\ndata: [DONE]\n\n")
    for cut in range(len(stream) + 1):
        assert _chat([stream[:cut], stream[cut:]], strip=True)[0] == whole


def test_the_chat_relay_gives_the_same_bytes_however_the_stream_is_cut() -> None:
    rng = random.Random(SEED)
    for _ in range(400):
        neutral = rng.random() < 0.5
        stream = _stream(rng, _NEUTRAL if neutral else _NEUTRAL + _CHANGED * 3)
        for strip in (True, False):
            whole = _chat([stream], strip)
            if neutral or not strip:  # the router changes nothing: the worker's bytes
                assert whole[0] == stream, stream
            for _ in range(4):
                reads = _cut(rng, stream)
                assert _chat(reads, strip) == whole, reads
            assert _chat([stream[i:i + 1] for i in range(len(stream))], strip) == whole


def _event(kind: str, number: int, **data: object) -> bytes:
    body = {"type": kind, "sequence_number": number, **data}
    return f"event: {kind}\ndata: {json.dumps(body)}\n\n".encode()


_RESPONSE = {"id": "resp_1", "object": "response", "status": "completed", "output": [],
             "usage": {"input_tokens": 40, "output_tokens": 3,
                       "input_tokens_details": {"cached_tokens": 32}}, "error": None}
_RESPONSES = [_event("response.created", 0, response=_RESPONSE | {"status": "in_progress",
                                                                  "usage": None}),
              _event("response.output_text.delta", 1, delta="he"),
              _event("response.completed", 2, response=_RESPONSE),
              _event("error", 3, code="503", message="x"), b": ping\n\n", b"\n",
              b"\n\n", b"\n\n\n", b"\n\n\n\n\n", b"event: broken\ndata: {no\n\n"]


def test_the_responses_relay_gives_the_worker_s_bytes_however_the_stream_is_cut() -> None:
    """It changes no byte: each cut relays the stream, and reads it as read whole."""
    rng = random.Random(SEED + 1)
    for _ in range(400):
        stream = _stream(rng, _RESPONSES)
        whole = _responses([stream])
        assert whole[0] == stream
        for _ in range(4):
            reads = _cut(rng, stream)
            assert _responses(reads) == whole, reads
        assert _responses([stream[i:i + 1] for i in range(len(stream))]) == whole
