"""The NATS transport's inbound side, on its thread (mixed into
:class:`~kvhint.engine_plugin.transport.NatsTransport`, which subscribes these callbacks):
hints and advice decoded here, off the scheduler thread, and queued for the engine in the
mailbox; a later page of a snapshot kept answered from it; an early ``deferred`` for a
message the engine has not taken in time. What the transport answers itself (a full
inbox, undecodable advice) is built in :mod:`.transport_inbound`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

from kvhint.engine_plugin.config import PluginConfig
from kvhint.engine_plugin.inbound_checks import decode_hints_safely
from kvhint.engine_plugin.mailbox import Inbound, Mailbox, SnapshotOut, answer_key
from kvhint.engine_plugin.outcome_counts import counted_action_type
from kvhint.engine_plugin.snapshot_pages import KeptSnapshots
from kvhint.engine_plugin.transport_counters import TransportCounters
from kvhint.engine_plugin.transport_inbound import (
    answer_full_inbox,
    answer_full_inbox_advice,
    busy_snapshot,
    decode_advice_or_reject,
    decoder_failed,
    deferred_outcomes,
)
from kvhint.schemas import DONOR_ACTION_TYPE, decode_snapshot_request
from kvhint.schemas._codec import WireDecodeError


class IntakeMixin:
    """The transport's inbound callbacks; the transport sets these up and supplies
    ``_reply_page`` (one snapshot page, or a refusal, published) and ``_notify`` (wake its
    publisher)."""

    config: PluginConfig
    worker_id: str
    mailbox: Mailbox
    counters: TransportCounters
    snapshots: KeptSnapshots
    _loop: asyncio.AbstractEventLoop | None

    # (snapshot, its blocks in page order, reply_to, cursor, limit)
    _reply_page: Callable[[SnapshotOut, list[tuple[int, int | None, str]], str | None, int,
                           int], Awaitable[None]]
    _notify: Callable[[], None]

    async def _on_hints(self, msg: Any) -> None:
        self._post("hints", msg)

    async def _on_advice(self, msg: Any) -> None:
        self._post("advice", msg)

    async def _on_snapshot(self, msg: Any) -> None:
        if not msg.reply:  # a plain publish: no page could reach anyone, copy nothing
            self.counters.snapshot_requests_unanswered += 1
            return
        try:
            request = decode_snapshot_request(msg.data)
        except WireDecodeError:
            request = None
        if request is not None and request.cursor > 0:
            kept = self.snapshots.get(request.seq)
            if kept is not None:
                await self._reply_page(kept.snapshot, kept.blocks, msg.reply, request.cursor,
                                       request.limit)
                return
        # A first page, or one of a snapshot no longer kept: a new snapshot answers it.
        if not self._post("snapshot", msg):
            # Turned away by the full inbox (counted, inbound_dropped): answered at once
            # with a refusal, which the router retries soon (snapshot_retry_s). Before, no
            # reply: the router waited out its snapshot timeout, the worker's view stale.
            await self._reply_page(busy_snapshot(self.mailbox, msg.reply), [], msg.reply,
                                   -1, 0)

    def _post(self, kind: str, msg: Any) -> bool:
        """Decode hints and advice here, off the scheduler thread, and queue them for it;
        malformed advice is answered ``rejected`` here (nothing for the engine to do).
        Returns False when the full inbox turned ``msg`` away (hints and advice are
        answered ``rejected`` here; a snapshot request is its caller's to answer)."""
        item = Inbound(kind, msg.data, time.monotonic(), msg.reply or None)
        action_ids: list[str] = []
        if kind == "hints":
            item.decoded, failure = decode_hints_safely(msg.data)
            if failure is not None:  # answered rejected by the engine, in order
                decoder_failed(self.counters, failure)
            action_ids = [a.action_id for a in item.decoded.actions]
        elif kind == "advice":
            item.decoded = decode_advice_or_reject(msg.data, self.mailbox, self.counters,
                                                   self.worker_id)
            if item.decoded is None:
                return True
            if item.decoded.advice_id:
                action_ids = [answer_key(item.decoded.advice_id, DONOR_ACTION_TYPE)]
        if self.mailbox.post(item, action_ids):
            if kind in ("hints", "advice"):
                self._loop.call_later(self.config.defer_after_s, self._defer_if_waiting, item)
            return True
        self.counters.inbound_rejected += 1
        if kind == "hints":
            answer_full_inbox(self.mailbox, self.counters, self.worker_id, item.decoded)
        elif kind == "advice":
            # Before, only counted: the advice got no outcome at all.
            answer_full_inbox_advice(self.mailbox, self.counters, self.worker_id,
                                     item.decoded)
        return False

    def _defer_if_waiting(self, item: Inbound) -> None:
        """The engine has not taken ``item`` yet (busy in a long step, or not wakeable):
        answer ``deferred`` now, ahead of the final outcome."""
        if item.taken:
            return
        mailbox = self.mailbox
        outcomes = deferred_outcomes(item, self.worker_id, self.config.defer_after_s)
        with mailbox.lock:  # the scheduler marks items taken under the same lock
            if item.taken:
                return
            # A repeat of an action already answered gets that terminal outcome again,
            # and a "deferred" must never follow a terminal outcome.
            kind = DONOR_ACTION_TYPE if item.kind == "advice" else ""  # put_outcomes' key
            outcomes = [o for o in outcomes
                        if answer_key(o.action_id, kind) not in mailbox.answered]
            outcomes = mailbox.put_deferred(outcomes)
            self.counters.outcomes.update((counted_action_type(o.action_type), o.status.value)
                                          for o in outcomes)
        self.counters.deferred_at_once += len(outcomes)
        self._notify()
