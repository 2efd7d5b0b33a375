"""The router's one NATS connection: connect (retrying in the background until NATS
answers), the JetStream streams it reads, subscriptions, publish/request, and drain on
shutdown. Lifetimes live here; what messages mean lives in :mod:`.cluster_feed`.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import nats
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import Error as NatsError
from nats.errors import NoServersError, SlowConsumerError
from nats.js import JetStreamContext, api
from nats.js.errors import NotFoundError

from kvhint.schemas import Subjects
from kvhint.schemas.nats_address import loggable_nats_url, nats_connection

log = logging.getLogger(__name__)

Handler = Callable[[Msg], Awaitable[None]]


def outcomes_stream_name(subjects: Subjects) -> str:
    return subjects.events_stream.removesuffix("_EVENTS") + "_OUTCOMES"


def releases_stream_name(subjects: Subjects) -> str:
    return subjects.events_stream.removesuffix("_EVENTS") + "_RELEASES"


@dataclass(frozen=True, slots=True)
class StreamLimits:
    """Bounds of the streams the router creates (JetStream reserves max_bytes on disk)."""

    events_max_bytes: int = 1 << 30
    events_max_age_s: float = 3600.0
    outcomes_max_bytes: int = 256 << 20
    outcomes_max_age_s: float = 24 * 3600.0
    releases_max_bytes: int = 64 << 20
    releases_max_age_s: float = 24 * 3600.0


# JetStream's "stream name already in use with a different configuration": add_stream of
# a name that exists (another router or a worker's plugin created it first, with other
# limits; the same config is accepted as a no-op).
STREAM_NAME_IN_USE = 10058


@dataclass(frozen=True, slots=True)
class StreamCheck:
    """What :meth:`NatsLink.ensure_streams` found for one stream.

    ``applied``: fields the stream had differently and now has as wanted (limits raised);
    ``kept``: fields still different from the wanted config (warned about, never changed
    by the router: see :meth:`NatsLink.ensure_streams`); ``config``: the stream's config
    as it stands afterwards (what replay really keeps, e.g. its ``max_age``)."""

    name: str
    created: bool
    applied: tuple[str, ...]
    kept: tuple[str, ...]
    config: api.StreamConfig


def _limit(value: float | None, unlimited: float) -> float:
    """A stream limit for comparison: JetStream's "no limit" (max_bytes -1, max_age 0)
    is the largest."""
    if value is None or value == unlimited or value < 0:
        return math.inf
    return float(value)


def _differences(have: api.StreamConfig, want: api.StreamConfig
                 ) -> tuple[dict[str, object], list[str]]:
    """(fields to raise to the wanted value, fields that differ and are left alone).

    Raising max_bytes/max_age only keeps messages longer: safe, and what an operator who
    raised the settings expects. Lowering them would delete history a worker's plugin or
    another router (another version, other settings) still replays from; were both
    directions applied, two routers with different settings would reconfigure the stream
    back and forth at each start. Subjects, storage, retention and discard are the
    stream's identity or semantics (JetStream refuses to change storage; other subjects
    can overlap another stream or orphan what was captured): an operator's choice."""
    raise_to: dict[str, object] = {}
    kept: list[str] = []
    for field, unlimited in (("max_bytes", -1.0), ("max_age", 0.0)):
        have_v = _limit(getattr(have, field), unlimited)
        want_v = _limit(getattr(want, field), unlimited)
        if math.isclose(have_v, want_v, rel_tol=0.0, abs_tol=1e-3) or have_v == want_v:
            continue
        if want_v > have_v:
            raise_to[field] = getattr(want, field)
        else:
            kept.append(field)
    if sorted(have.subjects or []) != sorted(want.subjects or []):
        kept.append("subjects")
    for field in ("storage", "retention", "discard"):
        have_v, want_v = getattr(have, field), getattr(want, field)
        # None: the server's default (a plugin's create leaves retention out: limits).
        if want_v is not None and have_v is not None and have_v != want_v:
            kept.append(field)
    return raise_to, kept


async def remove_streams(url: str, subjects: Subjects) -> None:
    """Delete the router's streams of ``subjects`` (tests and benchmarks make throwaway
    prefixes; a shared NATS would otherwise keep their reserved storage)."""
    connection = nats_connection(url)
    nc = await nats.connect(servers=list(connection.servers), user=connection.user,
                            password=connection.password, token=connection.token,
                            connect_timeout=2)
    try:
        js = nc.jetstream()
        for name in (subjects.events_stream, outcomes_stream_name(subjects),
                     releases_stream_name(subjects)):
            try:
                await js.delete_stream(name)
            except NotFoundError:
                pass
    finally:
        await nc.close()


# How often a burst of slow-consumer losses is logged (each lost message is counted).
SLOW_CONSUMER_LOG_S = 10.0
# The longest a publish waits on nats-py's forced flush (its pending buffer full: a server
# that stopped reading). nats-py's default has no bound: a publish waited until a server
# answered again, and with it the planner's tick, an end, an agent's hints call. Past
# this, the publish returns with its message still queued (sent if the server reads
# again), and nats-py reports a FlushTimeoutError, counted as a client error.
PUBLISH_FLUSH_TIMEOUT_S = 2.0
# What the client reports when it could not reach a server (refused, unreachable, timed
# out): on_error's kind "connect".
_CONNECT_ERRORS = (OSError, asyncio.TimeoutError, NoServersError)


class NatsLink:
    def __init__(self, url: str, subjects: Subjects, on_error: Callable[[str], None],
                 on_lost: Callable[[int], None], limits: StreamLimits = StreamLimits(),
                 retry_s: float = 2.0) -> None:
        """``on_error(kind)``: a failure that lost no message by itself, ``kind`` one of
        ``metric_labels.NATS_ERROR_KINDS`` (connect, setup, client). ``on_lost(count)``:
        inbound messages the NATS client discarded (a slow consumer: nats-py reports
        each). A failed :meth:`publish` is neither: its caller counts what it lost.
        Raises ValueError for a ``url`` nats_url_problem refuses (the settings did)."""
        self.url = url
        # The credentials go to nats-py as arguments, the servers without them: it does
        # not percent-decode a URL's user info (schemas/nats_address.py).
        self._connection = nats_connection(url)
        self.subjects = subjects
        self._limits = limits
        self._on_connected: tuple[Callable[[], Awaitable[None]], ...] = ()
        self._on_error = on_error
        self._on_lost = on_lost
        self._lost_unlogged = 0
        self._lost_logged_at = -math.inf
        self._retry_s = retry_s
        self._nc: NatsClient | None = None
        self._js: JetStreamContext | None = None
        self._connect_task: asyncio.Task[None] | None = None
        self._subscriptions: list[Subscription] = []
        # Whether each of _on_connected ran on the current client (wait_set_up).
        self._set_up_done = False
        # The last ensure_streams' findings, by stream name (empty before one succeeded).
        self.streams: dict[str, StreamCheck] = {}
        # True while the link closes its own client: that disconnect is not a fault.
        self._closing = False
        # Called (on the loop, not awaited: each starts its own work) after each of
        # nats-py's reconnects, its subscriptions made again: what was published while
        # the link was down never comes to them (the cancels' recheck).
        self.on_reconnected: list[Callable[[], None]] = []
        self.last_error = ""

    @property
    def connected(self) -> bool:
        return self._nc is not None and self._nc.is_connected

    @property
    def js(self) -> JetStreamContext:
        if self._js is None:
            raise RuntimeError("NATS not connected")
        return self._js

    def start(self, *on_connected: Callable[[], Awaitable[None]]) -> None:
        """Connect in the background; each of ``on_connected`` runs, in order, once the
        link is up (each connection's streams and subscriptions: the feed's, the
        cancels')."""
        self._on_connected = on_connected
        self._connect_task = asyncio.create_task(self._connect_loop(), name="kvhint-nats")

    async def wait_connected(self, timeout_s: float) -> bool:
        deadline = asyncio.get_running_loop().time() + timeout_s
        while not self.connected:
            if asyncio.get_running_loop().time() > deadline:
                return False
            await asyncio.sleep(0.05)
        return True

    async def wait_set_up(self, timeout_s: float) -> bool:
        """Whether, within ``timeout_s``, the link came up with each ``on_connected``
        done and the server holding every subscription they made (a flush: the server
        answers it after what came before). :meth:`wait_connected` returns before the
        set-up: a message published then may find no subscription, a stream not yet
        there."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while not (self._set_up_done and self.connected):
            if asyncio.get_running_loop().time() > deadline:
                return False
            await asyncio.sleep(0.05)
        nc = self._nc
        assert nc is not None
        left = max(0.1, deadline - asyncio.get_running_loop().time())
        try:
            await nc.flush(timeout=max(1, math.ceil(left)))
        except (NatsError, asyncio.TimeoutError):
            return False
        return True

    async def _connect_loop(self) -> None:
        connection = self._connection
        while True:
            self._set_up_done = False
            try:
                nc = await nats.connect(
                    servers=list(connection.servers), user=connection.user,
                    password=connection.password, token=connection.token,
                    name="kvhint-router", connect_timeout=2,
                    flush_timeout=PUBLISH_FLUSH_TIMEOUT_S,
                    allow_reconnect=True, max_reconnect_attempts=-1, reconnect_time_wait=1,
                    error_cb=self._error_cb, disconnected_cb=self._disconnected_cb,
                    reconnected_cb=self._reconnected_cb,
                )
            except (NatsError, OSError, asyncio.TimeoutError) as exc:
                self._note_error("connect", f"connect to {loggable_nats_url(self.url)} failed: "
                                            f"{exc!r}")
                await asyncio.sleep(self._retry_s)
                continue
            except Exception as exc:  # counted and retried: this task must not end
                # nats-py raises others too (ValueError, AssertionError on a URL it
                # refuses); uncaught, one ended this task, and the router served on
                # without NATS, nothing counted. The settings refuse such URLs now.
                self._note_error("connect", f"connect to {loggable_nats_url(self.url)} "
                                            f"failed unexpectedly: {type(exc).__name__}")
                await asyncio.sleep(self._retry_s)
                continue
            self._nc = nc
            self._js = nc.jetstream()
            log.info("NATS connected: %s", loggable_nats_url(self.url))
            try:
                for set_up in self._on_connected:
                    await set_up()
            except (NatsError, asyncio.TimeoutError) as exc:
                # Streams or subscriptions failed (JetStream still starting?): retry.
                self._note_error("setup", f"NATS setup failed: {exc!r}")
                await self._close_client()
                await asyncio.sleep(self._retry_s)
                continue
            self._set_up_done = True
            return

    def _note_error(self, kind: str, message: str) -> None:
        self.last_error = message
        self._on_error(kind)
        log.warning("%s", message)

    async def _error_cb(self, exc: Exception) -> None:
        if isinstance(exc, SlowConsumerError):
            self._lost(exc)
            return
        # nats-py reports here every failed try to connect or reconnect (it retries on
        # its own), as well as a dropped connection or a server's -ERR.
        kind = "connect" if isinstance(exc, _CONNECT_ERRORS) else "client"
        self._note_error(kind, f"NATS error: {exc!r}")

    def _lost(self, exc: SlowConsumerError) -> None:
        """One inbound message the client discarded (its subscription's pending limits
        were full): counted each, logged at most every SLOW_CONSUMER_LOG_S."""
        self._on_lost(1)
        self._lost_unlogged += 1
        self.last_error = f"NATS slow consumer: {exc}"
        now = asyncio.get_running_loop().time()
        if now - self._lost_logged_at >= SLOW_CONSUMER_LOG_S:
            log.warning("NATS slow consumer: %d message(s) discarded since the last "
                        "report, the last on %s", self._lost_unlogged, exc.subject)
            self._lost_unlogged = 0
            self._lost_logged_at = now

    async def _disconnected_cb(self) -> None:
        if self._closing:
            log.info("NATS connection closed")
        else:
            log.warning("NATS disconnected; reconnecting")

    async def _reconnected_cb(self) -> None:
        log.info("NATS reconnected")
        for callback in self.on_reconnected:
            callback()

    async def ensure_streams(self) -> dict[str, StreamCheck]:
        """Make the events, outcomes and releases streams fit the settings: create each
        when missing; on one that exists (an operator's, an older router's, the plugin's)
        raise max_bytes/max_age to the settings where they are lower, and warn naming
        every field still different (lower limits than it has, other subjects, storage,
        retention, discard are left as they are; :func:`_differences` says why).

        A create that loses the race to another router or a plugin (JetStream answers
        10058 when the configs differ) reads the stream that won and goes on as above.
        Raises NatsError/TimeoutError only where JetStream itself fails (the caller then
        runs without replay and tries again later)."""
        limits = self._limits
        checks: dict[str, StreamCheck] = {}
        for name, subject, max_age, max_bytes in (
            (self.subjects.events_stream, self.subjects.all_of("events"),
             limits.events_max_age_s, limits.events_max_bytes),
            (outcomes_stream_name(self.subjects), self.subjects.all_of("outcomes"),
             limits.outcomes_max_age_s, limits.outcomes_max_bytes),
            (releases_stream_name(self.subjects), self.subjects.all_of("releases"),
             limits.releases_max_age_s, limits.releases_max_bytes),
        ):
            want = api.StreamConfig(
                name=name, subjects=[subject], storage=api.StorageType.FILE,
                retention=api.RetentionPolicy.LIMITS, discard=api.DiscardPolicy.OLD,
                max_age=max_age, max_bytes=max_bytes)
            checks[name] = await self._ensure_stream(want)
        self.streams = checks
        return checks

    async def _ensure_stream(self, want: api.StreamConfig) -> StreamCheck:
        name = want.name
        assert name is not None
        try:
            info = await self.js.stream_info(name)
        except NotFoundError:
            try:
                info = await self.js.add_stream(want)
                log.info("JetStream stream %s created", name)
                return StreamCheck(name, True, (), (), info.config)
            except NatsError as exc:
                # Lost the create race (another router or a plugin made it between our
                # lookup and our create): take the stream that won and check it below.
                # Where it still does not exist, the create really failed.
                try:
                    info = await self.js.stream_info(name)
                except NotFoundError:
                    raise exc from None
                log.info("JetStream stream %s was created meanwhile by another router or "
                         "a worker's plugin (%s): using it", name, exc)
        return await self._reconcile(info.config, want)

    async def _reconcile(self, have: api.StreamConfig, want: api.StreamConfig
                         ) -> StreamCheck:
        name = want.name
        assert name is not None
        raise_to, kept = _differences(have, want)
        applied: list[str] = []
        notes: list[str] = []
        config = have
        if raise_to:
            try:
                info = await self.js.update_stream(have.evolve(**raise_to))
            except (NatsError, asyncio.TimeoutError) as exc:
                # E.g. the server or account cannot reserve the larger max_bytes: the
                # stream keeps working with its old limits.
                kept.extend(raise_to)
                notes.append(f"raising {', '.join(raise_to)} failed: {exc!r}")
            else:
                config = info.config
                applied.extend(raise_to)
        if applied or kept:
            parts = [f"{field} {getattr(have, field)!r} -> {getattr(want, field)!r} applied"
                     for field in applied]
            parts += [f"{field} is {getattr(have, field)!r}, settings want "
                      f"{getattr(want, field)!r}: kept" for field in kept]
            log.warning("JetStream stream %s differs from the router's settings: %s%s", name,
                        "; ".join(parts), "".join(f" ({note})" for note in notes))
        return StreamCheck(name, False, tuple(applied), tuple(kept), config)

    async def subscribe(self, subject: str, handler: Handler) -> Subscription:
        if self._nc is None:
            raise RuntimeError("NATS not connected")
        sub = await self._nc.subscribe(subject, cb=handler)
        self._subscriptions.append(sub)
        return sub

    async def unsubscribe(self, sub: Subscription, drain: bool = False) -> None:
        """End ``sub``; with ``drain`` the messages the server sent before it learned of
        the unsubscribe are still handled (none is lost in a hand-over)."""
        if sub in self._subscriptions:
            self._subscriptions.remove(sub)
        if drain:
            await sub.drain()
        else:
            await sub.unsubscribe()

    async def subscribe_stream(self, subject: str, stream: str, handler: Handler,
                               start_seq: int | None) -> Subscription:
        """An ordered (ephemeral, flow-controlled) consumer from stream sequence
        ``start_seq`` (1: the whole stream; None: only messages from now on)."""
        config = None
        if start_seq is None:
            policy = api.DeliverPolicy.NEW
        elif start_seq <= 1:
            policy = api.DeliverPolicy.ALL
        else:
            policy = api.DeliverPolicy.BY_START_SEQUENCE
            config = api.ConsumerConfig(opt_start_seq=start_seq)
        sub = await self.js.subscribe(subject, stream=stream, cb=handler, ordered_consumer=True,
                                      deliver_policy=policy, config=config,
                                      pending_msgs_limit=1_000_000,
                                      pending_bytes_limit=1 << 30)
        self._subscriptions.append(sub)
        return sub

    async def publish(self, subject: str, payload: bytes) -> bool:
        """Fire and forget; False when not connected (the caller counts the drop)."""
        if not self.connected or self._nc is None:
            return False
        try:
            await self._nc.publish(subject, payload)
        except NatsError as exc:
            # Counted by the caller, as what it lost (once: not a NATS error too).
            self.last_error = f"publish on {subject} failed: {exc!r}"
            log.warning("%s", self.last_error)
            return False
        return True

    async def request(self, subject: str, payload: bytes, timeout_s: float) -> bytes:
        if self._nc is None:
            raise RuntimeError("NATS not connected")
        reply = await self._nc.request(subject, payload, timeout=timeout_s)
        return reply.data

    async def close(self) -> None:
        if self._connect_task is not None:
            self._connect_task.cancel()
            try:
                await self._connect_task
            except asyncio.CancelledError:
                pass
            self._connect_task = None
        await self._close_client()

    async def _close_client(self) -> None:
        nc, self._nc, self._js = self._nc, None, None
        self._subscriptions.clear()
        if nc is None:
            return
        self._closing = True
        try:
            # drain(): finish handling what was delivered, flush publishes, then close.
            await asyncio.wait_for(nc.drain(), timeout=5.0)
        except (NatsError, asyncio.TimeoutError) as exc:
            log.warning("NATS drain: %r", exc)
            await nc.close()
        finally:
            self._closing = False
