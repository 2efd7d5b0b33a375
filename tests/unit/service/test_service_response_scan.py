from __future__ import annotations

import asyncio
import json
import random

from kvhint.router.service.response_scan import ResponseObservation, SseRelay, whole_events


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


FINGERPRINT = "vllm-0.32.0-abc"


def chunk(index: int, content: str, finish: str | None = None) -> bytes:
    return event({"id": "c1", "object": "chat.completion.chunk", "choices": [
        {"index": index, "delta": {"content": content}, "finish_reason": finish}],
        "system_fingerprint": None})


USAGE = event({"id": "c1", "choices": [], "system_fingerprint": FINGERPRINT,
               "usage": {"prompt_tokens": 9, "completion_tokens": 3,
                         "prompt_tokens_details": {"cached_tokens": 0}}})
DONE = b"data: [DONE]\n\n"


def fingerprints(out: bytes) -> list[tuple[int, str | None, str | None]]:
    """(choice index, finish_reason, system_fingerprint) of each chunk relayed."""
    chunks = [json.loads(e[6:]) for e in out.split(b"\n\n") if e.startswith(b"data: {")]
    return [(c["choices"][0]["index"], c["choices"][0]["finish_reason"],
             c["system_fingerprint"]) for c in chunks]


def test_a_stripped_usage_chunk_leaves_its_fingerprint_on_the_finish_chunks() -> None:
    """vLLM stamps ``system_fingerprint`` on each choice's finish chunk only without
    ``include_usage``, else on the usage chunk. The router asks for usage itself and strips
    that chunk, so a client that asked for none got no fingerprint at all, where vLLM
    gives it one on the finish chunk; now the finish chunk carries it, as from vLLM."""
    out, seen = relay_all([chunk(0, "a"), chunk(0, "b", "stop"), USAGE, DONE], strip=True)
    assert fingerprints(out) == [(0, None, None), (0, "stop", FINGERPRINT)]
    assert out.endswith(DONE) and seen.prompt_tokens == 9
    # Split anywhere (the finish and usage events in one read or apart): the same.
    whole = b"".join([chunk(0, "a"), chunk(0, "b", "stop"), USAGE, DONE])
    for cut in range(1, len(whole), 37):
        assert relay_all([whole[:cut], whole[cut:]], strip=True)[0] == out
    # n > 1: a choice that ends while another still streams is not held back for it
    # (its last tokens would wait for the slowest choice), so it goes without the
    # fingerprint; the finish chunks of those that end last wait for it, as with n = 1.
    out, _ = relay_all([chunk(0, "a"), chunk(1, "x"), chunk(0, "b", "length"),
                        chunk(1, "y"), chunk(1, "z", "length"), USAGE, DONE], strip=True)
    assert fingerprints(out) == [(0, None, None), (1, None, None), (0, "length", None),
                                 (1, None, None), (1, "length", FINGERPRINT)]
    out, _ = relay_all([chunk(0, "b", "stop"), chunk(1, "z", "stop"), USAGE, DONE],
                       strip=True)
    assert fingerprints(out) == [(0, "stop", FINGERPRINT), (1, "stop", FINGERPRINT)]
    # A client that asked for usage gets vLLM's events untouched.
    parts = [chunk(0, "b", "stop"), USAGE, DONE]
    assert relay_all(parts, strip=False)[0] == b"".join(parts)


def test_a_held_finish_chunk_is_never_lost() -> None:
    """No usage chunk (an error event, the worker's end of stream): the finish chunk goes
    out unchanged, in its place before what came after it."""
    error = event({"error": {"message": "boom", "code": 500}})
    out, _ = relay_all([chunk(0, "b", "stop"), error, DONE], strip=True)
    assert out == chunk(0, "b", "stop") + error + DONE
    out, _ = relay_all([chunk(0, "b", "stop")], strip=True)
    assert out == chunk(0, "b", "stop")
    relay = SseRelay(ResponseObservation(), True)
    assert relay.feed(chunk(0, "b", "stop")) == b""
    assert relay.release_held() == chunk(0, "b", "stop")  # before the router's error event


# vLLM's bytes for a generation that fails once its stream has begun (the 200 sent):
# json.dumps of create_error_response(GenerationError()).model_dump() (vllm/entrypoints/
# serve/exception_handling/error_response.py), then [DONE], the stream ending cleanly.
VLLM_ERROR = (b'data: {"error": {"message": "Internal server error", "type": '
              b'"InternalServerError", "param": null, "code": 500}}\n\n')


def test_a_stream_with_the_workers_error_event_is_a_failed_turn() -> None:
    """The turn's status is the error's code, not the 200 its stream began with; the
    client still gets the stream as it came."""
    for strip in (True, False):
        out, seen = relay_all([chunk(0, "a"), VLLM_ERROR, DONE], strip=strip)
        assert out == chunk(0, "a") + VLLM_ERROR + DONE
        assert seen.turn_status(200) == 500
        assert seen.turn_status(499) == 499  # the client left first: that it stays
        assert seen.usage_lost(500) is None  # an error has no usage to lose
    _, seen = relay_all([chunk(0, "a"), chunk(0, "b", "stop"), USAGE, DONE], strip=True)
    assert seen.turn_status(200) == 200
    # A code vLLM names (400: a request it could not take) counts as it is; none, or
    # one that is no 4xx or 5xx: a failure all the same, 500.
    for error, status in (({"message": "bad", "code": 400}, 400), ({"message": "x"}, 500),
                          ({"code": 200}, 500), ({"code": True}, 500), ("text", 500)):
        seen = ResponseObservation()
        seen.observe(json.dumps({"error": error}).encode())
        assert seen.turn_status(200) == status, error
    # Older vLLM releases nested their flat ErrorResponse (``"object": "error"``) under
    # "error" in a stream (a flat one alone they sent only with its error status, which
    # the router reads as it is): read the same.
    seen = ResponseObservation()
    seen.observe(json.dumps({"error": {"object": "error", "message": "too long",
                                       "type": "BadRequestError", "param": None,
                                       "code": 400}}).encode())
    assert seen.turn_status(200) == 400


def test_the_workers_error_event_ends_the_answer_with_or_without_done() -> None:
    """A client that leaves at the worker's error event (the OpenAI SDKs raise at it and
    close the stream) has its answer: the relay counts the stream finished there, so the
    turn is the error's, not a client gone; a worker that sends no [DONE] after it loses
    nothing either."""
    for strip in (True, False):
        relay = SseRelay(ResponseObservation(), strip)
        assert relay.feed(chunk(0, "a")) == chunk(0, "a") and not relay.finished
        assert relay.feed(VLLM_ERROR) == VLLM_ERROR
        assert relay.finished and relay.observation.turn_status(200) == 500
        out, seen = relay_all([chunk(0, "a"), VLLM_ERROR], strip=strip)
        assert out == chunk(0, "a") + VLLM_ERROR and seen.turn_status(200) == 500


def forced(index: int, content: str | None, finish: str | None, completion: int) -> bytes:
    """A chunk from a worker started with --enable-force-include-usage: vLLM turns on
    include_usage and continuous_usage_stats for every request (should_include_usage), so
    each chunk carries the usage so far, and no finish chunk the fingerprint."""
    delta = {"role": "assistant", "content": ""} if content is None else {"content": content}
    return event({"id": "c1", "object": "chat.completion.chunk", "choices": [
        {"index": index, "delta": delta, "finish_reason": finish}],
        "usage": {"prompt_tokens": 9, "completion_tokens": completion, "total_tokens":
                  9 + completion}})


def test_a_worker_forcing_usage_gives_the_client_its_usage_chunk() -> None:
    """A client that asked for no usage gets, from a worker forcing it, usage on every
    chunk, then the usage chunk with the fingerprint. The router, which asked for that
    chunk itself, strips it otherwise; here the chunks' own usage shows the worker sends
    it unasked (the router dropped continuous_usage_stats from the request), so the
    client gets the stream unchanged, as from the worker directly. Before, the usage
    chunk was dropped and the fingerprint moved onto the finish chunk."""
    parts = [forced(0, None, None, 0), forced(0, "a", None, 1), forced(0, "b", "stop", 2),
             USAGE, DONE]
    out, seen = relay_all(parts, strip=True)
    assert out == b"".join(parts)
    assert (seen.prompt_tokens, seen.completion_tokens, seen.cached_tokens) == (9, 3, 0)
    # Split anywhere: the same.
    whole = b"".join(parts)
    for cut in range(1, len(whole), 41):
        assert relay_all([whole[:cut], whole[cut:]], strip=True)[0] == whole


def test_a_large_event_cut_small_is_searched_once() -> None:
    """A chunk can be megabytes (a tool call's arguments, logprobs, a worker that sends
    a long answer in few events), which a worker's connection delivers in small reads.
    Each read is searched for an event's end alone (with the byte before it, where an
    end may straddle two reads), not all the waiting bytes again: copied and searched at
    every read, 8 MB in 4 KB reads cost ~7.8 GB of searching, seconds of the event loop.
    The bytes searched are counted, so the bound holds on any machine; the time it saves
    is in BENCHMARKS.md (router, "Large events cut small"). What the client gets and the
    router learns are those of the stream read whole."""
    call = {"index": 0, "id": "call_1", "type": "function",
            "function": {"name": "write_file", "arguments": "x" * 8_000_000}}
    finish = event({"id": "c1", "object": "chat.completion.chunk", "choices": [
        {"index": 0, "delta": {"tool_calls": [call]}, "finish_reason": "tool_calls"}],
        "system_fingerprint": None})
    whole = chunk(0, "a") + finish + USAGE + DONE
    for strip in (True, False):
        expected, _ = relay_all([whole], strip=strip)
        if strip:  # the usage chunk stripped, its fingerprint on the held finish chunk
            assert fingerprints(expected)[-1] == (0, "tool_calls", FINGERPRINT)
        for size in (4096, 4093):
            relay = SseRelay(ResponseObservation(), strip)
            reads = range(0, len(whole), size)
            out = b"".join(relay.feed(whole[i:i + size]) for i in reads)
            assert out == expected and relay.finished
            seen = relay.observation
            assert seen.tool_names == ["write_file"] and seen.prompt_tokens == 9
            assert relay.searched <= len(whole) + len(reads) < 2 * len(whole), relay.searched


def test_whole_events_cuts_where_searching_all_the_waiting_bytes_did() -> None:
    """Both relays' split (:func:`whole_events`) searches only each read and the byte
    before it: the same cuts, read by read, as splitting all the waiting bytes into
    events again, an event ending at the first blank line after its start (the relays'
    ``split(b"\\n\\n")``), for streams of newlines and text cut anywhere (ends straddling
    two reads, runs of blank lines, reads of a lone newline, empty reads). Before, a run
    of three or more newlines was cut at its end (``rfind``), not where its events end:
    the split left a lone newline after the last event, which the chat relay dropped."""
    def splitting_all(pending: bytes, chunk: bytes) -> tuple[bytes, bytes]:
        data = pending + chunk
        rest = data.split(b"\n\n")[-1]
        return data[: len(data) - len(rest)], rest

    rng = random.Random(7)
    for _ in range(2000):
        stream = b"".join(rng.choice([b"\n", b"\n", b"a", b"data: x", b"\n\n", b"\n\n\n"])
                          for _ in range(rng.randrange(1, 40)))
        cuts = sorted(rng.randrange(len(stream) + 1) for _ in range(rng.randrange(6)))
        reads = [stream[a:b] for a, b in zip([0, *cuts], [*cuts, len(stream)])]
        pending, before = bytearray(), b""
        for read in reads:
            complete, before = splitting_all(before, read)
            assert whole_events(pending, read)[0] == complete and pending == before, reads
