"""Trace input: Mooncake JSONL and kvhint's session-annotated JSONL.

Both are one JSON object per line; blocks are named by ``hash_ids``, ids chained by prefix
(equal ids at the same position = identical prefix), ``block_size`` tokens each.

**Mooncake** (the FAST'25 release): ``{"timestamp": ms, "input_length", "output_length",
"hash_ids": [...]}``. It has no sessions; they are inferred: a request continues the
session of the most recent earlier request whose last *full* prompt block appears in this
request's prefix at depth >= 2 (its whole cached prompt is a prefix of this one); otherwise
it starts a session. Every response ends with ``stop``; no explicit ends.

**kvhint session JSONL** (ours) adds, per line::

    "session_id": str          required; the session this request belongs to (with
                               "tenant": two tenants' equal ids are two sessions)
    "turn": int                optional; 1, 2, ... per session (checked when given)
    "finish_reason": "stop" | "tool_calls" | "length"   optional, default "stop"
    "tool_names": [str, ...]   optional; the tools called when finish_reason is tool_calls
    "end": bool                optional; the session ends explicitly after this response
    "tenant": str              optional, default "default"
    "itl_ms": number           optional; the response's mean time between output tokens
                               as served (the router's recordings carry it); their median
                               is the simulator's decode time unless one is given
    "ttft_ms": number          optional; the response's time to first token as served,
                               shown beside the simulated TTFTs

and one more kind of line, an **end line**: ``{"timestamp", "session_id", "tenant"?,
"end": true}`` and nothing else. The session ended explicitly at that time (the router's
``DELETE /v1/sessions/{id}``), after the request on its latest line; the simulator ends
it then, or when that response ends if the replay is later (one the simulator's planner
abandoned before then is ended as the router ends it: nothing is sent again). A session
with no request before it, or one already ended, is an error.

A file is one format or the other (decided by the first line). Anything malformed stops
the load with :class:`TraceError` naming the file, line and reason; nothing is simulated
from a partial trace.
"""

from __future__ import annotations

import itertools
import json
import math
import statistics
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

FINISH_REASONS = ("stop", "tool_calls", "length")
_MOONCAKE_KEYS = {"timestamp", "input_length", "output_length", "hash_ids"}
_SESSION_KEYS = _MOONCAKE_KEYS | {"session_id", "turn", "finish_reason", "tool_names", "end",
                                  "tenant", "itl_ms", "ttft_ms"}
_END_LINE_KEYS = {"timestamp", "session_id", "tenant", "end"}


class TraceError(ValueError):
    """A trace that cannot be simulated; ``line`` is 1-based (0: the file as a whole)."""

    def __init__(self, path: str, line: int, reason: str) -> None:
        where = f"{path}:{line}" if line else path
        super().__init__(f"{where}: {reason}")
        self.path = path
        self.line = line
        self.reason = reason


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace. ``arrival_s`` is seconds from the trace start."""

    line: int
    arrival_s: float
    session_id: str
    turn: int
    input_length: int
    output_length: int
    block_ids: tuple[int, ...]
    finish_reason: str = "stop"
    tool_names: tuple[str, ...] = ()
    end: bool = False
    tenant: str = "default"
    itl_s: float | None = None  # as served, where the trace says (session format)
    ttft_s: float | None = None  # as served, where the trace says (session format)
    end_at_s: float | None = None  # an end line: the session ended then, after this request

    def full_blocks(self, block_size: int) -> int:
        return self.input_length // block_size


@dataclass(frozen=True, slots=True)
class Trace:
    path: str
    format: str  # "mooncake" | "session"
    block_size: int
    requests: tuple[TraceRequest, ...]

    @property
    def sessions(self) -> int:
        return len({(r.tenant, r.session_id) for r in self.requests})

    def served_ttfts_s(self) -> list[float]:
        """The times to first token its responses were served with, where it says."""
        return [r.ttft_s for r in self.requests if r.ttft_s is not None]

    def served_decode_s_per_token(self) -> tuple[float, int] | None:
        """The median time between output tokens its responses were served with, and
        how many responses say; None when none does."""
        served = [r.itl_s for r in self.requests if r.itl_s is not None]
        return (statistics.median(served), len(served)) if served else None


def load_trace(path: str | Path, block_size: int = 512, limit: int | None = None,
               trace_block_size: int | None = None) -> Trace:
    """Parse and validate a whole trace (first ``limit`` requests when given).

    ``trace_block_size``: the tokens each of the file's ``hash_ids`` names, when it is not
    ``block_size`` but divides it (a trace the router recorded at vLLM's GPU block size
    16, simulated at the CPU build's 32 or more): every ``block_size // trace_block_size``
    ids become one block, named by the last of them. Ids are chained by prefix, so the
    last id of a group names the group's whole prefix."""
    name = str(path)
    trace_block_size = block_size if trace_block_size is None else trace_block_size
    if trace_block_size <= 0:
        raise TraceError(name, 0, f"the trace's block size must be > 0, got {trace_block_size}")
    if block_size % trace_block_size:
        raise TraceError(name, 0, f"the trace's block size {trace_block_size} must divide "
                                  f"the simulated block size {block_size}")
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise TraceError(name, 0, f"cannot read: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise TraceError(name, 0, f"not UTF-8 text: {exc.reason}") from exc
    rows = _json_lines(name, text)
    first = next(rows, None)
    if first is None:
        raise TraceError(name, 0, "no requests (empty file)")
    fmt = "session" if "session_id" in first[1] else "mooncake"
    requests: list[TraceRequest] = []
    previous_ms = -math.inf
    # Sessions are a tenant's: two tenants' "s" are two sessions (the router keys them so).
    turns: dict[tuple[str, str], int] = {}
    ended: set[tuple[str, str]] = set()
    inference = _SessionInference(block_size)
    # (tenant, session) -> index of its latest request in ``requests``
    latest: dict[tuple[str, str], int] = {}
    for line, obj in itertools.chain([first], rows):
        if fmt == "session" and "input_length" not in obj and obj.get("end") is True:
            previous_ms = _end_line(name, line, obj, previous_ms, requests, latest, ended)
            continue
        if limit is not None and len(requests) >= limit:
            break  # the limit counts requests; end lines up to here still count
        common = _common_fields(name, line, obj, trace_block_size, fmt)
        if trace_block_size != block_size:
            common = (*common[:3], _regroup(common[3], block_size // trace_block_size))
        timestamp, input_length, output_length, block_ids = common
        _check_order(name, line, timestamp, previous_ms)
        previous_ms = timestamp
        if fmt == "mooncake":
            session_id, turn = inference.assign(block_ids, input_length)
            requests.append(TraceRequest(line, timestamp / 1000.0, session_id, turn,
                                         input_length, output_length, block_ids))
            continue
        requests.append(_session_request(name, line, obj, common, turns, ended))
        latest[(requests[-1].tenant, requests[-1].session_id)] = len(requests) - 1
    if not requests:
        raise TraceError(name, 0, "no requests (only end lines)")
    return Trace(name, fmt, block_size, tuple(requests))


def _end_line(name: str, line: int, obj: dict, previous_ms: float,
              requests: list[TraceRequest], latest: dict[tuple[str, str], int],
              ended: set[tuple[str, str]]) -> float:
    """Fold an end line into its session's latest request; returns its timestamp."""
    unknown = sorted(set(obj) - _END_LINE_KEYS)
    if unknown:
        raise TraceError(name, line, f"an end line has only timestamp, session_id, tenant "
                                     f"and end; got {', '.join(unknown)}")
    timestamp = _timestamp_ms(name, line, obj)
    _check_order(name, line, timestamp, previous_ms)
    session_id, tenant = _session_key(name, line, obj)
    key = (tenant, session_id)
    if key in ended:
        raise TraceError(name, line, f"session {session_id!r} of tenant {tenant!r} ends twice")
    index = latest.get(key)
    if index is None:
        raise TraceError(name, line, f"end line for session {session_id!r} of tenant "
                                     f"{tenant!r}, which has no request before it")
    ended.add(key)
    requests[index] = replace(requests[index], end_at_s=timestamp / 1000.0)
    return timestamp


def _timestamp_ms(name: str, line: int, obj: dict) -> float:
    if "timestamp" not in obj:
        raise TraceError(name, line, "missing 'timestamp'")
    timestamp = obj["timestamp"]
    if isinstance(timestamp, bool) or not isinstance(timestamp, (int, float)) or not (
        math.isfinite(timestamp) and timestamp >= 0
    ):
        raise TraceError(name, line, f"'timestamp' must be a number >= 0 (ms), got {timestamp!r}")
    return float(timestamp)


def _check_order(name: str, line: int, timestamp: float, previous_ms: float) -> None:
    if timestamp < previous_ms:
        raise TraceError(name, line, f"timestamp {_exact(timestamp)} is before the previous "
                                     f"line's {_exact(previous_ms)} (timestamps must not "
                                     "decrease)")


def _exact(value: float) -> str:
    """A timestamp as written: every digit (":g" keeps 6, so 1234567 and 1234568 both
    read 1.23457e+06), and no ".0" on whole numbers."""
    return str(int(value)) if value.is_integer() else repr(value)


def _regroup(block_ids: tuple[int, ...], factor: int) -> tuple[int, ...]:
    """Every ``factor`` consecutive ids as one, named by the last (a partial group too)."""
    return tuple(block_ids[min(start + factor, len(block_ids)) - 1]
                 for start in range(0, len(block_ids), factor))


def _json_lines(name: str, text: str) -> Iterator[tuple[int, dict]]:
    """(line number, object) per non-blank line. Lines end at "\n" only: JSON strings may
    hold a raw U+2028 or form feed, which str.splitlines would also split at (and
    misnumber every later line)."""
    for number, raw in enumerate(text.split("\n"), start=1):
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise TraceError(name, number, f"not JSON: {exc.msg} (column {exc.colno})") from exc
        if not isinstance(obj, dict):
            raise TraceError(name, number, f"expected a JSON object, got {type(obj).__name__}")
        yield number, obj


def _int_field(name: str, line: int, obj: dict, key: str, minimum: int) -> int:
    if key not in obj:
        raise TraceError(name, line, f"missing {key!r}")
    value = obj[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise TraceError(name, line, f"{key!r} must be an integer, got {value!r}")
    if value < minimum:
        raise TraceError(name, line, f"{key!r} must be >= {minimum}, got {value}")
    return value


def _common_fields(
    name: str, line: int, obj: dict, block_size: int, fmt: str
) -> tuple[float, int, int, tuple[int, ...]]:
    allowed = _SESSION_KEYS if fmt == "session" else _MOONCAKE_KEYS
    unknown = sorted(set(obj) - allowed)
    if unknown:
        hint = " (a session_id on a later line? the format is decided by line 1)" if (
            "session_id" in unknown) else ""
        raise TraceError(name, line, f"unknown field(s) {', '.join(unknown)}{hint}")
    if fmt == "session" and "session_id" not in obj:
        raise TraceError(name, line, "missing 'session_id' (line 1 made this a session trace)")
    timestamp = _timestamp_ms(name, line, obj)
    input_length = _int_field(name, line, obj, "input_length", 1)
    output_length = _int_field(name, line, obj, "output_length", 0)
    ids = obj.get("hash_ids")
    if not isinstance(ids, list) or not all(
        isinstance(h, int) and not isinstance(h, bool) and h >= 0 for h in ids
    ):
        raise TraceError(name, line, "'hash_ids' must be a list of non-negative integers")
    expected = -(-input_length // block_size)
    if len(ids) != expected:
        raise TraceError(
            name, line, f"'hash_ids' has {len(ids)} ids but input_length {input_length} "
            f"needs {expected} blocks of {block_size} tokens"
        )
    return float(timestamp), input_length, output_length, tuple(ids)


def _session_request(
    name: str,
    line: int,
    obj: dict,
    common: tuple[float, int, int, tuple[int, ...]],
    turns: dict[tuple[str, str], int],
    ended: set[tuple[str, str]],
) -> TraceRequest:
    timestamp, input_length, output_length, block_ids = common
    session_id, tenant = _session_key(name, line, obj)
    key = (tenant, session_id)
    if key in ended:
        raise TraceError(name, line, f"session {session_id!r} continues after its 'end'")
    expected_turn = turns.get(key, 0) + 1
    turn = obj.get("turn", expected_turn)
    if isinstance(turn, bool) or not isinstance(turn, int) or turn != expected_turn:
        raise TraceError(
            name, line, f"'turn' of session {session_id!r} must be {expected_turn}, got {turn!r}"
        )
    turns[key] = turn
    finish = obj.get("finish_reason", "stop")
    if finish not in FINISH_REASONS:
        raise TraceError(
            name, line, f"'finish_reason' must be one of {', '.join(FINISH_REASONS)}, got {finish!r}"
        )
    tools = obj.get("tool_names", [])
    if not isinstance(tools, list) or not all(isinstance(t, str) and t for t in tools):
        raise TraceError(name, line, "'tool_names' must be a list of non-empty strings")
    if tools and finish != "tool_calls":
        raise TraceError(name, line, "'tool_names' given but finish_reason is not 'tool_calls'")
    end = obj.get("end", False)
    if not isinstance(end, bool):
        raise TraceError(name, line, f"'end' must be true or false, got {end!r}")
    if end:
        ended.add(key)
    served = [_served_s(name, line, obj, key) for key in ("itl_ms", "ttft_ms")]
    return TraceRequest(line, timestamp / 1000.0, session_id, turn, input_length, output_length,
                        block_ids, finish, tuple(tools), end, tenant, *served)


def _session_key(name: str, line: int, obj: dict) -> tuple[str, str]:
    """A request or end line's (session_id, tenant), checked (any JSON value may be there:
    a list or an object would not even hash)."""
    session_id = obj.get("session_id")
    if not isinstance(session_id, str) or not session_id:
        raise TraceError(name, line, f"'session_id' must be a non-empty string, got "
                                     f"{session_id!r}")
    tenant = obj.get("tenant", "default")
    if not isinstance(tenant, str) or not tenant or "/" in tenant:
        raise TraceError(name, line, f"'tenant' must be a non-empty string without '/', got "
                                     f"{tenant!r}")
    return session_id, tenant


def _served_s(name: str, line: int, obj: dict, key: str) -> float | None:
    """An optional served time in ms, as seconds."""
    value = obj.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            math.isfinite(value) and value >= 0):
        raise TraceError(name, line, f"{key!r} must be a number >= 0, got {value!r}")
    return value / 1000.0


class _SessionInference:
    """Mooncake sessions from shared prefixes (see the module docstring)."""

    def __init__(self, block_size: int) -> None:
        self._block_size = block_size
        # last full prompt block id of a request -> (session, turn) of that request
        self._terminal: dict[int, tuple[str, int]] = {}
        self._count = 0

    def assign(self, block_ids: tuple[int, ...], input_length: int) -> tuple[str, int]:
        found: tuple[str, int] | None = None
        for depth in range(len(block_ids) - 1, 0, -1):
            found = self._terminal.get(block_ids[depth])
            if found is not None:
                break
        if found is None:
            session_id, turn = f"m{self._count:06d}", 1
            self._count += 1
        else:
            session_id, turn = found[0], found[1] + 1
        full = input_length // self._block_size
        if full >= 1:
            self._terminal[block_ids[full - 1]] = (session_id, turn)
        return session_id, turn


def intern_block_ids(trace: Trace) -> dict[int, int]:
    """The trace's block ids -> dense ids 0, 1, 2, ... in order of first appearance.

    A block's tokens are derived from its id modulo the token vocabulary
    (:func:`tokens_for_block_ids`), so ids a vocabulary apart (any id may be as large as a
    trace likes: hashes, epoch-stamped counters) would name the same block. Interned,
    distinct ids never collide, and equal ids stay equal, which is all the id means."""
    interned: dict[int, int] = {}
    for request in trace.requests:
        for block_id in request.block_ids:
            if block_id not in interned:
                interned[block_id] = len(interned)
    return interned
