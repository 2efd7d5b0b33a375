"""What the router learns from a worker's response, without changing a byte it forwards
(except the usage-only chunk it asked for itself).

:class:`SseRelay` splits a server-sent-event byte stream into whole events, hands each
to the observer, and yields what the client gets, one event as soon as it is complete:
no buffering beyond one partial event, itself bounded (:class:`EventTooLarge`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import msgspec

from kvhint.router.policy import FinishReason
from kvhint.router.safe_text import escaped
from kvhint.router.service.upstream import UpstreamBroken


class _Function(msgspec.Struct):
    name: str | None = None


class _ToolCall(msgspec.Struct):
    function: _Function | None = None


class _Message(msgspec.Struct):
    tool_calls: list[_ToolCall] | None = None


class _Choice(msgspec.Struct):
    index: int = 0
    finish_reason: str | None = None
    message: _Message | None = None
    delta: _Message | None = None


class _Details(msgspec.Struct):
    cached_tokens: int | None = None


class _Usage(msgspec.Struct):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    prompt_tokens_details: _Details | None = None


class _Body(msgspec.Struct):
    choices: list[_Choice] = []
    usage: _Usage | None = None
    # vLLM's error event in a stream that had started (status 200): no usage follows.
    error: object = None
    system_fingerprint: str | None = None


class EventTooLarge(UpstreamBroken):
    """A relay's unfinished event grew past its bound (``stream_event_max_bytes``): the
    worker (or a proxy before it) sent that many bytes without an event's end. Its
    stream is failed as a broken one (relay_end.py ``RelayEnd.broken``: 502, the
    router's own terminal event); before, the relay held the bytes for as long as they
    came, growing the router's memory without bound."""

    def __init__(self, worker_id: str, size: int, limit: int) -> None:
        super().__init__(f"worker {worker_id}: sent {size} bytes of one event without "
                         f"its end, past {limit} (stream_event_max_bytes)")


def check_pending(pending: bytearray, limit: int | None, worker_id: str) -> None:
    """Raises :class:`EventTooLarge` where a relay's unfinished event (``pending``) is
    over ``limit`` bytes (None: no bound), emptied first (its bytes are dropped: the
    stream ends with the router's error event, never with that event's head)."""
    if limit is not None and len(pending) > limit:
        size = len(pending)
        pending.clear()
        raise EventTooLarge(worker_id, size, limit)


_body_decoder = msgspec.json.Decoder(_Body)
_event_decoder = msgspec.json.Decoder(dict)


@dataclass(slots=True)
class ResponseObservation:
    """Accumulated over one response (streamed or not)."""

    finish_reason: str | None = None
    tool_names: list[str] = field(default_factory=list)
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    malformed_chunks: int = 0
    # The worker answered with an error (an ``error`` object) instead of a completion:
    # the status it names (:func:`_error_status`), None while it has not.
    error_status: int | None = None
    # Completions in the response (``n`` > 1: several; highest choice index seen + 1).
    # Every choice of a stream ends in an event with its finish_reason, which is read.
    choices: int = 0
    # Prompts the request batched (a /v1/completions list: sampling.batched_prompts):
    # usage sums their tokens, a session continues at most one of them.
    prompts: int = 1

    def observe_json(self, payload: bytes) -> bool:
        """Take one response body or chunk; True when it is a usage-only chunk."""
        body = self.observe(payload)
        return body is not None and body.usage is not None and not body.choices

    def observe(self, payload: bytes) -> _Body | None:
        """Take one response body or chunk; what was read of it (None: unreadable)."""
        try:
            body = _body_decoder.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError):
            self.malformed_chunks += 1
            return None
        if body.error is not None and self.error_status is None:
            self.error_status = _error_status(body.error)
        for choice in body.choices:
            self.choices = max(self.choices, choice.index + 1)
            if choice.finish_reason:
                self.finish_reason = choice.finish_reason
            message = choice.message or choice.delta
            if message is not None and message.tool_calls:
                for call in message.tool_calls:
                    if call.function is not None and call.function.name:
                        # The model's text, which a tenant's prompt steers: shown to
                        # operators (admin, dashboard, learnt gaps) with controls and
                        # bidi/zero-width characters escaped (safe_text.py).
                        self.tool_names.append(escaped(call.function.name))
        if body.usage is not None:
            self.prompt_tokens = body.usage.prompt_tokens
            self.completion_tokens = body.usage.completion_tokens
            details = body.usage.prompt_tokens_details
            self.cached_tokens = (details.cached_tokens or 0) if details is not None else 0
        return body

    def turn_status(self, status: int) -> int:
        """The turn's outcome as a status: ``status``, except for a 2xx that carried the
        worker's error, which failed with that error's status. vLLM reports a failure
        once a stream has begun (headers sent with 200) as an error event, ``data:
        {"error": {"message", "type", "param", "code"}}`` then ``data: [DONE]``, the
        stream then ending cleanly (vllm/entrypoints/openai/chat_completion/serving.py,
        completion/serving.py: ``create_streaming_error_response``), so the status
        alone reads it as a success."""
        if 200 <= status < 300 and self.error_status is not None:
            return self.error_status
        return status

    @property
    def completion_tokens_per_choice(self) -> int:
        """The tokens of one completion: usage counts every choice's (``n`` > 1), but a
        session continues at most one of them, so its next prompt, what the planner
        protects and what the trace replays grow by one completion, not by ``n``. The
        mean, rounded up (usage does not say each choice's own)."""
        total = self.completion_tokens or 0
        return -(-total // self.choices) if self.choices > 1 else total

    @property
    def prompt_tokens_per_prompt(self) -> int | None:
        """The tokens of one prompt: a batched request's usage sums every prompt's, but a
        session continues at most one of them (as :attr:`completion_tokens_per_choice`
        does one completion). The mean, rounded up; None without a usage."""
        total = self.prompt_tokens
        if total is None or self.prompts <= 1:
            return total
        return -(-total // self.prompts)

    def usage_lost(self, status: int) -> str | None:
        """What of a worker's successful response (``status``) the router lost, as a
        drop's name: ``response_unparsable``, a body or event it could not read (what
        it said, its usage perhaps, is not counted nor planned from);
        ``response_usage_missing``, no usage in a response read whole (streams always
        ask for it: inbound.py), so its tokens are not counted nor its session's turn
        planned. None for an error status or error event, which has no usage."""
        if not 200 <= status < 300:
            return None
        if self.malformed_chunks:
            return "response_unparsable"
        if self.prompt_tokens is None and self.error_status is None:
            return "response_usage_missing"
        return None

    def finish(self) -> FinishReason:
        """How the response ended, for the planner: a response that called tools ends in
        tool calls even where the server said ``stop`` (a named ``tool_choice``)."""
        reason = FinishReason.parse(self.finish_reason)
        if self.tool_names and reason in (FinishReason.STOP, FinishReason.OTHER):
            return FinishReason.TOOL_CALLS
        return reason


class SseRelay:
    """Relays SSE events from ``chunks`` while filling ``observation``.

    Where the router asked for the usage chunk itself (``strip_usage_chunk``), vLLM puts
    ``system_fingerprint`` on that chunk instead of on each choice's last (finish) chunk,
    where a client that asked for no usage gets it. So each finish chunk is held until
    the usage chunk comes (vLLM sends it right after the last finish chunk), then sent
    with the fingerprint written in, as vLLM sends it without usage. Held ones go out
    unchanged before any other event: another choice's (``n`` > 1: a choice that ends
    while others still stream is not held back for them, and goes without it), an
    error, ``[DONE]``; at the stream's end; and (:meth:`release_held`) before the
    router's own error event.

    A worker that puts usage on every chunk unasked (vLLM's
    ``--enable-force-include-usage``) gives a client that asked for none its usage chunk
    too, with the fingerprint on it: seen on its first chunk, the stream then passes
    unchanged, usage chunk included, as from the worker directly."""

    def __init__(self, observation: ResponseObservation, strip_usage_chunk: bool) -> None:
        self.observation = observation
        self.strip_usage_chunk = strip_usage_chunk
        # The bytes after the last whole event (:func:`whole_events`).
        self._pending = bytearray()
        # Bytes searched for an event's end so far: at most the stream's size plus one
        # per read (its tests hold the relay to that, rather than to a time).
        self.searched = 0
        # The stream's line ending (:func:`line_ending`; None: no line has ended yet).
        self._nl: bytes | None = None
        self._end: bytes | None = None  # two of them: an event's end
        # Finish events waiting for the usage chunk's fingerprint (whole events).
        self._held: list[bytes] = []
        # The stream's terminal ``data: [DONE]`` event, or the worker's error event,
        # has been relayed: the client has the whole answer (an error is one), and one
        # that leaves now has not left early.
        self.finished = False
        # Set by a caller that ends a stream without ``[DONE]`` itself (relay_end.py
        # ``RelayEnd.ended``): an unfinished event the worker's stream ended in is then
        # held back (``cut_tail`` its size), not passed on before the router's own error
        # event, which the client's SSE parser would read as that event's tail.
        self.hold_cut_tail = False
        self.cut_tail = 0
        # The bound on an unfinished event's bytes (:func:`check_pending`), set by the
        # caller (relay_end.py ``RelayEnd``) with the worker it names; None: unbounded.
        self.max_event_bytes: int | None = None
        self.worker_id = ""

    async def relay(self, chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        async for chunk in chunks:
            out = self.feed(chunk)
            if out:
                yield out
            check_pending(self._pending, self.max_event_bytes, self.worker_id)
        # A stream that ended mid-event: pass the rest through as it is (held back where
        # the caller ends the stream itself, ``hold_cut_tail``).
        rest, self._pending = bytes(self._pending), bytearray()
        if rest and self.hold_cut_tail and not self.finished:
            self.cut_tail, rest = len(rest), b""
        out = self.release_held() + rest
        if out:
            yield out

    def feed(self, chunk: bytes) -> bytes:
        """Whole events of ``pending + chunk`` to send now (may be empty)."""
        end = self._end
        if end is None:
            complete, searched, nl = cut_events(self._pending, chunk, None)
            if nl is not None:
                self._nl = nl
                end = self._end = _ENDS[nl]
        else:
            complete, searched = whole_events(self._pending, chunk, end)
        self.searched += searched
        if not complete:
            return b""
        assert end is not None  # known once an event has ended
        if complete.count(end) == 1:
            return self._inspect(complete)
        return b"".join([self._inspect(event + end) for event in complete.split(end)[:-1]])

    def release_held(self, fingerprint: str | None = None) -> bytes:
        """The held finish events, with ``fingerprint`` written in where given."""
        held, self._held = self._held, []
        if fingerprint is None:
            return b"".join(held)
        end = _ENDS[self._nl or b"\n"]
        return b"".join([_with_fingerprint(event, fingerprint, end) for event in held])

    def _inspect(self, event: bytes) -> bytes:
        """Observe one whole event; what of it (and of the held ones) to send now."""
        if (b'"finish_reason":null' in event and b"tool_calls" not in event
                and b'"usage"' not in event and b'"error"' not in event):
            # A plain content delta (nearly every event): nothing to learn from it, and
            # skipping the JSON parse keeps the router's CPU per token small.
            return event
        start = event.find(b"data:")
        if start < 0:
            return self.release_held() + event
        payload = event[start + 5:].strip()
        if not payload.startswith(b"{"):
            if payload == b"[DONE]":
                self.finished = True
            return self.release_held() + event
        body = self.observation.observe(payload)
        if body is None:
            return self.release_held() + event
        if body.error is not None:
            # The worker's error ends its answer (vLLM sends only [DONE] after it), and
            # the OpenAI SDKs raise at it and close the stream, often before that [DONE]
            # arrives: a client that leaves now has its answer, the error.
            self.finished = True
            return self.release_held() + event
        if not self.strip_usage_chunk:
            return self.release_held() + event
        if body.usage is not None and not body.choices:  # the chunk the router asked for
            return self.release_held(body.system_fingerprint)
        if body.usage is not None:
            # Usage on a choice's chunk: the router dropped continuous_usage_stats from a
            # request that asked for no usage (inbound.py), so the worker puts usage on
            # every chunk unasked (vLLM's --enable-force-include-usage, which turns on
            # continuous usage too, from the first chunk on). A client asking it directly
            # gets the usage chunk as well: from here on it passes, as the worker sends it.
            self.strip_usage_chunk = False
            return self.release_held() + event
        if not body.choices:
            return self.release_held() + event
        if body.system_fingerprint is None and any(c.finish_reason for c in body.choices):
            self._held.append(event)
            return b""
        # Another choice's event (n > 1) while one is held: the held one goes first,
        # without the fingerprint. Holding it until the slowest choice ends would delay
        # its last tokens by as long: latency a client sees, for a field of metadata.
        return self.release_held() + event


# An event's end in each line ending (:func:`whole_events`).
_ENDS = {b"\n": b"\n\n", b"\r\n": b"\r\n\r\n", b"\r": b"\r\r"}


def line_ending(pending: bytes | bytearray, chunk: bytes) -> bytes | None:
    """The line ending of a stream whose bytes so far are ``pending + chunk``, as its
    first line ends (the SSE spec allows ``\\r\\n``, ``\\n`` and ``\\r``; a proxy between
    the router and its worker may rewrite vLLM's ``\\n``); None while undecided (no line
    has ended, or one ended in a ``\\r`` whose next byte has not come). ``pending`` holds
    no line ending then, but perhaps a last ``\\r``: only ``chunk`` is searched. One per
    stream: a stream mixing them (no server or proxy writes one) is cut at its first
    one's, its other events passed through at its end."""
    if pending and pending[-1] == 0x0D:
        return None if not chunk else b"\r\n" if chunk[0] == 0x0A else b"\r"
    cr = chunk.find(b"\r")
    lf = chunk.find(b"\n", 0, None if cr < 0 else cr)
    if lf >= 0:
        return b"\n"
    if cr < 0 or cr + 1 == len(chunk):
        return None
    return b"\r\n" if chunk[cr + 1] == 0x0A else b"\r"


def cut_events(pending: bytearray, chunk: bytes, nl: bytes | None
               ) -> tuple[bytes, int, bytes | None]:
    """:func:`whole_events` in the stream's line ending ``nl``, read from its first line
    (:func:`line_ending`) while it is None; returned with it."""
    if nl is None:
        nl = line_ending(pending, chunk)
        if nl is None:
            pending += chunk
            return b"", len(chunk), None
    complete, searched = whole_events(pending, chunk, _ENDS[nl])
    return complete, searched, nl


def whole_events(pending: bytearray, chunk: bytes, ends: bytes = b"\n\n"
                 ) -> tuple[bytes, int]:
    """The whole events of ``pending + chunk`` (empty: none yet), ``pending`` left holding
    the bytes after them (appended to in place); and how many bytes were searched for an
    event's end. ``pending`` holds no end, so only ``chunk`` is searched, with the byte
    before it (an end may straddle two reads): a large event cut into many reads costs its
    size, not its size squared (copying and searching all the waiting bytes at every
    read, an 8 MB event in 4 KB reads held the event loop for seconds). A read with
    nothing waiting (the usual one: whole events) is searched and cut where it lies.

    An event ends at the first ``\\n\\n`` after its start, as the relays split them
    (``bytes.split``): in a run of three or more newlines, at every second one from the
    run's start (:func:`_last_end`). Cut at the run's end instead, the relays' split left
    a lone ``\\n`` after the last event, which the chat relay dropped, and only where the
    run came in one read. Cut so, the events do not depend on how the stream was read:
    ``pending`` always starts an event and holds no end.

    ``ends``: two of the stream's line ending (:func:`line_ending`), ``\\n\\n`` above
    (``\\r\\n\\r\\n``, ``\\r\\r``), the bytes passed on as they came."""
    if not pending:
        end = _last_end(chunk, chunk.rfind(ends), ends)
        if end < 0:  # none
            pending += chunk
            return b"", len(chunk)
        if end < len(chunk):
            pending += chunk[end:]
            return chunk[:end], len(chunk)
        return chunk, len(chunk)
    start = max(len(pending) - len(ends) + 1, 0)
    pending += chunk
    end = _last_end(pending, pending.rfind(ends, start), ends)
    if end < 0:
        return b"", len(pending) - start
    complete = bytes(pending[:end])
    del pending[:end]
    return complete, len(complete) + len(pending) - start


def _last_end(data: bytes | bytearray, found: int, ends: bytes) -> int:
    """Where the last event of ``data`` (which starts one) ends, given the last ``\\n\\n``
    in it (``found``; -1: none, returned as it is). That one ends a run of newlines (a
    later newline would be a later ``\\n\\n``); events end every second newline from the
    run's start, so an odd run leaves its last newline to the next event. The run is
    walked back only where it is longer than two (no worker sends one): it lies within
    the bytes searched, as ``data`` holds no end before them. In other line endings
    (``ends``, two of them: :func:`whole_events`), a run of them."""
    if found < 0:
        return found
    if found == 0 or data[found - 1] != ends[-1]:  # a run of two: every worker's
        return found + len(ends)
    size = len(ends) // 2
    nl = ends[:size]
    if found < size or data[found - size:found] != nl:
        return found + 2 * size
    run_start = found - size
    while run_start >= size and data[run_start - size:run_start] == nl:
        run_start -= size
    return found + 2 * size - ((found + 2 * size - run_start) // size) % 2 * size


def _error_status(error: object) -> int:
    """The status a worker's error object names: vLLM's ``code`` (the HTTP status it
    would have answered with: 400 for a request it could not take, 500 for a failed
    generation, 503 for a retryable one); 500 where it names no 4xx or 5xx."""
    code = error.get("code") if isinstance(error, dict) else None
    return code if type(code) is int and 400 <= code < 600 else 500


def _with_fingerprint(event: bytes, fingerprint: str, end: bytes) -> bytes:
    """``event`` (``data: {...}`` and its blank line) with ``system_fingerprint`` set,
    what comes before its ``data:`` line kept (a comment, a newline left over from a run
    of blank lines); the event as it is where its JSON cannot be read (it was read once
    already)."""
    start = event.find(b"data:")
    try:
        chunk = _event_decoder.decode(event[start + 5:].strip())
    except msgspec.DecodeError:
        return event
    chunk["system_fingerprint"] = fingerprint
    return event[:start] + b"data: " + msgspec.json.encode(chunk) + end
