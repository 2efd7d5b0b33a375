"""What the router learns from a worker's Responses API answer (``POST /v1/responses``),
without changing a byte it forwards.

A Responses answer is a response object (``{"id", "status", "output": [...], "usage":
{"input_tokens", "output_tokens", "input_tokens_details": {"cached_tokens"}}, "error"}``),
whole or as a stream of typed events (``event: <type>`` / ``data: {"type": <type>,
"sequence_number": n, ...}``): ``response.created``, ``response.in_progress``, output
deltas, then a terminal one carrying the final response object: ``response.completed``
(vLLM sends it whatever the final status: ``completed``, ``incomplete``, ``failed``),
``response.failed``/``response.incomplete`` (OpenAI's), or an ``error`` event. There is
no ``[DONE]``. (vllm/entrypoints/openai/responses/serving.py, api_router.py.)

:class:`ResponsesObservation` fills the same fields the chat path's
:class:`ResponseObservation` does (usage, finish reason, tool names, a failed answer's
status), so accounting, metrics and the session's turn read one shape.
:class:`ResponsesRelay` is the stream's relay (the chat one's interface: ``relay``,
``finished``, ``release_held``), parsing only the few events that say something.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec

from kvhint.router.safe_text import escaped
from kvhint.router.service.response_scan import (
    ResponseObservation,
    SseRelay,
    check_pending,
    cut_events,
    whole_events,
)

if TYPE_CHECKING:
    from kvhint.router.service.responses_cancels import CancelWatch


class _Details(msgspec.Struct):
    cached_tokens: int | None = None


class _OutputDetails(msgspec.Struct):
    reasoning_tokens: int | None = None


class _Usage(msgspec.Struct):
    input_tokens: int = 0
    output_tokens: int = 0
    input_tokens_details: _Details | None = None
    output_tokens_details: _OutputDetails | None = None


class _Item(msgspec.Struct):
    type: str | None = None
    name: str | None = None


class _Error(msgspec.Struct):
    code: Any = None
    message: str | None = None


class _Incomplete(msgspec.Struct):
    reason: str | None = None


class _Response(msgspec.Struct):
    status: str | None = None
    output: list[_Item] = []
    usage: _Usage | None = None
    error: _Error | None = None
    incomplete_details: _Incomplete | None = None


class _Event(msgspec.Struct):
    type: str | None = None
    response: _Response | None = None
    code: Any = None
    message: Any = None


_response_decoder = msgspec.json.Decoder(_Response)
_event_decoder = msgspec.json.Decoder(_Event)
_snapshot_decoder = msgspec.json.Decoder(dict)
_encode = msgspec.json.Encoder().encode

# Events that end a Responses stream (the client then has its whole answer).
TERMINAL_EVENTS = frozenset({"response.completed", "response.failed", "response.incomplete",
                             "error"})
# Read for what they say; every other event passes unparsed (the deltas: nearly all).
_READ_EVENTS = TERMINAL_EVENTS | {"response.created"}
# Output items that are the model calling a tool the agent runs (a tool gap follows).
_TOOL_CALL_ITEMS = frozenset({"function_call", "custom_tool_call"})
# A failed response's error code (OpenAI's ResponseError codes) as a status.
_FAILED_CODES = {"rate_limit_exceeded": 429, "invalid_prompt": 400}
# A response still running when the answer came: one started with ``background: true``.
RUNNING_STATUSES = frozenset({"queued", "in_progress"})


@dataclass(slots=True)
class ResponsesObservation(ResponseObservation):
    """One Responses answer, in the chat observation's fields (module doc)."""

    # The answer was a background response still queued or running: its generation
    # (and usage) happens after the router's request ended.
    background: bool = False
    # The stream's ``response.created`` response object: the one a failure event the
    # router sends itself is built from.
    snapshot: dict[str, Any] | None = None
    # Events seen so far (vLLM numbers them from 0: the next one's sequence_number).
    events: int = 0
    # Of ``completion_tokens``, the reasoning ones (vLLM's output_tokens_details): a
    # follow-up's prompt leaves them out (vLLM skips the reasoning of the response it
    # continues: responses/utils.py construct_input_messages).
    reasoning_tokens: int = 0
    # Called once the answer's usage is read (a stream's: at its terminal event).
    on_usage: Callable[[ResponsesObservation], None] | None = None
    # Called at a stream's terminal event carrying the response (vLLM has stored a
    # streamed response then, not before: responses_api.py), before its usage is read.
    on_end: Callable[[ResponsesObservation], None] | None = None
    # Called at a stream's ``error`` event with its code and message (a background
    # response's then stays queued in vLLM's store for good: responses_background.py).
    on_error: Callable[[Any, Any], None] | None = None
    # Starts watching the stream for a cancel of its response, given what closes the
    # worker's side (a background response's stream: responses_cancels.py).
    watch_cancel: Callable[[Callable[[], None]], CancelWatch] | None = None

    def observe_json(self, payload: bytes) -> bool:
        """A whole (non-streamed) answer; never a usage-only chunk."""
        try:
            self._observe_response(_response_decoder.decode(payload))
        except (msgspec.DecodeError, msgspec.ValidationError):
            self.malformed_chunks += 1
        return False

    def observe_event(self, kind: str, payload: bytes) -> None:
        """One stream event of type ``kind`` (one of the read ones) with its data."""
        try:
            event = _event_decoder.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError):
            self.malformed_chunks += 1
            return
        if kind == "response.created":
            self.snapshot = _snapshot_of(payload)
        elif kind == "error":
            if self.error_status is None:
                self.error_status = _code_status(event.code)
            if self.on_error is not None:
                self.on_error(event.code, event.message)
        elif event.response is not None:
            if self.on_end is not None:
                self.on_end(self)
            self._observe_response(event.response)
            if kind == "response.failed" and self.error_status is None:
                self.error_status = 500

    def usage_lost(self, status: int) -> str | None:
        """A background response's usage is not lost: it has none yet (the router never
        sees its generation, which ``kvhint_router_responses_background_total`` counts)."""
        if self.background:
            return None
        return ResponseObservation.usage_lost(self, status)

    def _observe_response(self, response: _Response) -> None:
        status = response.status
        if status in RUNNING_STATUSES:
            self.background = True
            return
        if status == "failed":
            code = response.error.code if response.error is not None else None
            self.error_status = _FAILED_CODES.get(code, 500) if isinstance(code, str) else 500
        elif status == "cancelled":
            self.error_status = 499  # cancelled by its client (POST .../cancel)
        self.choices = 1
        # Escaped as a chat answer's are (response_scan.py): shown to operators.
        calls = [escaped(item.name) for item in response.output
                 if item.type in _TOOL_CALL_ITEMS and item.name]
        self.tool_names.extend(calls)
        if status == "incomplete":
            details = response.incomplete_details
            reason = details.reason if details is not None else None
            self.finish_reason = "content_filter" if reason == "content_filter" else "length"
        elif status == "completed":
            self.finish_reason = "tool_calls" if calls else "stop"
        usage = response.usage
        if usage is not None:
            self.prompt_tokens = usage.input_tokens
            self.completion_tokens = usage.output_tokens
            details = usage.input_tokens_details
            self.cached_tokens = (details.cached_tokens or 0) if details is not None else 0
            output = usage.output_tokens_details
            self.reasoning_tokens = (output.reasoning_tokens or 0) if output is not None else 0
            if self.on_usage is not None:
                self.on_usage(self)


class ResponsesRelay:
    """Relays a Responses event stream event by event while filling ``observation``."""

    def __init__(self, observation: ResponsesObservation) -> None:
        self.observation = observation
        # The bytes after the last whole event (:func:`whole_events`): a large event (the
        # terminal one carries the whole response) cut into many reads costs its size.
        self._pending = bytearray()
        # Bytes searched for an event's end so far: at most the stream's size plus one
        # per read (its tests hold the relay to that, rather than to a time).
        self.searched = 0
        # The stream's line ending (response_scan.py ``line_ending``; None: none yet).
        self._nl: bytes | None = None
        self._end = b"\n\n"  # two of them: an event's end
        # A terminal event has been relayed: a client that leaves now has its answer.
        self.finished = False
        # Set by a caller that ends a stream without a terminal event itself
        # (relay_end.py ``RelayEnd.ended``): an unfinished event the worker's stream ended in
        # is then held back (``cut_tail`` its size), not passed on before the router's
        # own terminal event, which the client's SSE parser would read as its tail.
        self.hold_cut_tail = False
        self.cut_tail = 0
        # The bound on an unfinished event's bytes (response_scan.py ``check_pending``),
        # set by the caller (relay_end.py ``RelayEnd``); None: unbounded.
        self.max_event_bytes: int | None = None
        self.worker_id = ""

    async def relay(self, chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        async for chunk in chunks:
            out = self.feed(chunk)
            if out:
                yield out
            check_pending(self._pending, self.max_event_bytes, self.worker_id)
        rest, self._pending = bytes(self._pending), bytearray()
        if rest and self.hold_cut_tail and not self.finished:
            self.cut_tail = len(rest)  # dropped, said in the router's terminal event
        elif rest:  # a stream that ended mid-event: passed through as it is
            yield rest

    def feed(self, chunk: bytes) -> bytes:
        """The whole events of ``pending + chunk``, observed, to send now."""
        nl = self._nl
        if nl is None:
            complete, searched, nl = cut_events(self._pending, chunk, None)
            if nl is not None:
                self._nl, self._end = nl, nl + nl
        else:
            complete, searched = whole_events(self._pending, chunk, self._end)
        self.searched += searched
        if complete:
            assert nl is not None  # known once an event has ended
            for event in complete.split(self._end)[:-1]:
                self._inspect(event, nl)
        return complete

    def release_held(self) -> bytes:
        """Nothing is ever held back (the chat relay's interface)."""
        return b""

    def failure_event(self, message: str, status: int) -> bytes:
        """The event that ends a stream the router cut short (its worker broke or went
        silent mid-answer): ``response.failed`` with the response ``response.created``
        announced, status ``failed`` and the error, the terminal event Responses clients
        wait for; an ``error`` event where none was announced yet."""
        sequence = self.observation.events
        error = {"code": "server_error", "message": f"{message} (HTTP {status})"}
        snapshot = self.observation.snapshot
        if snapshot is not None:
            kind = "response.failed"
            body: dict[str, Any] = {"type": kind, "sequence_number": sequence,
                                    "response": {**snapshot, "status": "failed", "error": error}}
        else:
            kind = "error"
            body = {"type": kind, "sequence_number": sequence, "param": None, **error}
        return b"event: " + kind.encode() + b"\ndata: " + _encode(body) + b"\n\n"

    def cancelled_event(self, answer: dict[str, Any] | None) -> bytes:
        """The event that ends a stream whose response was cancelled, its worker sending
        none (responses_cancels.py): ``response.failed`` with the response, status
        ``cancelled``, as the cancel answered it (else as ``response.created`` announced
        it); an ``error`` event where neither is known. OpenAI defines no
        ``response.cancelled`` event (openai 3.63 types/responses: the terminal ones are
        ``response.completed``, ``.failed``, ``.incomplete``), and the SDK's stream
        refuses a ``response.completed`` whose output lacks an item still streaming
        ("Cannot complete response with unfinished output items"), where
        ``response.failed`` keeps the output streamed so far."""
        self.finished = True
        if self.observation.error_status is None:
            self.observation.error_status = 499  # cancelled by its client
        sequence = self.observation.events
        response = answer if isinstance(answer, dict) and "id" in answer else (
            self.observation.snapshot)
        if response is not None:
            kind = "response.failed"
            body: dict[str, Any] = {"type": kind, "sequence_number": sequence,
                                    "response": {**response, "status": "cancelled"}}
        else:
            kind = "error"
            body = {"type": kind, "sequence_number": sequence, "param": None,
                    "code": "cancelled", "message": "the response was cancelled"}
        return b"event: " + kind.encode() + b"\ndata: " + _encode(body) + b"\n\n"

    def _inspect(self, event: bytes, nl: bytes) -> None:
        kind, data = _split_event(event, nl)
        if data is None:
            return
        self.observation.events += 1
        if kind not in _READ_EVENTS:
            return
        self.observation.observe_event(kind, data)
        if kind in TERMINAL_EVENTS:
            self.finished = True


def relay_for(observation: ResponseObservation, strip_usage_chunk: bool
              ) -> SseRelay | ResponsesRelay:
    """The relay for a stream read by ``observation``: a Responses one's, or chat's."""
    if isinstance(observation, ResponsesObservation):
        return ResponsesRelay(observation)
    return SseRelay(observation, strip_usage_chunk)


def _split_event(event: bytes, nl: bytes) -> tuple[str | None, bytes | None]:
    """An SSE event's type (its ``event:`` line) and its data (None: a comment or an
    empty event), its lines ending in ``nl``. vLLM writes one ``event:`` and one
    ``data:`` line per event."""
    kind: str | None = None
    data: bytes | None = None
    for line in event.split(nl):
        if line.startswith(b"event:"):
            kind = line[6:].strip().decode("utf-8", "replace")
        elif line.startswith(b"data:"):
            data = line[5:].strip()
    return kind, data


def _snapshot_of(payload: bytes) -> dict[str, Any] | None:
    event = _snapshot_decoder.decode(payload)
    response = event.get("response")
    return response if isinstance(response, dict) else None


def _code_status(code: Any) -> int:
    """An ``error`` event's code as a status: an HTTP status it names, else 500."""
    if isinstance(code, str) and code.isdigit():
        code = int(code)
    if type(code) is int and 400 <= code < 600:
        return code
    return _FAILED_CODES.get(code, 500) if isinstance(code, str) else 500
