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
  (``X-Session-End``) is on that request's line instead. The file holds the clients'
  events only: a session the planner abandoned when idle has no line for that (the
  replay's planner abandons on its own); its client's end after it (or an admin's) is an
  end line as any, once however often repeated (``SessionLifecycle`` tells each
  explicit end once).
- bounded memory: what the recorder remembers per session (its id in the file, ended or
  not, restarts) is kept for the ``max_sessions`` most recently written sessions; one
  forgotten is counted, ``trace_session_evicted``. A forgotten session that comes back
  (told by a fixed-size bitmap of forgotten keys: no false negatives) continues under a
  fresh id, ``<id>~e<n>``, so it never continues an id the file may have ended; an end
  through the API for it writes no end line.
- bounded disk (``max_bytes``): once the file holds ``max_bytes`` or more, the next line
  starts a new one under the same name, the full one renamed ``<name>.jsonl.1`` (older
  ones shifted to ``.2`` ...; ``keep_files`` kept, the oldest deleted, its requests
  counted, ``trace_rotated_out``). A file passes ``max_bytes`` by at most one line. Every
  file loads on its own: a session's end line is written only into the file that holds
  one of its requests (an end through the API for a session whose lines are all in an
  earlier file is not written).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

FILE_PREFIX = "kvhint-trace-"
MAX_SESSIONS = 100_000
# Bits of the filter of forgotten sessions (1 MiB): a returning session's bit is set, a
# new one's is set only by a collision (it then gets a fresh id it did not need).
_FORGOTTEN_BITS = 1 << 23

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


@dataclass(slots=True)
class _Track:
    """What the recorder remembers of one (tenant, client session id)."""

    base: str  # the id its lines carry, before any ~<n> restart suffix
    restarts: int = 0  # times a reused id started over after an end
    ended: bool = False  # ended since its last line: its next line starts over
    # Open (not ended), with a line in the current file: the id that line carries.
    written_id: str | None = None


@dataclass(slots=True)
class _Part:
    """Lines bound for one file; ``rotate``: the file before them is full."""

    rotate: bool
    lines: list[str] = field(default_factory=list)
    requests: int = 0  # of ``lines`` (the rest are end lines)


class TraceRecorder:
    """Single event loop; file writes happen on one thread of the recorder's own, in the
    order they were asked for (a flush cancelled at shutdown still lands before the last).

    Invariant: every ticket in ``[_emitted, _issued)`` is in ``_arrivals`` until it is
    emitted or dropped; ``_finished`` holds those that finished, ``None`` for one that is
    not recorded (already counted), or a session's end (:meth:`session_ended`)."""

    def __init__(self, directory: Path, drop: Callable[[str, int], None], stall_s: float,
                 clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time,
                 on_written: Callable[[int], None] = lambda _n: None,
                 max_sessions: int = MAX_SESSIONS, max_bytes: int | None = None,
                 keep_files: int = 4) -> None:
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
        self._parts: list[_Part] = [_Part(rotate=False)]  # the last takes new lines
        self._max_bytes = max_bytes
        self._keep_files = keep_files
        self._part_bytes = 0  # of the current file, written or waiting (lines are ASCII)
        # Thread side: requests in the open file, and in each rotated one (.1 first).
        self._file_requests = 0
        self._rotated_requests: list[int] = []
        self._block_size: int | None = None
        self._file: IO[bytes] | None = None
        self.path: Path | None = None
        # (tenant, id) -> its track, least recently written first (evicted from the front).
        self._tracks: OrderedDict[tuple[str, str], _Track] = OrderedDict()
        self._max_sessions = max_sessions
        self._forgotten = bytearray(_FORGOTTEN_BITS // 8)
        self._fresh_ids = 0
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
            if self._max_bytes is not None and self._part_bytes >= self._max_bytes:
                self._new_file()  # before the line: its end line needs the file it is in
            if isinstance(request, _SessionEnded):
                track = self._track(request.key)
                track.ended = True
                if (written_id := track.written_id) is not None:
                    track.written_id = None
                    self._add(self._end_line(arrived, request.key[0], written_id), False)
            elif request is not None:
                self._add(self._line(ticket, arrived, request), True)

    def _add(self, line: str, request: bool) -> None:
        part = self._parts[-1]
        part.lines.append(line)
        part.requests += request
        self._part_bytes += len(line)  # json.dumps writes ASCII: one byte a character

    def _new_file(self) -> None:
        """The lines from here go to a new file: no session has a line in it yet."""
        self._parts.append(_Part(rotate=True))
        self._part_bytes = 0
        for track in self._tracks.values():
            track.written_id = None

    def _track(self, key: tuple[str, str]) -> _Track:
        """The session's track, the most recently used now (made, evicting the least
        recently used past ``max_sessions``, when it has none)."""
        track = self._tracks.get(key)
        if track is not None:
            self._tracks.move_to_end(key)
            return track
        base = key[1].replace("~", "~~")
        bit = hash(key) % _FORGOTTEN_BITS
        if self._forgotten[bit >> 3] & (1 << (bit & 7)):
            # Maybe forgotten earlier: its id may have ended in the file.
            self._fresh_ids += 1
            base = f"{base}~e{self._fresh_ids}"
        track = self._tracks[key] = _Track(base)
        while len(self._tracks) > self._max_sessions:
            old_key, _old = self._tracks.popitem(last=False)
            bit = hash(old_key) % _FORGOTTEN_BITS
            self._forgotten[bit >> 3] |= 1 << (bit & 7)
            self._drop("trace_session_evicted", 1)
        return track

    def _line(self, ticket: int, arrived: float, request: TracedRequest) -> str:
        if request.session_id is None:
            session_id = f"~r{ticket}"
        else:
            track = self._track((request.tenant, request.session_id))
            if track.ended:  # ended earlier: this id starts over
                track.ended = False
                track.restarts += 1
            restarts = track.restarts
            session_id = track.base if not restarts else f"{track.base}~{restarts + 1}"
            track.ended = request.end
            track.written_id = None if request.end else session_id
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
        if not any(part.lines or part.rotate for part in self._parts):
            return
        parts, self._parts = self._parts, [_Part(rotate=False)]
        loop = asyncio.get_running_loop()
        for part in parts:
            if part.rotate and self._file is not None:
                try:
                    lost = await loop.run_in_executor(self._io, self._rotate)
                except OSError as exc:
                    # Its lines go on into the full file (reopened): nothing is lost.
                    log.warning("trace file %s could not be rotated: %s", self.path, exc)
                    lost = 0
                if lost:
                    self._drop("trace_rotated_out", lost)
            if not part.lines:
                continue
            try:
                await loop.run_in_executor(self._io, self._append, part.lines, part.requests)
            except OSError:
                # End lines too: the end is lost.
                self._drop("trace_write_error", len(part.lines))
                continue
            self._written += part.requests
            self._on_written(part.requests)

    def _append(self, lines: list[str], requests: int) -> None:
        if self._file is None:
            if self.path is None:
                stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(self._started_wall))
                self.directory.mkdir(parents=True, exist_ok=True)
                name = f"{FILE_PREFIX}{stamp}-bs{self._block_size}"
                path, n = self.directory / f"{name}.jsonl", 1
                while path.exists():  # another router started in the same second
                    n += 1
                    path = self.directory / f"{name}-{n}.jsonl"
                self.path = path
                mode = "xb"
            else:  # after a rotation (appends, should the rename have failed)
                mode = "ab"
            # Unbuffered: what write() returns is on disk, so a failed write can be undone.
            self._file = self.path.open(mode, buffering=0)
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
        self._file_requests += requests

    def _rotate(self) -> int:
        """Close the full file and shift it to ``.1`` (``.1`` to ``.2`` ...), deleting the
        one past ``keep_files``; returns the requests deleted with it. The next append
        opens a new file under the name."""
        assert self._file is not None and self.path is not None
        file, self._file = self._file, None
        file.close()
        path = self.path
        lost = 0
        if len(self._rotated_requests) >= self._keep_files:
            Path(f"{path}.{self._keep_files}").unlink(missing_ok=True)
            lost = sum(self._rotated_requests[self._keep_files - 1:])
            del self._rotated_requests[self._keep_files - 1:]
        for n in range(len(self._rotated_requests), 0, -1):
            Path(f"{path}.{n}").rename(f"{path}.{n + 1}")
        path.rename(f"{path}.1")
        self._rotated_requests.insert(0, self._file_requests)
        self._file_requests = 0
        return lost


def _json_line(row: dict[str, object]) -> str:
    return json.dumps(row, separators=(",", ":")) + "\n"
