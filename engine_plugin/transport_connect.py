"""The transport's first connection to NATS: attempts bounded in time, cancelled by stop.

nats-py's ``connect`` with ``max_reconnect_attempts=-1`` (what the transport wants once
connected: reconnect for as long as the engine runs) also retries the first connect
forever, inside the call: with NATS down at the engine's start the plugin's own backoff
and its "unreachable" warning never ran, and ``stop()`` could not interrupt the call (the
transport thread outlived the engine's shutdown). Here each attempt is a task given
:data:`CONNECT_ATTEMPT_S` (nats-py retries within it), cancelled and its client closed
when that time passes or stop fires; between attempts the plugin backs off, interruptibly.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from nats.aio.client import Client
from nats.errors import Error as NatsError
from nats.errors import StaleConnectionError
from nats.errors import TimeoutError as NatsTimeoutError

from kvhint.engine_plugin.config import LOGGER_NAME
from kvhint.schemas.nats_address import NatsConnection, loggable_nats_url

logger = logging.getLogger(LOGGER_NAME)

# Long enough for two of the transport's 2 s connect timeouts: a reachable server
# answers within one.
CONNECT_ATTEMPT_S = 5.0
FIRST_BACKOFF_S = 0.25
MAX_BACKOFF_S = 5.0
# How often a connect attempt nats-py has not let end is cancelled again (_cancelled).
CANCEL_RETRY_S = 0.05


async def connect_until_stopped(stop: asyncio.Event, connection: NatsConnection,
                                options: dict[str, Any]) -> Client | None:
    """A connected client, or None once ``stop`` is set. ``connection``: the servers and
    credentials (:func:`kvhint.schemas.nats_address.nats_connection`); ``options``:
    nats-py's other connect keyword arguments."""
    delay = FIRST_BACKOFF_S
    while not stop.is_set():
        nc = Client()
        error = await _attempt(nc, stop, connection, options)
        if error is None:
            return nc
        last_error = nc.last_error  # read before the close, which may change it
        await _close_quietly(nc)
        if stop.is_set():
            break
        if delay == FIRST_BACKOFF_S:
            logger.warning("kvhint: NATS %s %s; retrying in the background, the engine "
                           "runs meanwhile", loggable_nats_url(",".join(connection.servers)),
                           _failure(error, last_error))
        await wait_or_stop(stop, delay)
        delay = min(delay * 2, MAX_BACKOFF_S)
    return None


async def _attempt(nc: Client, stop: asyncio.Event, connection: NatsConnection,
                   options: dict[str, Any]) -> BaseException | str | None:
    """None when ``nc`` connected, else why not."""
    # The credentials go as arguments, the servers without them: nats-py does not
    # percent-decode a URL's user info (schemas/nats_address.py).
    attempt = asyncio.ensure_future(nc.connect(
        servers=list(connection.servers), user=connection.user,
        password=connection.password, token=connection.token, **options))
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({attempt, stopped}, timeout=CONNECT_ATTEMPT_S,
                           return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
    if not attempt.done():
        await _cancelled(attempt)
        return "stopped" if stop.is_set() else f"no connection within {CONNECT_ATTEMPT_S:g}s"
    error = attempt.exception()
    if error is not None and not isinstance(error, (NatsError, OSError, asyncio.TimeoutError)):
        raise error  # not a connection failure: a bug, for the thread's own handler
    return error


def _failure(error: BaseException | str, last_error: BaseException | None) -> str:
    """What the first failed attempt's warning says. nats-py retries within an attempt
    and gives each failure to ``error_cb`` only, so an attempt that ran out of time
    says nothing of why: its client's ``last_error`` does. A server that answered with
    an error (an authorization violation: a wrong user or password) refused the
    connection; before, a wrong password read as "unreachable (no connection within
    5s)", after an error line naming the violation."""
    cause = error if isinstance(error, BaseException) else last_error
    if cause is None:
        return f"unreachable ({error})"
    answered = isinstance(cause, NatsError) and not isinstance(
        cause, (NatsTimeoutError, StaleConnectionError))
    text = f"{'refused the connection' if answered else 'unreachable'}: {cause}"
    return f"{text} ({error})" if isinstance(error, str) else text


async def _cancelled(attempt: asyncio.Future[Any]) -> None:
    """Cancel ``attempt`` until it is done. nats-py's connect can swallow one
    cancellation (its ``_close`` between two tries catches CancelledError while it waits
    for its reconnection task) and go on trying; awaited once, such an attempt kept the
    transport's thread alive past ``stop()`` (seen in CI: stop took its whole 5 s join)."""
    while not attempt.done():
        attempt.cancel()
        await asyncio.wait({attempt}, timeout=CANCEL_RETRY_S)
    if not attempt.cancelled():
        attempt.exception()  # retrieved: a late failure is no "never retrieved" warning


async def _close_quietly(nc: Client) -> None:
    try:
        await nc.close()
    except (NatsError, OSError, asyncio.TimeoutError) as exc:  # a client never connected
        logger.debug("kvhint: closing an unconnected NATS client: %s", exc)


async def wait_or_stop(stop: asyncio.Event, timeout_s: float) -> None:
    """Sleep ``timeout_s``, or less when ``stop`` is set meanwhile."""
    try:
        await asyncio.wait_for(stop.wait(), timeout=timeout_s)
    except asyncio.TimeoutError:
        pass
