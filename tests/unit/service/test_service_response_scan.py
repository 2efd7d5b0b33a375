from __future__ import annotations

import asyncio
import json

from kvhint.router.service.response_scan import ResponseObservation, SseRelay


def event(obj: object) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


CHUNKS = [
    event({"choices": [{"index": 0, "delta": {"role": "assistant", "tool_calls": [
        {"index": 0, "function": {"name": "search", "arguments": ""}}]}}]}),
    event({"choices": [{"index": 0, "delta": {"content": "x"}, "finish_reason": "tool_calls"}]}),
    event({"choices": [], "usage": {"prompt_tokens": 100, "completion_tokens": 5,
                                    "prompt_tokens_details": {"cached_tokens": 64}}}),
    b"data: [DONE]\n\n",
]


def relay_all(parts: list[bytes], strip: bool) -> tuple[bytes, ResponseObservation]:
    observation = ResponseObservation()
    relay = SseRelay(observation, strip)

    async def source():
        for part in parts:
            yield part

    async def collect() -> bytes:
        return b"".join([c async for c in relay.relay(source())])

    return asyncio.run(collect()), observation


def test_relay_observes_and_strips_only_the_usage_chunk() -> None:
    out, seen = relay_all(CHUNKS, strip=True)
    assert out == CHUNKS[0] + CHUNKS[1] + CHUNKS[3]
    assert seen.finish_reason == "tool_calls" and seen.tool_names == ["search"]
    assert (seen.prompt_tokens, seen.cached_tokens, seen.completion_tokens) == (100, 64, 5)


def test_relay_keeps_usage_when_client_asked_and_survives_any_split() -> None:
    whole = b"".join(CHUNKS)
    for cut in (1, 7, 33, len(whole) // 2, len(whole) - 3):
        out, seen = relay_all([whole[:cut], whole[cut:]], strip=False)
        assert out == whole
        assert seen.cached_tokens == 64
    # Byte by byte: every event still arrives whole and in order.
    out, _ = relay_all([whole[i:i + 1] for i in range(len(whole))], strip=True)
    assert out == CHUNKS[0] + CHUNKS[1] + CHUNKS[3]


def test_relay_passes_what_it_cannot_parse() -> None:
    parts = [b"data: {broken\n\n", b": comment\n\n", b"data: tail-without-end"]
    out, seen = relay_all(parts, strip=True)
    assert out == b"".join(parts)
    assert seen.malformed_chunks == 1


def test_non_streaming_body() -> None:
    seen = ResponseObservation()
    body = {"choices": [{"message": {"role": "assistant", "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "ls", "arguments": "{}"}}]},
        "finish_reason": "tool_calls"}],
        "usage": {"prompt_tokens": 10, "completion_tokens": 2,
                  "prompt_tokens_details": None}}
    assert not seen.observe_json(json.dumps(body).encode())
    assert seen.tool_names == ["ls"] and seen.cached_tokens == 0 and seen.prompt_tokens == 10


def test_plain_content_deltas_are_not_parsed() -> None:
    # Nearly every event is a content delta; the relay forwards it without decoding JSON
    # (this one is not even valid JSON past the marker, and is not counted as malformed).
    delta = b'data: {"choices":[{"delta":{"content":"x"},"finish_reason":null}], oops\n\n'
    out, seen = relay_all([delta], strip=True)
    assert out == delta and seen.malformed_chunks == 0
