"""Traffic recording: the requests the router serves, written as kvhint session JSONL (the
simulator's input, ``router/sim/trace.py``), so that ``kvhint sim run`` replays an
operator's own traffic against every policy and cache size before kvhint steers it.

One line per recorded request, in arrival order::

    {"timestamp": ms since the recording started, "session_id", "tenant",
     "input_length": the router's prompt token count, "output_length": completion tokens,
     "hash_ids": the router's block hashes of the prompt, "finish_reason",
     "tool_names" (tool calls only), "end" (explicit end only),
     "itl_ms" (streamed responses of 2+ tokens: the mean time between output tokens),
     "ttft_ms" (streamed responses: arrival at the router to the first event)}

No prompt text is written, only block hashes and lengths. ``hash_ids`` are the prompt's
vLLM block hashes as the router computes them for routing; a partial last block gets an
id of its own (the format names every block, full or not).

Contracts:
- recorded: requests whose prompt the router hashed with the model's tokenizer and that
  the worker answered (2xx with usage), counted in
  ``kvhint_router_trace_requests_written_total``. The rest are counted, never silently lost:
  ``kvhint_router_drops_total{what="trace_failed" | "trace_unhashed" |
  "trace_block_size" | "trace_stalled" | "trace_unfinished" | "trace_write_error"}``.
- arrival order: a finished request waits for every request that arrived before it; one
  that has not finished ``stall_s`` after it arrived is dropped (``trace_stalled``), so
  one lost request cannot hold the file back.
- one file per router start, ``kvhint-trace-<UTC start>-bs<block size>.jsonl`` in the
  configured directory, opened at the first recorded request; replay it with
  ``--block-size <block size>``. Requests hashed at another block size are dropped.
- a session id a client reuses after it ended the session (``X-Session-End``, or the
  sessions API) continues as ``<id>~2``, ``~3`` ... (a session ends for good in the trace
  format); a request without a session is a one-turn session ``~r<n>``. A ``~`` in a
  client's own id is written doubled (``a~2`` as ``a~~2``), so no client id reads as the
  recorder's ``~`` suffixes.
- an end through the sessions API after the session's last line is written as an end
  line, ``{"timestamp", "session_id", "tenant", "end": true}``, at the time the end came
  (the simulator ends the session then); an end the session's own request carried
  (``X-Session-End``) is on that request's line instead.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import IO

FILE_PREFIX = "kvhint-trace-"

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class TracedRequest:
    """What the router knows of one finished request (``session_id`` None: none given)."""

    tenant: str
    session_id: str | None
    prompt_tokens: int
    block_hashes: tuple[int, ...]  # full prompt blocks, root first
    block_size: int
    output_tokens: int
    finish_reason: str  # stop | tool_calls | length
    tool_names: tuple[str, ...]
    end: bool
    itl_ms: float | None = None  # streamed: mean time between output tokens
    ttft_ms: float | None = None  # streamed: arrival at the router to its first event


@dataclass(frozen=True, slots=True)
class _SessionEnded:
    """A session ended outside a request, in arrival order among the requests."""

    key: tuple[str, str]


class TraceRecorder:
    """Single event loop; file writes happen on one thread of the recorder's own, in the
    order they were asked for (a flush cancelled at shutdown still lands before the last).

    Invariant: every ticket in ``[_emitted, _issued)`` is in ``_arrivals`` until it is
    emitted or dropped; ``_finished`` holds those that finished, ``None`` for one that is
    not recorded (already counted), or a session's end (:meth:`session_ended`)."""

    def __init__(self, directory: Path, drop: Callable[[str, int], None], stall_s: float,
                 clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time,
                 on_written: Callable[[int], None] = lambda _n: None) -> None:
        self.directory = directory
        self._drop = drop
        self._on_written = on_written
        self._stall_s = stall_s
        self._clock = clock
        self._started = clock()
        self._started_wall = wall()
        self._issued = 0
        self._emitted = 0
        self._arrivals: dict[int, float] = {}
        self._finished: dict[int, TracedRequest | _SessionEnded | None] = {}
        self._lines: list[str] = []
        self._request_lines = 0  # of ``_lines`` (the rest are end lines)
        self._block_size: int | None = None
        self._file: IO[bytes] | None = None
        self.path: Path | None = None
        # Sessions ended since their last line; (tenant, id) -> times a reused id started
        # over (its lines are "<id>~<n + 1>"). Both hold ended sessions only.
        self._ended: set[tuple[str, str]] = set()
        self._restarts: dict[tuple[str, str], int] = {}
        # Sessions with a line written and no end yet: (tenant, id) -> the id in the file.
        self._open: dict[tuple[str, str], str] = {}
        self._partial_ids = 0
        self._written = 0
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvhint-trace")

    @property
    def written(self) -> int:
        return self._written

    def arrived(self) -> int:
        """A request arrived; returns its ticket for :meth:`finished`."""
        ticket = self._issued
        self._issued += 1
        self._arrivals[ticket] = self._clock()
        return ticket

    def finished(self, ticket: int, request: TracedRequest | None, reason: str = "") -> None:
        """The request of ``ticket`` ended: ``request`` to record it, or None with the
        drop ``reason`` it is counted under."""
        if ticket not in self._arrivals or ticket in self._finished:
            return  # dropped as stalled meanwhile (counted then)
        if request is not None and self._block_size not in (None, request.block_size):
            request, reason = None, "trace_block_size"
        if request is not None and len(request.block_hashes) < (
                request.prompt_tokens // request.block_size):
            request, reason = None, "trace_unhashed"
        if request is None:
            self._drop(reason, 1)
        elif self._block_size is None:
            self._block_size = request.block_size
        self._finished[ticket] = request
        self._emit()

    def session_ended(self, tenant: str, session_id: str) -> None:
        """The session was ended outside a request (``DELETE /v1/sessions/{id}``, the admin
        API): a request that arrives later under its id starts a new session."""
        ticket = self.arrived()
        self._finished[ticket] = _SessionEnded((tenant, session_id))
        self._emit()

    async def flush(self) -> None:
        """Drop stalled requests, then append the lines ready so far to the file."""
        now = self._clock()
        while self._emitted < self._issued and self._emitted not in self._finished and (
                now - self._arrivals[self._emitted] > self._stall_s):
            self._finished[self._emitted] = None
            self._drop("trace_stalled", 1)
            self._emit()
        await self._write()

    async def close(self) -> None:
        """Write what finished; requests still unfinished are dropped (counted)."""
        unfinished = [t for t in range(self._emitted, self._issued) if t not in self._finished]
        for ticket in unfinished:
            self._finished[ticket] = None
        if unfinished:
            self._drop("trace_unfinished", len(unfinished))
        self._emit()
        await self._write()
        if self._file is not None:
            try:
                await asyncio.get_running_loop().run_in_executor(self._io, self._file.close)
            except OSError as exc:  # must not stop the router's shutdown after it
                log.warning("trace file %s did not close cleanly: %s", self.path, exc)
            self._file = None
        self._io.shutdown(wait=True)

    # -- internals ------------------------------------------------------------------------

    def _emit(self) -> None:
        while self._emitted in self._finished:
            ticket = self._emitted
            request = self._finished.pop(ticket)
            arrived = self._arrivals.pop(ticket)
            self._emitted += 1
            if isinstance(request, _SessionEnded):
                self._ended.add(request.key)
                if (written_id := self._open.pop(request.key, None)) is not None:
                    self._lines.append(self._end_line(arrived, request.key[0], written_id))
            elif request is not None:
                self._lines.append(self._line(ticket, arrived, request))
                self._request_lines += 1

    def _line(self, ticket: int, arrived: float, request: TracedRequest) -> str:
        if request.session_id is None:
            session_id = f"~r{ticket}"
        else:
            key = (request.tenant, request.session_id)
            if key in self._ended:  # ended earlier: this id starts over
                self._ended.discard(key)
                self._restarts[key] = self._restarts.get(key, 0) + 1
            restarts = self._restarts.get(key, 0)
            own_id = request.session_id.replace("~", "~~")
            session_id = own_id if not restarts else f"{own_id}~{restarts + 1}"
            if request.end:
                self._ended.add(key)
                self._open.pop(key, None)
            else:
                self._open[key] = session_id
        full = request.prompt_tokens // request.block_size
        hash_ids = list(request.block_hashes[:full])
        if request.prompt_tokens % request.block_size:
            self._partial_ids += 1
            hash_ids.append(self._partial_ids)
        row: dict[str, object] = {
            "timestamp": self._timestamp_ms(arrived),
            "session_id": session_id, "tenant": request.tenant,
            "input_length": request.prompt_tokens, "output_length": request.output_tokens,
            "hash_ids": hash_ids, "finish_reason": request.finish_reason,
        }
        if request.finish_reason == "tool_calls" and request.tool_names:
            row["tool_names"] = list(request.tool_names)
        if request.end and request.session_id is not None:
            row["end"] = True
        if request.itl_ms is not None:
            row["itl_ms"] = round(request.itl_ms, 2)
        if request.ttft_ms is not None:
            row["ttft_ms"] = round(request.ttft_ms, 1)
        return _json_line(row)

    def _end_line(self, arrived: float, tenant: str, session_id: str) -> str:
        return _json_line({"timestamp": self._timestamp_ms(arrived),
                           "session_id": session_id, "tenant": tenant, "end": True})

    def _timestamp_ms(self, arrived: float) -> float:
        return round((arrived - self._started) * 1000.0, 1)

    async def _write(self) -> None:
        if not self._lines:
            return
        lines, self._lines = self._lines, []
        requests, self._request_lines = self._request_lines, 0
        try:
            await asyncio.get_running_loop().run_in_executor(self._io, self._append, lines)
        except OSError:
            self._drop("trace_write_error", len(lines))  # end lines too: the end is lost
            return
        self._written += requests
        self._on_written(requests)

    def _append(self, lines: list[str]) -> None:
        if self._file is None:
            stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(self._started_wall))
            self.directory.mkdir(parents=True, exist_ok=True)
            name = f"{FILE_PREFIX}{stamp}-bs{self._block_size}"
            path, n = self.directory / f"{name}.jsonl", 1
            while path.exists():  # another router started in the same second
                n += 1
                path = self.directory / f"{name}-{n}.jsonl"
            self.path = path
            # Unbuffered: what write() returns is on disk, so a failed write can be undone.
            self._file = path.open("xb", buffering=0)
        data = "".join(lines).encode("utf-8")
        start = self._file.tell()
        try:
            view = memoryview(data)
            while view:
                view = view[self._file.write(view):]
        except OSError:
            # A full disk or a file size limit: take back what part of the batch got
            # written, so the file never holds half a line, nor lines counted as dropped.
            self._file.truncate(start)
            self._file.seek(start)
            raise


def _json_line(row: dict[str, object]) -> str:
    return json.dumps(row, separators=(",", ":")) + "\n"
