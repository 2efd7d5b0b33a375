"""Deadlines for slow clients on the router's HTTP server (uvicorn's h11 protocol).

uvicorn bounds the time between requests on a keep-alive connection
(``timeout_keep_alive``), but not the time a request takes to arrive: a client that sends
part of its headers and then nothing (slowloris) held its connection, and a
``http_max_concurrency`` slot, forever. :func:`deadline_protocol` returns uvicorn's
``H11Protocol`` with two deadlines added, by watching h11's view of the client
(``conn.their_state``) after uvicorn has handled each read and each response:

- headers: a connection that opened, or a keep-alive connection where a request's first
  bytes arrived, must deliver the complete request line and headers within
  ``header_timeout_s``, else it is closed (no answer: there is no request to answer);
- body left over: a request answered before its body was read (an auth error) has the
  rest read and discarded by uvicorn; that must end within ``body_timeout_s`` too.

The body a handler reads is bounded by the handler (``inbound.read_body_within``, which
answers 408). Each close is reported through ``on_timeout(phase)``. A request h11 cannot
parse (its framing, request line or headers; headers over ``max_header_bytes``), which
uvicorn answers with a plain 400 and a close before any app sees it, is reported through
``on_malformed()``: before, such refusals were counted nowhere.

Only uvicorn's protocol methods (``connection_made``, ``connection_lost``,
``data_received``, ``on_response_complete``), its ``conn``/``transport``/``loop``
attributes and h11's ``their_state``/``our_state``/``trailing_data`` are relied on; where
they are missing, :func:`deadline_protocol` returns None and the caller serves plain h11,
after an error in the log.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger("kvhint.router")

HEADERS = "headers"
BODY = "body"
_HOOKS = ("connection_made", "connection_lost", "data_received", "on_response_complete")


def deadline_protocol(header_timeout_s: float, body_timeout_s: float,
                      on_timeout: Callable[[str], None],
                      on_malformed: Callable[[], None] | None = None
                      ) -> type[asyncio.Protocol] | None:
    """uvicorn's ``H11Protocol`` with the deadlines (pass it as ``uvicorn.Config(http=)``),
    or None when this uvicorn does not have the hooks it needs (logged as an error)."""
    try:
        import h11
        from uvicorn.protocols.http.h11_impl import H11Protocol
    except ImportError as exc:
        log.error("slow-client deadlines OFF: uvicorn's h11 protocol is not importable (%s)",
                  exc)
        return None
    missing = [name for name in _HOOKS if not callable(getattr(H11Protocol, name, None))]
    if not hasattr(h11.Connection, "trailing_data"):
        missing.append("h11.Connection.trailing_data")
    if missing:
        log.error("slow-client deadlines OFF: this uvicorn's H11Protocol lacks %s", missing)
        return None

    class DeadlineH11Protocol(H11Protocol):  # type: ignore[misc, valid-type]
        _deadline: asyncio.TimerHandle | None = None
        _phase: str | None = None

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            if not isinstance(getattr(self, "conn", None), h11.Connection):
                log.error("slow-client deadlines OFF on this connection: uvicorn's "
                          "H11Protocol has no h11 'conn'")
                return
            self._arm(HEADERS)  # from the first byte on: nothing sent is no better

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            self._follow()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._follow()

        def send_400_response(self, msg: str) -> None:
            # uvicorn's answer to h11's RemoteProtocolError (module doc).
            if on_malformed is not None:
                on_malformed()
            super().send_400_response(msg)

        def _follow(self) -> None:
            """(Re)arm or disarm after uvicorn handled what came in or went out."""
            conn = getattr(self, "conn", None)
            if not isinstance(conn, h11.Connection) or self.transport.is_closing():
                self._disarm()
                return
            theirs = conn.their_state
            if theirs is h11.IDLE:
                # Waiting for a request's headers. Bytes of it are buffered: its clock
                # runs (it started with the connection, or at its first byte). Nothing
                # buffered after a response: an idle keep-alive connection, which
                # uvicorn's keep-alive timer bounds; but not after discarding the rest
                # of a body (uvicorn arms no timer there): the header deadline does.
                if conn.trailing_data[0] or self._phase == BODY:
                    if self._phase != HEADERS:
                        self._arm(HEADERS)
                elif self._phase != HEADERS:
                    self._disarm()
            elif theirs is h11.SEND_BODY and conn.our_state in (h11.DONE, h11.MUST_CLOSE):
                if self._phase != BODY:  # answered; the rest of the body is discarded
                    self._arm(BODY)
            else:
                # Headers in, the handler reading or answering (it bounds the body it
                # reads), or the connection ending.
                self._disarm()

        def _arm(self, phase: str) -> None:
            self._disarm()
            timeout = header_timeout_s if phase == HEADERS else body_timeout_s
            self._phase = phase
            self._deadline = self.loop.call_later(timeout, self._expired, phase)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
            self._deadline = None
            self._phase = None

        def _expired(self, phase: str) -> None:
            self._deadline = None
            self._phase = None
            if self.transport.is_closing():
                return
            log.info("closing a connection from %s: its request's %s did not arrive in time",
                     self.client, phase)
            on_timeout(phase)
            self.transport.close()  # connection_lost tells h11 and any request cycle

    return DeadlineH11Protocol
