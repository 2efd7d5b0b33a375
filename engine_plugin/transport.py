"""NATS transport: an asyncio loop in a daemon thread, talking to the engine only through
the :class:`~kvhint.engine_plugin.mailbox.Mailbox`.

Lifetimes live in :meth:`NatsTransport._main`: connect (retrying until stopped:
:mod:`.transport_connect`), then the publisher's loop: subscribe to hints, advice and
snapshot requests and ensure the JetStream events stream (:mod:`.transport_setup`,
which looks for it again every minute), then publish outcomes, hold releases (past
``max_payload``: :mod:`.transport_oversize`), event batches (vLLM's msgpack
``KVEventBatch``, ``EventBatchMeta`` headers) and the status heartbeat until stopped, then drain.

NATS being down or slow never blocks the engine: the scheduler thread only appends to
bounded deques; while disconnected, batches wait there (the oldest are dropped, counted,
when full: the router sees the sequence gap and resyncs from a snapshot), and nats-py
reconnects on its own (the publisher waits meanwhile, never spinning). An exception in
one round of the publisher or in its setup (a bug) is logged, counted
(``kvhint:internal_errors``), and the publisher goes on (the setup is tried again); stop
cancels a setup step in progress. One that ends the whole loop (outside a round: the
connect, the drain) is counted the same way and the loop starts again, connect first,
after a pause: before, the thread ended and the engine ran without NATS for good, with
one log line and no counter. Inbound hints and advice are decoded on this thread, off
the scheduler's (:mod:`.transport_intake`); advice that cannot be decoded, and hints and
advice that find the engine's inbox full, are answered ``rejected`` from here, a snapshot
request that finds it full an error reply at once (:mod:`.transport_inbound`). Snapshot pages:
:mod:`.snapshot_pages`. An idle engine is woken for its deadlines and for a change of
what the transport exports (:mod:`.transport_wake`).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from nats.errors import Error as NatsError, MaxPayloadError

from kvhint.engine_plugin.config import LOGGER_NAME, PluginConfig
from kvhint.engine_plugin.counter_exports import EXPORTS
from kvhint.engine_plugin.mailbox import EventBatchOut, Mailbox, SnapshotOut, pop_oldest
from kvhint.engine_plugin.snapshot_pages import KeptSnapshots, snapshot_page
from kvhint.engine_plugin.transport_connect import connect_until_stopped, wait_or_stop
from kvhint.engine_plugin.transport_counters import (
    NatsErrorLog,
    TransportCounters,
    note_internal_error,
)
from kvhint.engine_plugin.transport_intake import IntakeMixin
from kvhint.engine_plugin.transport_oversize import header_bytes, smaller
from kvhint.engine_plugin.transport_setup import (
    EventsStreamWatch,
    ensure_events_stream,
    until_stopped,
)
from kvhint.engine_plugin.transport_wake import EngineWaker
from kvhint.schemas import (
    EventBatchMeta,
    SnapshotRefused,
    Subjects,
    Usage,
    WorkerStatus,
    encode_outcome,
    encode_releases,
    encode_snapshot_refused,
    encode_status,
)
from kvhint.schemas.nats_address import loggable_nats_url

logger = logging.getLogger(LOGGER_NAME)

# The publisher's pause after an unexpected exception in one of its rounds (or its setup).
ROUND_ERROR_PAUSE_S = 0.5


class NatsTransport(IntakeMixin):
    """Owns the NATS connection and its thread. ``status_of(usage, seq)`` builds the
    heartbeat from the figures the scheduler thread last left in the mailbox;
    ``encode_events(ts, events)`` turns a drained batch into vLLM's msgpack bytes."""

    def __init__(self, config: PluginConfig, worker_id: str, epoch: str, mailbox: Mailbox,
                 status_of: Callable[[Usage | None, int], WorkerStatus],
                 encode_events: Callable[[float, list[Any]], bytes],
                 block_size: int, event_group: int = 0) -> None:
        self.config = config
        self.worker_id = worker_id
        self.epoch = epoch
        self.mailbox = mailbox
        self.subjects = Subjects(config.subject_prefix)
        self._status_of = status_of
        self._encode_events = encode_events
        self._block_size = block_size
        # The KV-cache group the router follows, named in each batch's headers.
        self._event_group = event_group
        self.counters = TransportCounters()
        self._nats_errors = NatsErrorLog(self.counters)
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._wake: asyncio.Event | None = None
        self._nc: Any = None
        # The setup done on the connection (the publisher's loop retries the rest).
        self._subscribed: set[str] = set()
        self._set_up_done = False
        self._stream = EventsStreamWatch(config, self.subjects, self.counters)
        self._next_beat = 0.0
        self._waker = EngineWaker(mailbox, self._exported_figures)
        # The latest snapshots, for the pages after the first (SnapshotRequest.seq).
        self.snapshots = KeptSnapshots(config.snapshot_keep_blocks, self.counters)
        self._ready = threading.Event()
        # Set by stop() (any thread): the transport thread starts no new loop after it.
        self._stopping = threading.Event()

    @property
    def connected(self) -> bool:
        nc = self._nc
        return nc is not None and nc.is_connected

    @property
    def set_up(self) -> bool:
        """Whether the set-up went through on this connection: subscribed to hints,
        advice and snapshot requests, and the events stream looked for once. The server
        has the subscriptions then (the stream's look, a request on the same connection,
        was answered after them). ``connected`` comes before: a hint or snapshot request
        sent then may find no subscription (lost; a request gets no responders)."""
        return self._set_up_done

    @property
    def events_kept(self) -> bool:
        """Whether the events stream existed at the latest look (kvhint:events_kept)."""
        return self._stream.kept

    # --- lifetime (engine thread) -----------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"kvhint-nats-{self.worker_id}",
                                        daemon=True)
        self._thread.start()
        self._ready.wait(5.0)

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stopping.set()
        loop, stop = self._loop, self._stop
        if loop is not None and stop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(self._set_stop)
            except RuntimeError:  # loop already closed
                pass
        if self._thread is not None:
            self._thread.join(timeout_s)
        self._thread = None

    def _set_stop(self) -> None:
        for event in (self._stop, self._wake):  # the publisher waits on the wake one
            if event is not None:
                event.set()

    def _notify(self) -> None:
        """Called from the scheduler thread when something was queued outbound."""
        loop, wake = self._loop, self._wake
        if loop is not None and wake is not None and not wake.is_set():
            try:
                loop.call_soon_threadsafe(wake.set)
            except RuntimeError:
                pass

    def _run(self) -> None:
        """The transport thread: the loop until stopped, started again (connect first)
        after an exception that ended it; the thread itself never dies of one."""
        while not self._stopping.is_set():
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                loop.run_until_complete(self._main())
                return
            except Exception:  # counted and logged; the loop starts again
                note_internal_error(self.counters, "the NATS transport's loop failed; it "
                                    "starts again, connecting first")
            finally:
                loop.close()
            self._nc = None
            self._subscribed.clear()  # the next connection subscribes afresh
            self._set_up_done = False
            if self._stopping.wait(ROUND_ERROR_PAUSE_S):
                return

    # --- the loop (transport thread) ------------------------------------------------------------

    async def _main(self) -> None:
        self._stop = asyncio.Event()
        self._wake = asyncio.Event()
        if self._stopping.is_set():  # stop() came before these events existed
            self._set_stop()
        self.mailbox.notify_transport = self._notify
        self._ready.set()
        nc = await self._connect()
        if nc is None:
            return
        self._nc = nc
        try:
            await self._publish_loop(nc)
        finally:
            self.mailbox.notify_transport = _noop
            await self._stream.cancel()
            try:
                await asyncio.wait_for(nc.drain(), timeout=2.0)
            except (NatsError, asyncio.TimeoutError, OSError):
                await nc.close()

    async def _connect(self) -> Any:
        connection = self.config.nats_connection
        nc = await connect_until_stopped(self._stop, connection, dict(
            name=f"kvhint-plugin-{self.worker_id}", allow_reconnect=True,
            max_reconnect_attempts=-1, reconnect_time_wait=0.5, connect_timeout=2,
            ping_interval=5, max_outstanding_pings=2, error_cb=self._on_error,
            disconnected_cb=self._on_disconnected, reconnected_cb=self._on_reconnected))
        if nc is not None:
            self.counters.connects += 1
            logger.info("kvhint: connected to NATS %s as worker %s", loggable_nats_url(
                nc.connected_url.geturl() if nc.connected_url else ",".join(connection.servers)),
                self.worker_id)
        return nc

    async def _on_error(self, exc: Exception) -> None:
        self._nats_errors.note(exc)  # counted; a slow consumer's message is lost

    async def _on_disconnected(self) -> None:
        if self._nc is None:  # a first attempt given up (closed): never connected
            return
        self.counters.disconnects += 1
        if self._stop is not None and self._stop.is_set():
            return
        logger.warning("kvhint: disconnected from NATS; buffering (bounded) and reconnecting")

    async def _on_reconnected(self) -> None:
        self.counters.connects += 1
        logger.info("kvhint: reconnected to NATS")
        self._stream.check_soon()
        self._notify()

    async def _set_up(self, nc: Any) -> None:
        """Subscribe (each subject once, whatever failed before), then ensure the events
        stream. Run by the publisher's loop (:mod:`.transport_setup`): retried after an
        exception, cancelled by stop."""
        worker = self.worker_id
        for subject, cb in ((self.subjects.hints(worker), self._on_hints),
                            (self.subjects.advice(worker), self._on_advice),
                            (self.subjects.snapshot(worker), self._on_snapshot)):
            if subject not in self._subscribed:
                await nc.subscribe(subject, cb=cb)
                self._subscribed.add(subject)
        await self._ensure_stream(nc)
        self._stream.start(nc)
        self._set_up_done = True

    async def _ensure_stream(self, nc: Any) -> None:
        self._stream.kept = bool(
            await ensure_events_stream(nc, self.config, self.subjects, self.counters))

    # --- outbound -------------------------------------------------------------------------------

    async def _publish_loop(self, nc: Any) -> None:
        while not self._stop.is_set():
            try:
                if not self._set_up_done:  # until it all went through once
                    await until_stopped(self._stop, self._set_up(nc))
                    continue
                again = await self._publish_round(nc)
            except Exception:  # a bug in one round (an encoder, a snapshot page) or in the
                # setup must not end the thread for good; NATS and socket errors are
                # handled where raised (a failed subscribe: retried here)
                note_internal_error(self.counters, "unexpected error in the NATS transport's "
                                    "publisher (what it was publishing may be lost); it "
                                    "goes on")
                await wait_or_stop(self._stop, ROUND_ERROR_PAUSE_S)
                continue
            if again:
                continue
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=max(
                    0.01, min(self._next_beat - time.monotonic(), 0.5)))
            except asyncio.TimeoutError:
                pass
        if nc.is_connected:
            await self._flush_outbound(nc)

    async def _publish_round(self, nc: Any) -> bool:
        """The heartbeat when due, the engine woken when a deadline is, the queues
        flushed while connected. Whether to go again at once: only when connected, this
        round published and more is queued; else the publisher waits (a reconnect, new
        work and stop wake it). Looping on while NATS was down never yielded: nats-py's
        reconnect and stop() never ran, and the engine's thread fought for the GIL."""
        now = time.monotonic()
        if now >= self._next_beat:
            self._next_beat = now + self.config.heartbeat_interval_s
            await self._heartbeat(nc)
        self._waker.maybe_wake_for_deadline()
        flushed = await self._flush_outbound(nc) if nc.is_connected else 0
        self._wake.clear()
        mailbox = self.mailbox
        self._waker.maybe_wake_for_metrics()
        return bool(flushed and nc.is_connected and (
            mailbox.outcomes or mailbox.releases or mailbox.snapshots or mailbox.event_batches))

    def _exported_figures(self) -> tuple[Any, ...]:
        """What of this transport /metrics shows (transport thread: the only writer of
        these counters)."""
        counters = self.counters
        return (self.connected, self.events_kept, sum(counters.outcomes.values()),
                *(getattr(counters, name) for name in EXPORTS[TransportCounters]))

    async def _flush_outbound(self, nc: Any) -> int:
        """Publish what is queued; returns how many items left the queues. Items are taken
        before publishing and put back at the head on failure, so a drop by the scheduler
        thread (full buffer) never makes us skip an item unpublished and uncounted."""
        mailbox = self.mailbox
        published, ok = await self._publish_queue(
            nc, mailbox.outcomes, self.subjects.outcomes(self.worker_id), encode_outcome)
        self.counters.outcomes_published += published
        taken = published
        if ok:
            published, ok = await self._publish_queue(
                nc, mailbox.releases, self.subjects.releases(self.worker_id), encode_releases)
            self.counters.releases_published += published
            taken += published
        batches = mailbox.event_batches
        while ok and nc.is_connected and (batch := pop_oldest(batches)) is not None:
            try:
                await self._publish_batch(nc, batch)
                taken += 1
            except (NatsError, OSError) as exc:
                batches.appendleft(batch)
                await self._publish_failed(exc)
                ok = False
        while ok and (snapshot := pop_oldest(mailbox.snapshots)) is not None:
            # Every page of one seq from one copy, its sessions included (kept()).
            kept = self.snapshots.kept(snapshot) if snapshot.error is None else None
            await self._reply_page(kept.snapshot if kept else snapshot,
                                   kept.blocks if kept else [], snapshot.reply_to,
                                   snapshot.cursor, snapshot.limit)
            taken += 1
        return taken

    async def _publish_queue(self, nc: Any, queue: deque[Any], subject: str,
                             encode: Callable[[Any], bytes]) -> tuple[int, bool]:
        """Publish ``queue`` oldest first on ``subject``; returns (published, whether the
        queue was left without a failure: a failed item goes back to its head)."""
        published = 0
        while nc.is_connected and (item := pop_oldest(queue)) is not None:
            try:
                await nc.publish(subject, encode(item))
            except MaxPayloadError:  # never fits as it is: smaller, or dropped (counted)
                queue.extendleft(reversed(smaller(item, self.counters, subject)))
                continue
            except (NatsError, OSError) as exc:
                queue.appendleft(item)
                await self._publish_failed(exc)
                return published, False
            published += 1
        return published, True

    async def _publish_failed(self, exc: Exception) -> None:
        self.counters.queued_publish_errors += 1  # the item went back: retried
        logger.debug("kvhint: publish failed (%s); will retry", exc)
        await asyncio.sleep(0.05)

    async def _publish_batch(self, nc: Any, batch: EventBatchOut) -> None:
        payload = self._encode_events(batch.ts, batch.events)
        headers = EventBatchMeta(self.worker_id, self.epoch, batch.seq,
                                 self._event_group).to_headers()
        # The server counts the headers too (the client checks the payload alone): before,
        # a batch within ~100 bytes of the limit made the server close the connection.
        size = len(payload) + header_bytes(headers)
        if size > nc.max_payload:
            logger.warning("kvhint: event batch %d (%d bytes with its headers) exceeds NATS "
                           "max_payload; dropped", batch.seq, size)
            self.mailbox.drop_event_batch(batch)
            return
        await nc.publish(self.subjects.events(self.worker_id), payload, headers=headers)
        self.counters.event_batches_published += 1
        self.counters.events_published += len(batch.events)

    async def _heartbeat(self, nc: Any) -> None:
        if not nc.is_connected:
            return
        status = self.mailbox.status
        beat = self._status_of(status.get("usage"), int(status.get("seq", 0)))
        try:
            await nc.publish(self.subjects.status(self.worker_id), encode_status(beat))
            self.counters.heartbeats_published += 1
        except (NatsError, OSError) as exc:
            self.counters.heartbeat_publish_errors += 1  # lost: the next one follows
            logger.debug("kvhint: heartbeat failed: %s", exc)

    async def _reply_page(self, snapshot: SnapshotOut, blocks: list[tuple[int, int | None, str]],
                          reply_to: str | None, cursor: int, limit: int) -> None:
        nc = self._nc
        if not reply_to or nc is None:
            self.counters.snapshot_requests_unanswered += 1
            return
        if snapshot.error is not None:
            # A router counts it refused and asks again (one before SnapshotRefused
            # reads no page in it: a failed request, asked again as well).
            body = encode_snapshot_refused(SnapshotRefused(worker_id=self.worker_id,
                                                           error=snapshot.error))
        else:
            body = snapshot_page(snapshot, blocks, cursor, limit, int(nc.max_payload * 0.9),
                                 self.worker_id, self.epoch, self._block_size)
        try:
            await nc.publish(reply_to, body)
            self.counters.snapshot_pages += 1
        except (NatsError, OSError) as exc:
            self.counters.snapshot_reply_errors += 1  # lost: the router's request times out
            logger.debug("kvhint: snapshot reply failed: %s", exc)

def _noop() -> None:
    return None

