"""The trace recorder writes what it is told in arrival order, as session JSONL the
simulator loads, and counts everything it does not write."""

from __future__ import annotations

import collections
import json
from dataclasses import replace
from pathlib import Path

from kvhint.router.service.trace_recorder import TraceRecorder, TracedRequest
from kvhint.router.sim.trace import load_trace

BS = 16


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _request(session: str | None, tokens: int, hashes: tuple[int, ...], *,
             finish: str = "stop", tools: tuple[str, ...] = (), end: bool = False,
             output: int = 7, block_size: int = BS) -> TracedRequest:
    return TracedRequest(tenant="acme", session_id=session, prompt_tokens=tokens,
                         block_hashes=hashes, block_size=block_size, output_tokens=output,
                         finish_reason=finish, tool_names=tools, end=end)


def _recorder(tmp_path: Path, clock: Clock, stall_s: float = 60.0
              ) -> tuple[TraceRecorder, collections.Counter[str]]:
    drops: collections.Counter[str] = collections.Counter()
    recorder = TraceRecorder(tmp_path / "traces", lambda reason, n: drops.update({reason: n}),
                             stall_s=stall_s, clock=clock, wall=lambda: 0.0)
    return recorder, drops


async def test_requests_are_written_in_arrival_order_as_a_trace_the_simulator_loads(
        tmp_path: Path) -> None:
    clock = Clock()
    recorder, drops = _recorder(tmp_path, clock)
    first = recorder.arrived()
    clock.now += 0.5
    second = recorder.arrived()
    clock.now += 1.0
    third = recorder.arrived()
    fourth = recorder.arrived()
    # They finish out of order; the file keeps the order they arrived in.
    recorder.finished(third, _request(None, 20, (1009,)))
    recorder.finished(second, _request("s", 40, (1001, 1002), end=True))
    recorder.finished(fourth, None, "trace_failed")
    await recorder.flush()
    assert recorder.written == 0  # the first has not finished: nothing can be written yet
    recorder.finished(first, _request("s", 33, (1001, 1002), finish="tool_calls",
                                      tools=("search",)))
    again = recorder.arrived()  # the client reuses the ended session's id
    recorder.finished(again, _request("s", 16, (1001,)))
    await recorder.close()
    assert recorder.written == 4 and drops == {"trace_failed": 1}
    assert recorder.path is not None and recorder.path.name.endswith("-bs16.jsonl")
    trace = load_trace(recorder.path, block_size=BS)
    rows = [(r.arrival_s, r.session_id, r.turn, r.input_length, r.block_ids,
             r.finish_reason, r.tool_names, r.end, r.tenant) for r in trace.requests]
    # A partial last block gets an id of its own (1, 2, 3); whole blocks need none.
    assert rows == [
        (0.0, "s", 1, 33, (1001, 1002, 1), "tool_calls", ("search",), False, "acme"),
        (0.5, "s", 2, 40, (1001, 1002, 2), "stop", (), True, "acme"),
        (1.5, "~r2", 1, 20, (1009, 3), "stop", (), False, "acme"),
        (1.5, "s~2", 1, 16, (1001,), "stop", (), False, "acme"),
    ]
    assert trace.requests[0].output_length == 7


async def test_a_request_that_never_finishes_is_dropped_after_the_stall_time(
        tmp_path: Path) -> None:
    clock = Clock()
    recorder, drops = _recorder(tmp_path, clock, stall_s=30.0)
    lost = recorder.arrived()
    done = recorder.arrived()
    recorder.finished(done, _request("s", 32, (1, 2)))
    clock.now += 29.0
    await recorder.flush()
    assert recorder.written == 0
    clock.now += 2.0
    await recorder.flush()
    assert recorder.written == 1 and drops == {"trace_stalled": 1}
    recorder.finished(lost, _request("t", 32, (3, 4)))  # too late: already counted
    await recorder.close()
    assert recorder.written == 1 and drops == {"trace_stalled": 1}


async def test_what_cannot_be_replayed_is_counted_not_written(tmp_path: Path) -> None:
    clock = Clock()
    recorder, drops = _recorder(tmp_path, clock)
    tickets = [recorder.arrived() for _ in range(4)]
    recorder.finished(tickets[0], _request("a", 32, (1, 2)))
    recorder.finished(tickets[1], _request("b", 32, (1, 2), block_size=32))  # other size
    recorder.finished(tickets[2], _request("c", 48, (1,)))  # fewer hashes than blocks
    await recorder.close()  # the fourth never finished
    assert recorder.written == 1
    assert drops == {"trace_block_size": 1, "trace_unhashed": 1, "trace_unfinished": 1}


async def test_nothing_recorded_writes_no_file(tmp_path: Path) -> None:
    recorder, drops = _recorder(tmp_path, Clock())
    recorder.finished(recorder.arrived(), None, "trace_failed")
    await recorder.close()
    assert recorder.path is None and not (tmp_path / "traces").exists()
    assert drops == {"trace_failed": 1}


async def test_a_session_ended_through_the_api_starts_over_under_its_id(tmp_path: Path) -> None:
    recorder, _drops = _recorder(tmp_path, Clock())
    first = recorder.arrived()
    recorder.session_ended("acme", "s")  # DELETE /v1/sessions/s while turn 1 runs
    later = recorder.arrived()
    recorder.finished(later, _request("s", 16, (1001,)))
    recorder.finished(first, _request("s", 16, (1001,)))
    recorder.session_ended("acme", "s")  # ended again, then a request-borne end too
    ends = recorder.arrived()
    recorder.finished(ends, _request("s", 16, (1001,), end=True))
    recorder.session_ended("acme", "s")  # the router's own end after that request
    last = recorder.arrived()
    recorder.finished(last, _request("s", 16, (1001,)))
    await recorder.close()
    assert recorder.path is not None
    trace = load_trace(recorder.path, block_size=BS)
    assert [(r.session_id, r.turn, r.end) for r in trace.requests] == [
        ("s", 1, False), ("s~2", 1, False), ("s~3", 1, True), ("s~4", 1, False)]
    # An end through the API is an end line, at the time it came; a request-borne end is
    # on its request's line (the router's own end after it writes nothing more).
    assert [r.end_at_s for r in trace.requests] == [0.0, 0.0, None, None]
    lines = recorder.path.read_text().splitlines()
    assert len(lines) == 6 and recorder.written == 4
    assert json.loads(lines[1]) == {"timestamp": 0.0, "session_id": "s", "tenant": "acme",
                                    "end": True}


async def test_a_streamed_responses_times_are_written_rounded(tmp_path: Path) -> None:
    recorder, _drops = _recorder(tmp_path, Clock())
    streamed = replace(_request("s", 16, (1001,)), itl_ms=12.3456, ttft_ms=180.04)
    recorder.finished(recorder.arrived(), streamed)
    recorder.finished(recorder.arrived(), _request("t", 16, (1001,)))
    await recorder.close()
    assert recorder.path is not None
    lines = recorder.path.read_text().splitlines()
    assert '"itl_ms":12.35,"ttft_ms":180.0' in lines[0] and "_ms" not in lines[1]


async def test_client_ids_with_a_tilde_never_read_as_the_recorders_suffixes(
        tmp_path: Path) -> None:
    """``s`` restarted is ``s~2`` in the file and a request with no session is ``~r<n>``;
    a client whose own ids are literally ``s~2`` and ``~r1`` stays a session of its own."""
    recorder, _drops = _recorder(tmp_path, Clock())
    tickets = [recorder.arrived() for _ in range(4)]
    recorder.finished(tickets[0], _request("s", 16, (1001,), end=True))
    recorder.finished(tickets[1], _request(None, 16, (1002,)))
    recorder.finished(tickets[2], _request("s", 16, (1003,)))  # s again: starts over
    recorder.finished(tickets[3], _request("s~2", 16, (1004,)))
    late = recorder.arrived()
    recorder.finished(late, _request("~r1", 16, (1005,)))
    await recorder.close()
    assert recorder.path is not None
    trace = load_trace(recorder.path, block_size=BS)
    ids = [r.session_id for r in trace.requests]
    assert ids == ["s", "~r1", "s~2", "s~~2", "~~r1"]
    assert [r.turn for r in trace.requests] == [1, 1, 1, 1, 1]
