"""One inbound message on the scheduler thread (mixed into
:class:`~kvhint.engine_plugin.core.PluginCore`, whose ``pump`` takes them from the
mailbox): hints and donor advice applied, their apply latency sampled, a snapshot request
answered from one copy of the index a step; a message the plugin fails on is answered
``rejected`` (an internal error) and the step goes on.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from kvhint.engine_plugin.inbound_checks import INTERNAL_ERROR_REASON, type_name
from kvhint.engine_plugin.mailbox import Inbound, Mailbox, SnapshotOut, peek_advice_id
from kvhint.engine_plugin.session_index import SessionPrefixIndex
from kvhint.schemas import (
    DecodedHints,
    DonorAdvice,
    HintOutcome,
    WireDecodeError,
    decode_snapshot_request,
)

# Apply-latency samples kept between two connector-stats readings; the rest are counted.
MAX_LATENCY_SAMPLES = 10_000


class InboundMixin:
    """The core's handling of one inbound message; the core sets these up and supplies
    the appliers (``apply_hints``, ``apply_advice``), the answers (``_rejected``,
    ``_rejected_advice``), ``_decode_hints`` and ``_internal_error``."""

    counters: Any  # the core's CoreCounters
    mailbox: Mailbox | None
    index: SessionPrefixIndex
    event_seq: int
    _step_snapshot: tuple[int, Any, Any] | None
    apply_hints: Callable[[DecodedHints], list[HintOutcome]]
    apply_advice: Callable[[bytes | str | DonorAdvice], HintOutcome]
    _decode_hints: Callable[[bytes | str], DecodedHints]
    _rejected: Callable[[str, str, str, str], HintOutcome]
    _rejected_advice: Callable[[str, str], HintOutcome]
    _internal_error: Callable[[str], None]

    def _handle_one(self, item: Inbound) -> list[HintOutcome]:
        """``item``'s outcomes; when the plugin fails on it (a bug: counted, logged once),
        its actions are answered ``rejected`` (REJECTED_INTERNAL_ERROR) and the step goes
        on (later messages, TTLs, releases, status)."""
        try:
            return self._handle(item)
        except Exception:  # one message's bug must not skip the rest of the step
            self._internal_error(f"pump:{item.kind}")
        if item.kind == "snapshot":
            assert self.mailbox is not None
            self.mailbox.put_snapshot(SnapshotOut(self.event_seq, [], [], item.reply_to, -1, 0,
                                                  error=INTERNAL_ERROR_REASON))
            return []
        if item.kind == "advice":
            advice_id = (item.decoded.advice_id if isinstance(item.decoded, DonorAdvice)
                         else peek_advice_id(item.data))
            return [self._rejected_advice(advice_id, INTERNAL_ERROR_REASON)]
        if item.kind != "hints":
            return []
        decoded = item.decoded if item.decoded is not None else self._decode_hints(item.data)
        if not decoded.actions:  # one answer for the message, as for any naming none
            return [self._rejected(decoded.message_id, "", "", INTERNAL_ERROR_REASON)]
        return [self._rejected(decoded.message_id, a.action_id, type_name(a),
                               INTERNAL_ERROR_REASON) for a in decoded.actions]

    def _within_step(self, item: Inbound, room: int) -> int:
        """The actions of ``item`` this step applies (at least one): a hints message
        with more than ``room`` keeps the first ``room`` and the rest go back to the head
        of the inbox, taken (no early ``deferred``), for the next step."""
        if item.kind != "hints":
            return 1
        if item.decoded is None:
            item.decoded = self._decode_hints(item.data)
        decoded: DecodedHints = item.decoded
        if len(decoded.actions) <= room:
            return max(len(decoded.actions), 1)
        assert self.mailbox is not None
        item.decoded = replace(decoded, actions=decoded.actions[:room])
        self.mailbox.put_back(Inbound("hints", b"", item.received_at, item.reply_to,
                                      taken=True,
                                      decoded=replace(decoded, actions=decoded.actions[room:])))
        return room

    def _handle(self, item: Inbound) -> list[HintOutcome]:
        if item.kind == "hints":
            # Decoded once, by the transport when it came (off this thread); kept on the
            # item, so a failure below does not decode it again.
            if item.decoded is None:
                item.decoded = self._decode_hints(item.data)
            outcomes = self.apply_hints(item.decoded)
        elif item.kind == "advice":
            # Decoded by the transport too (one it cannot decode it answers itself).
            outcomes = [self.apply_advice(item.decoded if item.decoded is not None
                                          else item.data)]
        elif item.kind == "snapshot":
            self._snapshot(item)
            return []
        else:
            raise ValueError(f"unknown inbound kind {item.kind!r}")
        latencies = self.counters.apply_latencies_s
        if len(latencies) < MAX_LATENCY_SAMPLES:
            latencies.append(time.monotonic() - item.received_at)
        else:
            self.counters.latency_samples_dropped += 1
        return outcomes

    def _snapshot(self, item: Inbound) -> None:
        self.counters.snapshot_requests += 1
        assert self.mailbox is not None
        try:
            request = decode_snapshot_request(item.data)
        except WireDecodeError as exc:
            self.mailbox.put_snapshot(SnapshotOut(self.event_seq, [], [], item.reply_to, -1,
                                                  0, error=str(exc)))
            return
        if self._step_snapshot is None:
            # Copies the whole index on the scheduler thread (1M blocks: ~1 s): requests
            # that come together (router replicas resyncing, retries) share one copy, in
            # this step or with one still waiting for the transport (NATS down).
            waiting = self.mailbox.waiting_snapshot()
            self._step_snapshot = (
                (waiting.seq, waiting.raw_blocks, waiting.sessions) if waiting is not None
                else (self.event_seq, self.index.snapshot_raw(),
                      self.index.snapshot_sessions()))
        seq, raw, sessions = self._step_snapshot
        self.mailbox.put_snapshot(SnapshotOut(seq, raw, sessions, item.reply_to,
                                              request.cursor, request.limit))
