"""Trace input: both formats, session inference, and errors that name the line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvhint.router.sim.trace import TraceError, load_trace


def _write(tmp_path: Path, rows: list[object], name: str = "t.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def _mc(ts: int, ids: list[int], length: int | None = None, out: int = 10) -> dict:
    return {"timestamp": ts, "input_length": length or 512 * len(ids), "output_length": out,
            "hash_ids": ids}


def test_mooncake_sessions_are_inferred_from_the_previous_turns_last_full_block(tmp_path):
    path = _write(tmp_path, [
        _mc(0, [0, 1, 2], 1100),          # session A, turn 1 (full blocks 0, 1)
        _mc(5, [0, 3, 4]),                # shares only the system block: new session B
        _mc(9, [0, 1, 5, 6], 1900),       # contains A's last full block (1) at depth 1: A, turn 2
        _mc(12, [0, 1, 5, 7, 8]),         # contains A's turn-2 last full block (5): A, turn 3
        _mc(20, [9]),                     # new session C
    ])
    trace = load_trace(path)
    assert trace.format == "mooncake" and trace.sessions == 3
    assert [(r.session_id, r.turn) for r in trace.requests] == [
        ("m000000", 1), ("m000001", 1), ("m000000", 2), ("m000000", 3), ("m000002", 1)]
    assert trace.requests[2].arrival_s == pytest.approx(0.009)
    assert all(r.finish_reason == "stop" and not r.end for r in trace.requests)


def test_session_format_fields(tmp_path):
    path = _write(tmp_path, [
        {"timestamp": 0, "session_id": "a", "input_length": 600, "output_length": 5,
         "hash_ids": [1, 2], "finish_reason": "tool_calls", "tool_names": ["search"],
         "tenant": "acme"},
        {"timestamp": 1000, "session_id": "a", "turn": 2, "input_length": 700,
         "output_length": 5, "hash_ids": [1, 3], "end": True, "tenant": "acme"},
    ])
    first, second = load_trace(path).requests
    assert (first.tenant, first.finish_reason, first.tool_names, first.turn) == (
        "acme", "tool_calls", ("search",), 1)
    assert (second.turn, second.end, second.finish_reason) == (2, True, "stop")


def test_an_end_line_ends_the_session_after_its_latest_request(tmp_path):
    path = _write(tmp_path, [
        {**_mc(0, [1]), "session_id": "a", "tenant": "acme"},
        {**_mc(500, [2]), "session_id": "b"},
        {"timestamp": 2500, "session_id": "a", "tenant": "acme", "end": True},
        {**_mc(3000, [2, 3]), "session_id": "b"},
    ])
    a, b1, b2 = load_trace(path).requests
    assert (a.end, a.end_at_s) == (False, 2.5)
    assert b1.end_at_s is None and b2.end_at_s is None


def test_two_tenants_sessions_of_the_same_id_are_two_sessions(tmp_path):
    """The router keys sessions by tenant and its recorder writes the client's id with
    the tenant beside it: tenant t1 ending its "s" does not end t2's "s", and their turns
    count apart. Before, the loader refused such a recording ("continues after its
    'end'") or merged the two."""
    path = _write(tmp_path, [
        {**_mc(0, [1]), "session_id": "s", "tenant": "t1"},
        {**_mc(1, [2]), "session_id": "s", "tenant": "t2"},
        {**_mc(2, [1, 3]), "session_id": "s", "tenant": "t1", "turn": 2, "end": True},
        {**_mc(3, [2, 4]), "session_id": "s", "tenant": "t2", "turn": 2},
        {"timestamp": 4, "session_id": "s", "tenant": "t2", "end": True},
    ])
    trace = load_trace(path)
    assert trace.sessions == 2
    assert [(r.tenant, r.turn, r.end, r.end_at_s) for r in trace.requests] == [
        ("t1", 1, False, None), ("t2", 1, False, None), ("t1", 2, True, None),
        ("t2", 2, False, 0.004)]


_END = {"timestamp": 5, "session_id": "a", "end": True}


@pytest.mark.parametrize(
    ("rows", "line", "fragment"),
    [
        ([_mc(0, [1]), "{not json"], 2, "not JSON"),
        ([_mc(10, [1]), _mc(5, [2])], 2, "timestamps must not decrease"),
        ([_mc(0, [1, 2], 600), _mc(1, [3], 2000)], 2, "needs 4 blocks"),
        ([_mc(0, [1]), {**_mc(1, [2]), "extra": 1}], 2, "unknown field(s) extra"),
        ([_mc(0, [1]), {**_mc(1, [2]), "input_length": "9"}], 2, "must be an integer"),
        ([_mc(0, [1]), [1, 2]], 2, "expected a JSON object"),
        ([_mc(0, [1]), {**_mc(1, [2]), "session_id": "x"}], 2, "decided by line 1"),
        ([{**_mc(0, [1]), "session_id": "a"}, {**_mc(1, [2]), "session_id": "a", "turn": 3}],
         2, "must be 2"),
        ([{**_mc(0, [1]), "session_id": "a", "end": True}, {**_mc(1, [2]), "session_id": "a"}],
         2, "continues after its 'end'"),
        ([{**_mc(0, [1]), "session_id": "a", "finish_reason": "eos"}], 1, "finish_reason"),
        ([{**_mc(0, [1]), "session_id": "a", "tool_names": ["x"]}], 1, "not 'tool_calls'"),
        ([_mc(0, [1]), {**_mc(1, [2]), "timestamp": -1}], 2, "timestamp"),
        # End lines: after a request of their session, once, alone, in time order.
        ([_END], 1, "which has no request before it"),
        ([{**_mc(0, [1]), "session_id": "b"}, _END], 2, "which has no request before it"),
        ([{**_mc(0, [1]), "session_id": "a"}, _END, _END], 3, "ends twice"),
        ([{**_mc(0, [1]), "session_id": "a", "end": True}, _END], 2, "ends twice"),
        ([{**_mc(0, [1]), "session_id": "a"}, _END, {**_mc(9, [2]), "session_id": "a"}], 3,
         "continues after its 'end'"),
        ([{**_mc(0, [1]), "session_id": "a"}, {**_END, "output_length": 3}], 2,
         "an end line has only"),
        ([{**_mc(9, [1]), "session_id": "a"}, _END], 2, "timestamps must not decrease"),
        ([{**_mc(0, [1]), "session_id": "a", "tenant": "x"}, {**_END, "tenant": "y"}], 2,
         "session 'a' of tenant 'y', which has no request before it"),
        ([_mc(0, [1]), _END], 2, "unknown field(s) end, session_id"),
        # An end line's session_id or tenant of another JSON type: a TraceError naming the
        # line, not a TypeError (a list or an object does not even hash).
        ([{**_mc(0, [1]), "session_id": "s"}, {"timestamp": 3, "session_id": ["s"],
                                                 "end": True}],
         2, "'session_id' must be a non-empty string, got ['s']"),
        ([{**_mc(0, [1]), "session_id": "s"}, {"timestamp": 3, "session_id": "s",
                                                 "tenant": {}, "end": True}],
         2, "'tenant' must be a non-empty string without '/', got {}"),
        ([{**_mc(0, [1]), "session_id": "s"}, {"timestamp": 3, "end": True}],
         2, "'session_id' must be a non-empty string, got None"),
        # Both timestamps exactly as written (":g" printed "1.23457e+06 is before
        # 1.23457e+06").
        ([_mc(1234568, [1]), _mc(1234567, [2])], 2,
         "timestamp 1234567 is before the previous line's 1234568"),
        ([_mc(0, [1]), {**_mc(1, [2]), "timestamp": 1234567.25},
          {**_mc(2, [3]), "timestamp": 1234567.125}], 3,
         "timestamp 1234567.125 is before the previous line's 1234567.25"),
    ],
)
def test_bad_lines_stop_the_load_naming_line_and_reason(tmp_path, rows, line, fragment):
    path = _write(tmp_path, rows)
    with pytest.raises(TraceError) as info:
        load_trace(path)
    assert info.value.line == line
    assert fragment in info.value.reason
    assert f"{path}:{line}:" in str(info.value)


def test_empty_and_missing_files(tmp_path):
    with pytest.raises(TraceError, match="empty"):
        load_trace(_write(tmp_path, []))
    with pytest.raises(TraceError, match="cannot read"):
        load_trace(tmp_path / "absent.jsonl")


def test_limit_and_blank_lines(tmp_path):
    path = _write(tmp_path, [_mc(0, [1]), "", _mc(1, [2]), _mc(2, [3])])
    assert [r.line for r in load_trace(path, limit=2).requests] == [1, 3]


def test_a_trace_of_smaller_blocks_is_simulated_in_groups_named_by_their_last_id(tmp_path):
    # Recorded at 16 tokens per id (a router in front of GPU workers), simulated at 32.
    path = _write(tmp_path, [
        {"timestamp": 0, "session_id": "s", "input_length": 70, "output_length": 1,
         "hash_ids": [1, 2, 3, 4, 5]},
        {"timestamp": 1, "session_id": "s", "input_length": 40, "output_length": 1,
         "hash_ids": [1, 2, 9]},
    ])
    trace = load_trace(path, block_size=32, trace_block_size=16)
    assert trace.block_size == 32
    assert [r.block_ids for r in trace.requests] == [(2, 4, 5), (2, 9)]
    with pytest.raises(TraceError, match="hash_ids' has 5 ids but input_length 70 needs 3"):
        load_trace(path, block_size=32)  # read as 32-token ids: the counts do not fit
    with pytest.raises(TraceError, match="must divide the simulated block size 32"):
        load_trace(path, block_size=32, trace_block_size=24)


def test_served_inter_token_latencies_give_the_traces_decode_time(tmp_path):
    def row(ts: int, itl: object | None) -> dict:
        obj = {"timestamp": ts, "session_id": f"s{ts}", "input_length": 32, "output_length": 9,
               "hash_ids": [ts]}
        if itl is not None:
            obj["itl_ms"] = itl
        return obj

    rows = [row(0, 10), row(1, None), row(2, 30.5), row(3, 12)]
    rows[0]["ttft_ms"] = 250
    trace = load_trace(_write(tmp_path, rows), block_size=32)
    assert [r.itl_s for r in trace.requests] == [0.010, None, 0.0305, 0.012]
    assert trace.served_decode_s_per_token() == (0.012, 3)
    assert trace.served_ttfts_s() == [0.25]
    untimed = load_trace(_write(tmp_path, [row(0, None)], "u.jsonl"), block_size=32)
    assert untimed.served_decode_s_per_token() is None
    with pytest.raises(TraceError, match=r":2: 'itl_ms' must be a number >= 0, got -1"):
        load_trace(_write(tmp_path, [row(0, 1), row(1, -1)], "bad.jsonl"), block_size=32)
    with pytest.raises(TraceError, match=r":1: 'ttft_ms' must be a number >= 0, got 'x'"):
        load_trace(_write(tmp_path, [{**row(0, 1), "ttft_ms": "x"}], "bad2.jsonl"),
                   block_size=32)


def test_a_trace_block_size_of_zero_is_refused_not_ignored(tmp_path):
    path = _write(tmp_path, [_mc(0, [1, 2])])
    with pytest.raises(TraceError, match="the trace's block size must be > 0, got 0"):
        load_trace(path, trace_block_size=0)
    with pytest.raises(TraceError, match="must be > 0, got -16"):
        load_trace(path, trace_block_size=-16)
    assert load_trace(path, trace_block_size=None).block_size == 512


def test_limit_counts_requests_not_end_lines(tmp_path):
    """--limit N: the first N requests; an end line before the (N+1)th request still ends
    its session."""
    path = _write(tmp_path, [
        {**_mc(0, [1]), "session_id": "s"},
        {"timestamp": 1, "session_id": "s", "end": True},
        {**_mc(2, [2]), "session_id": "t"},
        {**_mc(3, [3]), "session_id": "u"},
    ])
    trace = load_trace(path, limit=2)
    assert [(r.line, r.session_id, r.end_at_s) for r in trace.requests] == [
        (1, "s", 0.001), (3, "t", None)]
    assert len(load_trace(path, limit=1).requests) == 1
    assert len(load_trace(path, limit=9).requests) == 3


def test_lines_end_at_newlines_only(tmp_path):
    """A JSON string may hold a raw U+2028 (or a form feed): str.splitlines split the line
    there, and the load stopped with "not JSON". Later lines keep their numbers."""
    path = tmp_path / "t.jsonl"
    rows = [{**_mc(0, [1]), "session_id": "a\u2028b"}, {**_mc(1, [2]), "session_id": "c\x0cd"},
            {**_mc(2, [3]), "session_id": "e"}]
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows),
                    encoding="utf-8")
    assert "\u2028" in path.read_text(encoding="utf-8")
    trace = load_trace(path)
    assert [(r.line, r.session_id) for r in trace.requests] == [
        (1, "a\u2028b"), (2, "c\x0cd"), (3, "e")]
    path.write_text(path.read_text(encoding="utf-8") + "{oops\n", encoding="utf-8")
    with pytest.raises(TraceError, match=r":4: not JSON"):
        load_trace(path)
