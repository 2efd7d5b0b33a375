"""What relaying a worker's event stream costs the router's event loop: large events cut
into small reads, and ordinary token streams.

    .venv/bin/python tests/benchmarks/service/bench_service_sse_relay.py
        [--sizes 262144,1048576,8388608] [--read 4096] [--deltas 20000] [--rounds 5]

Both stream relays, fed read by read as a worker's connection delivers them
(``feed``, what ``relay`` calls per read; the event loop is held for each call):
- chat/completions (``SseRelay``, the router asked for the usage chunk itself): a content
  delta, a finish chunk whose tool call's arguments make it ``--sizes`` bytes, the usage
  chunk, ``[DONE]``;
- Responses (``ResponsesRelay``): ``response.created``, a delta, then a
  ``response.completed`` of ``--sizes`` bytes (the whole response object);
each cut into reads of ``--read`` bytes. Then the ordinary case: ``--deltas`` small token
events, one per read (the stream vLLM writes token by token), and the same streams in
reads of ``--read`` bytes (several events a read, the last one cut).
Measured side by side, alternating which goes first per round:
- ours: the relays as they are (the waiting bytes appended to in place, only each read
  and the byte before it searched for an event's end);
- baseline: the same relays with the previous ``feed`` (kept below): the waiting bytes
  copied and the whole of them searched again at every read.
Reports thread CPU time per stream (ms) or per event (µs), medians over rounds, the
ratio, and the bytes each searched (deterministic); checks both relay the same bytes and
learn the same usage.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

from kvhint.router.service.response_scan import ResponseObservation, SseRelay
from kvhint.router.service.responses_scan import ResponsesObservation, ResponsesRelay


class BaselineSseRelay(SseRelay):
    """``SseRelay`` with its ``feed`` before the fix (quadratic in an event's size)."""

    def __init__(self, observation: ResponseObservation, strip_usage_chunk: bool) -> None:
        super().__init__(observation, strip_usage_chunk)
        self._pending = b""

    def feed(self, chunk: bytes) -> bytes:
        data = self._pending + chunk if self._pending else chunk
        self.searched += len(data)
        end = data.rfind(b"\n\n")
        if end < 0:
            self._pending = data
            return b""
        complete, self._pending = data[: end + 2], data[end + 2:]
        if complete.count(b"\n\n") == 1:
            return self._inspect(complete)
        return b"".join([self._inspect(event + b"\n\n")
                         for event in complete.split(b"\n\n")[:-1]])


class BaselineResponsesRelay(ResponsesRelay):
    """``ResponsesRelay`` with its ``feed`` before the fix (quadratic in an event's size)."""

    def __init__(self, observation: ResponsesObservation) -> None:
        super().__init__(observation)
        self._pending = b""

    def feed(self, chunk: bytes) -> bytes:
        data = self._pending + chunk if self._pending else chunk
        self.searched += len(data)
        end = data.rfind(b"\n\n")
        if end < 0:
            self._pending = data
            return b""
        complete, self._pending = data[: end + 2], data[end + 2:]
        for event in complete.split(b"\n\n")[:-1]:
            self._inspect(event, b"\n")
        return complete


def _data(obj: object) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def _chat_delta(text: str, finish: str | None = None, **extra: object) -> bytes:
    return _data({"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1,
                  "model": "m", "choices": [{"index": 0, "delta": {"content": text, **extra},
                                             "logprobs": None, "finish_reason": finish}],
                  "system_fingerprint": None})


CHAT_USAGE = _data({"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1,
                    "model": "m", "choices": [], "system_fingerprint": "fp",
                    "usage": {"prompt_tokens": 9, "completion_tokens": 3,
                              "prompt_tokens_details": {"cached_tokens": 0}}})


def chat_large(size: int) -> bytes:
    """A chat stream whose finish chunk (a tool call) is about ``size`` bytes."""
    call = {"index": 0, "id": "call_1", "type": "function",
            "function": {"name": "write_file", "arguments": "x" * size}}
    return (_chat_delta("a") + _chat_delta("", "tool_calls", tool_calls=[call])
            + CHAT_USAGE + b"data: [DONE]\n\n")


def chat_deltas(count: int) -> list[bytes]:
    return ([_chat_delta(" token") for _ in range(count - 1)] + [_chat_delta(".", "stop")]
            + [CHAT_USAGE, b"data: [DONE]\n\n"])


def _typed(kind: str, number: int, **data: object) -> bytes:
    body = {"type": kind, "sequence_number": number, **data}
    return f"event: {kind}\ndata: {json.dumps(body, separators=(',', ':'))}\n\n".encode()


def _response(status: str, text: str, usage: object = None) -> dict:
    return {"id": "resp_1", "object": "response", "status": status, "output": [
        {"type": "message", "content": [{"type": "output_text", "text": text}]}],
        "usage": usage, "error": None}


RESPONSES_USAGE = {"input_tokens": 40, "output_tokens": 3,
                   "input_tokens_details": {"cached_tokens": 32}}


def responses_large(size: int) -> bytes:
    """A Responses stream whose response.completed is about ``size`` bytes."""
    return (_typed("response.created", 0, response=_response("in_progress", ""))
            + _typed("response.output_text.delta", 1, item_id="m1", output_index=0,
                     content_index=0, delta="x")
            + _typed("response.completed", 2,
                     response=_response("completed", "x" * size, RESPONSES_USAGE)))


def responses_deltas(count: int) -> list[bytes]:
    return ([_typed("response.created", 0, response=_response("in_progress", ""))]
            + [_typed("response.output_text.delta", i + 1, item_id="m1", output_index=0,
                      content_index=0, delta=" token") for i in range(count)]
            + [_typed("response.completed", count + 1,
                      response=_response("completed", " token" * count, RESPONSES_USAGE))])


def cut(stream: bytes, read: int) -> list[bytes]:
    return [stream[i:i + read] for i in range(0, len(stream), read)]


def relay_once(relay: SseRelay | ResponsesRelay, reads: list[bytes]
               ) -> tuple[float, bytes, int | None]:
    """Thread CPU seconds to feed every read (and flush), what was relayed, the usage."""
    start = time.thread_time()
    out = [relay.feed(read) for read in reads]
    out.append(relay.release_held() + bytes(relay._pending))
    elapsed = time.thread_time() - start
    return elapsed, b"".join(out), relay.observation.prompt_tokens


def compare(name: str, reads: list[bytes], make_ours: Callable[[], SseRelay | ResponsesRelay],
            make_baseline: Callable[[], SseRelay | ResponsesRelay], rounds: int,
            per: int, unit: str) -> None:
    """``per``: the figure reported is the time over ``per`` (1: per stream, in ms;
    the event count: per event, in µs)."""
    times: dict[str, list[float]] = {"ours": [], "baseline": []}
    searched: dict[str, int] = {}
    results = set()
    for r in range(rounds):
        order = (("ours", make_ours), ("baseline", make_baseline))
        for label, make in order if r % 2 == 0 else order[::-1]:
            relay = make()
            elapsed, out, usage = relay_once(relay, reads)
            times[label].append(elapsed / per * (1e3 if unit == "ms" else 1e6))
            searched[label] = relay.searched
            results.add((out, usage))
    assert len(results) == 1, f"{name}: ours and the baseline relayed different streams"
    size = sum(map(len, reads))
    ours, base = statistics.median(times["ours"]), statistics.median(times["baseline"])
    print(f"{name}: {size:,} bytes in {len(reads):,} reads")
    for label in ("ours", "baseline"):
        print(f"  {label:<8} median {statistics.median(times[label]):10.2f} {unit}  "
              f"rounds {', '.join(f'{t:.2f}' for t in times[label])}  "
              f"searched {searched[label]:,} bytes ({searched[label] / size:.2f}x the stream)")
    print(f"  baseline/ours {base / ours:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="262144,1048576,8388608")
    parser.add_argument("--read", type=int, default=4096)
    parser.add_argument("--deltas", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    for size in map(int, args.sizes.split(",")):
        compare(f"chat, finish chunk of {size:,} bytes", cut(chat_large(size), args.read),
                lambda: SseRelay(ResponseObservation(), True),
                lambda: BaselineSseRelay(ResponseObservation(), True), args.rounds, 1, "ms")
        compare(f"responses, response.completed of {size:,} bytes",
                cut(responses_large(size), args.read),
                lambda: ResponsesRelay(ResponsesObservation()),
                lambda: BaselineResponsesRelay(ResponsesObservation()), args.rounds, 1, "ms")
    chat, responses = chat_deltas(args.deltas), responses_deltas(args.deltas)
    for reads, how in ((lambda events: events, "one per read"),
                       (lambda events: cut(b"".join(events), args.read),
                        f"in {args.read:,}-byte reads")):
        compare(f"chat, {args.deltas:,} token events, {how}", reads(chat),
                lambda: SseRelay(ResponseObservation(), True),
                lambda: BaselineSseRelay(ResponseObservation(), True), args.rounds,
                args.deltas, "us")
        compare(f"responses, {args.deltas:,} token events, {how}", reads(responses),
                lambda: ResponsesRelay(ResponsesObservation()),
                lambda: BaselineResponsesRelay(ResponsesObservation()), args.rounds,
                args.deltas, "us")


if __name__ == "__main__":
    main()
