"""How a relayed SSE stream ends: the rules the forwarder's relay of a POST's stream
(forwarding.py ``Forwarder._relay``) and a stored response's streamed GET
(responses_get_stream.py ``streamed_get``) share, in one place.

- A terminal event relayed (``relay.finished``: ``[DONE]``, a Responses stream's
  ``response.completed``/``.failed``/``.incomplete``/``error``): the client has its whole
  answer; nothing goes after it, whatever the worker's connection does next. A stream
  watched for its cancel (a background response's: responses_cancels.py) stops being read
  there, since vLLM may leave it open, silent, for good.
- The client gone (the router closed the worker's stream for it, or the stream was closed
  at a yield): status 499, nothing sent. Where the caller says so
  (``served_once_finished``: a POST's stream), a client that leaves once it has its
  terminal event was served, its status kept.
- The watch fired (the router closed the worker's stream: a cancel's grace passed, or a
  background stream was silent past ``responses.background_idle_s``): the relay's own
  terminal event (a cancel's: responses_cancels.py ``cancel_end``; silence is the
  worker's failure, 504, as below, counted in ``responses_router_ends``).
- The worker closed a Responses stream cleanly without a terminal event: 502, with
  ``response.failed`` (counted in ``responses_router_ends``); an unfinished last event is held back
  (``ResponsesRelay.hold_cut_tail``). A chat or completions stream that ends so, without
  ``data: [DONE]`` (vLLM always sends it), likewise: 502, any finish events held for a
  fingerprint, then an OpenAI error event (as a broken stream's), its unfinished last
  event held back (``SseRelay.hold_cut_tail``); both counted in ``broken_streams``.
  Only for an event stream (``text/event-stream``): another answer to a stream request
  (a proxy's HTML error page, served as plain text) is passed on as it came.
  Before, a chat stream cut so was passed on as it was, and the client's SDK read the
  answer as complete.
- The worker's stream broke or fell silent for ``request_timeout_s`` mid-answer: 502 or
  504, counted in ``broken_streams``, and a terminal error the client's SDK reads
  (``response.failed`` for a Responses stream, an OpenAI error event for chat, after any
  finish events held for a fingerprint).
- The router stopping with the stream still open past ``http_shutdown_grace_s`` (uvicorn
  cancels the request): 503, its own terminal error event, and the response's body ended
  cleanly (:meth:`RelayEnd.stopping`). Before, the connection was closed mid-body: the
  client got no error it could read, and the request counted as a client that left (499).
- The worker sent more than ``stream_event_max_bytes`` of one event without its end
  (the relay's :class:`EventTooLarge`, raised as a break): a broken stream, 502, its
  unfinished event dropped (a Responses stream's also counted in
  ``responses_router_ends``, ``event_too_large``). Before, the relay held the bytes for
  as long as they came.

The caller relays the chunks, yields what these methods return, and accounts
:attr:`RelayEnd.status` however the stream ended (its ``finally``).
"""

from __future__ import annotations

from kvhint.router.service.inbound import openai_error
from kvhint.router.service.metrics import RouterMetrics
from kvhint.router.service.response_scan import EventTooLarge, SseRelay
from kvhint.router.service.responses_cancels import CancelWatch, cancel_end
from kvhint.router.service.responses_scan import ResponsesRelay
from kvhint.router.service.upstream import UpstreamBroken, UpstreamResponse


class RelayEnd:
    """One relayed stream's end (module doc). ``status``: what to account it as, the
    worker's own until an end says otherwise."""

    def __init__(self, relay: SseRelay | ResponsesRelay, watch: CancelWatch | None,
                 upstream: UpstreamResponse, metrics: RouterMetrics,
                 served_once_finished: bool, max_event_bytes: int | None = None) -> None:
        self._relay = relay
        self._watch = watch
        self._worker_id = upstream.worker_id
        self._metrics = metrics
        self._served_once_finished = served_once_finished
        self.status = upstream.status
        # The worker failed the stream (``ended`` without a terminal event, ``broken``):
        # its 502/504 stands though the client leaves while the router's own terminal
        # event goes out.
        self._worker_failed = False
        # Only an event stream has a terminal event to miss: another answer to a stream
        # request (a proxy's error page, served as plain text) is passed on as it came.
        self._event_stream = upstream.headers.get("content-type", "").lower().startswith(
            "text/event-stream")
        relay.hold_cut_tail = self._event_stream  # ended here where no terminal event came
        # The bound on an unfinished event's bytes (``stream_event_max_bytes``): past it the
        # relay raises EventTooLarge, ended here as a break (:meth:`broken`).
        relay.max_event_bytes, relay.worker_id = max_event_bytes, upstream.worker_id

    def heard(self) -> None:
        """A chunk came from the worker (a watched stream's idle wait starts again)."""
        if self._watch is not None:
            self._watch.heard()

    def read_no_further(self) -> bool:
        """After a chunk was relayed: whether to stop reading the worker's stream (a
        watched one's terminal event: vLLM may send nothing after an error event, and
        ends a background response's stream at response.completed only; module doc)."""
        return self._watch is not None and self._relay.finished

    def ended(self, client_gone: bool) -> bytes | None:
        """The worker's stream ended (or was left at its terminal event): what goes to the
        client last, if anything."""
        settled, last = self._settled(client_gone)
        if settled or not self._event_stream:
            return last
        # Closed cleanly without its terminal event (vLLM always sends one: ``[DONE]``,
        # a Responses stream's terminal event): a proxy or worker cut it short, and the
        # client's SDK would read the answer as complete (or wait for the end).
        if isinstance(self._relay, ResponsesRelay):
            message, reason = "worker ended the stream without a terminal event", "unterminated"
        else:
            message, reason = "worker ended the stream without data: [DONE]", None
        if self._relay.cut_tail:
            message += f" (its last event unfinished: {self._relay.cut_tail} bytes dropped)"
        return self._worker_failed_end(502, message, reason)

    def broken(self, exc: UpstreamBroken, client_gone: bool) -> bytes | None:
        """The worker's stream broke (or the router closed it): what goes to the client
        last, if anything."""
        settled, last = self._settled(client_gone)
        if settled:
            return last
        oversized = isinstance(exc, EventTooLarge) and isinstance(self._relay, ResponsesRelay)
        return self._worker_failed_end(504 if exc.timed_out else 502,
                                       f"worker failed mid-stream: {exc}",
                                       "event_too_large" if oversized else None)

    def _worker_failed_end(self, status: int, message: str,
                           router_end: str | None = None) -> bytes:
        """The worker failed the stream: accounted as ``status`` (kept though the client
        leaves while this goes out), counted in ``broken_streams`` (and, ``router_end``,
        in ``responses_router_ends``), and ended with the router's own terminal error
        event (:meth:`_error_end`)."""
        self.status, self._worker_failed = status, True
        self._metrics.broken_streams.labels(self._worker_id).inc()
        if router_end is not None:
            self._metrics.responses_router_ends.labels(router_end).inc()
        return self._error_end(message, status)

    def _error_end(self, message: str, status: int) -> bytes:
        """The router's own terminal error event (a worker's failure, the router's stop):
        ``response.failed`` for a Responses stream (an ``error`` event before
        ``response.created``), an OpenAI error event for chat after any finish events
        held for a fingerprint."""
        relay = self._relay
        relay.finished = True  # the client has its terminal event: the error
        if isinstance(relay, ResponsesRelay):  # a typed event Responses clients read
            return relay.failure_event(message, status)
        return relay.release_held() + b"data: " + openai_error(message, status) + b"\n\n"

    def _settled(self, client_gone: bool) -> tuple[bool, bytes | None]:
        """The ends a stream's end and its break share: (True, what goes last) where the
        worker's stream is not to blame; else (False, None)."""
        if client_gone:
            # The router closed the worker's stream for the client gone (a response
            # aiohttp had whole then ends cleanly, yet the client never got its terminal
            # event), or it ended as the client left: the worker did not fail.
            self.left()
            return True, None
        if self._relay.finished:
            # After its terminal event was relayed (the worker's connection may break
            # before the stream's own end): the client has its whole answer, and
            # nothing goes after that event.
            return True, None
        if self._watch is not None and self._watch.fired:
            # Closed by the router: its response was cancelled, or its stream was silent
            # past responses.background_idle_s (responses_cancels.py).
            assert isinstance(self._relay, ResponsesRelay)  # only those are watched
            if self._watch.reason == "background_idle":
                # Accounted as the 504 its event says (REFERENCE.md), counted broken once:
                # before, a POST's 200 was turned into 504 by its error_status and
                # counted broken a second time, and a GET's stayed 200.
                return True, self._worker_failed_end(
                    504, f"worker {self._worker_id} sent no event for "
                    f"{self._watch.idle_s:g} s (responses.background_idle_s): its "
                    "background task may have died (vLLM then leaves the stream open, "
                    "silent, for good); GET the response to see whether it still runs",
                    "background_idle")
            return True, cancel_end(self._relay, self._watch, self._metrics)
        return False, None

    def stopping(self) -> bytes | None:
        """The router is stopping with the stream still open (its HTTP server's grace,
        ``http_shutdown_grace_s``, ran out): what goes to the client last, if anything.
        Accounted as 503 (the router's doing: neither a client that left, 499, nor a
        worker that failed, so not in ``broken_streams``); the client's SDK reads the
        error event and may retry elsewhere. Nothing after a terminal event already
        relayed."""
        if self._relay.finished or not self._event_stream:
            return None
        self.status = 503
        return self._error_end("the router is shutting down: this stream ended before its "
                               "answer was whole; retry the request", 503)

    def left(self) -> None:
        """The client went away before the stream's end (closed at a yield, or the
        worker's stream closed for it): 499, unless served (module doc) or the worker
        failed the stream first (its 502/504 is what happened; before, a client that left
        while the router's error event went out was counted as having left, 499)."""
        if self._worker_failed:
            return
        if not (self._served_once_finished and self._relay.finished):
            self.status = 499
