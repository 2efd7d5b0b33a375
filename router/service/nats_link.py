"""The router's one NATS connection: connect (retrying in the background until NATS
answers), the JetStream streams it reads, subscriptions, publish/request, and drain on
shutdown. Lifetimes live here; what messages mean lives in :mod:`.cluster_feed`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import nats
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import Error as NatsError
from nats.js import JetStreamContext, api
from nats.js.errors import NotFoundError

from kvhint.schemas import Subjects

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


async def remove_streams(url: str, subjects: Subjects) -> None:
    """Delete the router's streams of ``subjects`` (tests and benchmarks make throwaway
    prefixes; a shared NATS would otherwise keep their reserved storage)."""
    nc = await nats.connect(servers=[url], connect_timeout=2)
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


class NatsLink:
    def __init__(self, url: str, subjects: Subjects, on_error: Callable[[str], None],
                 limits: StreamLimits = StreamLimits(), retry_s: float = 2.0) -> None:
        self.url = url
        self.subjects = subjects
        self._limits = limits
        self._on_connected: Callable[[], Awaitable[None]] | None = None
        self._on_error = on_error
        self._retry_s = retry_s
        self._nc: NatsClient | None = None
        self._js: JetStreamContext | None = None
        self._connect_task: asyncio.Task[None] | None = None
        self._subscriptions: list[Subscription] = []
        # True while the link closes its own client: that disconnect is not a fault.
        self._closing = False
        self.last_error = ""

    @property
    def connected(self) -> bool:
        return self._nc is not None and self._nc.is_connected

    @property
    def js(self) -> JetStreamContext:
        if self._js is None:
            raise RuntimeError("NATS not connected")
        return self._js

    def start(self, on_connected: Callable[[], Awaitable[None]]) -> None:
        """Connect in the background; ``on_connected`` runs once the link is up."""
        self._on_connected = on_connected
        self._connect_task = asyncio.create_task(self._connect_loop(), name="kvhint-nats")

    async def wait_connected(self, timeout_s: float) -> bool:
        deadline = asyncio.get_running_loop().time() + timeout_s
        while not self.connected:
            if asyncio.get_running_loop().time() > deadline:
                return False
            await asyncio.sleep(0.05)
        return True

    async def _connect_loop(self) -> None:
        while True:
            try:
                nc = await nats.connect(
                    servers=[self.url], name="kvhint-router", connect_timeout=2,
                    allow_reconnect=True, max_reconnect_attempts=-1, reconnect_time_wait=1,
                    error_cb=self._error_cb, disconnected_cb=self._disconnected_cb,
                    reconnected_cb=self._reconnected_cb,
                )
            except (NatsError, OSError, asyncio.TimeoutError) as exc:
                self._note_error(f"connect to {self.url} failed: {exc!r}")
                await asyncio.sleep(self._retry_s)
                continue
            self._nc = nc
            self._js = nc.jetstream()
            log.info("NATS connected: %s", self.url)
            try:
                if self._on_connected is not None:
                    await self._on_connected()
            except (NatsError, asyncio.TimeoutError) as exc:
                # Streams or subscriptions failed (JetStream still starting?): retry.
                self._note_error(f"NATS setup failed: {exc!r}")
                await self._close_client()
                await asyncio.sleep(self._retry_s)
                continue
            return

    def _note_error(self, message: str) -> None:
        self.last_error = message
        self._on_error(message)
        log.warning("%s", message)

    async def _error_cb(self, exc: Exception) -> None:
        self._note_error(f"NATS error: {exc!r}")

    async def _disconnected_cb(self) -> None:
        if self._closing:
            log.info("NATS connection closed")
        else:
            log.warning("NATS disconnected; reconnecting")

    async def _reconnected_cb(self) -> None:
        log.info("NATS reconnected")

    async def ensure_streams(self) -> None:
        """Create the events, outcomes and releases streams when missing (never
        reconfigure one an operator made)."""
        limits = self._limits
        for name, subject, max_age, max_bytes in (
            (self.subjects.events_stream, self.subjects.all_of("events"),
             limits.events_max_age_s, limits.events_max_bytes),
            (outcomes_stream_name(self.subjects), self.subjects.all_of("outcomes"),
             limits.outcomes_max_age_s, limits.outcomes_max_bytes),
            (releases_stream_name(self.subjects), self.subjects.all_of("releases"),
             limits.releases_max_age_s, limits.releases_max_bytes),
        ):
            try:
                await self.js.stream_info(name)
            except NotFoundError:
                await self.js.add_stream(api.StreamConfig(
                    name=name, subjects=[subject], storage=api.StorageType.FILE,
                    retention=api.RetentionPolicy.LIMITS, discard=api.DiscardPolicy.OLD,
                    max_age=max_age, max_bytes=max_bytes))

    async def subscribe(self, subject: str, handler: Handler) -> Subscription:
        if self._nc is None:
            raise RuntimeError("NATS not connected")
        sub = await self._nc.subscribe(subject, cb=handler)
        self._subscriptions.append(sub)
        return sub

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
            self._note_error(f"publish on {subject} failed: {exc!r}")
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
