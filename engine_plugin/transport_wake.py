"""When the NATS transport wakes an idle engine for one step (transport thread).

An idle engine runs no scheduler hook: it ships no connector stats to ``/metrics`` and
meets none of the deadlines it left in the mailbox (a hold's expiry, a stats flush, a
status refresh). After each publisher round the transport asks :class:`EngineWaker`,
which wakes the engine through the mailbox when one of those is due, or when what the
transport exports on ``/metrics`` changed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from kvhint.engine_plugin.mailbox import Mailbox

# The least time between two wakes of an idle engine for a change of the transport's
# exported figures other than the connection (maybe_wake_for_metrics).
METRICS_WAKE_EVERY_S = 30.0


class EngineWaker:
    """``figures()``: what of the transport ``/metrics`` shows, the connection first."""

    def __init__(self, mailbox: Mailbox, figures: Callable[[], tuple[Any, ...]]) -> None:
        self.mailbox = mailbox
        self._figures = figures
        # The due engine deadlines already woken for: each is woken for once.
        self._woken_for: frozenset[float] = frozenset()
        # What figures() was at the last publish round, and when an idle engine may next
        # be woken to ship a change of it (time.monotonic()).
        self._figures_seen: tuple[Any, ...] | None = None
        self._metrics_wake_at = 0.0

    def maybe_wake_for_metrics(self) -> None:
        """An idle engine ships no stats: wake it when what the transport exports
        changed, at once for the connection (before, ``kvhint:nats_connected`` stayed 0
        after NATS came back, until a request came), else at most every
        :data:`METRICS_WAKE_EVERY_S`: each step of an idle engine keeps vLLM's worker
        busy-polling for a second, and NATS errors change every reconnect attempt of an
        outage (waking for each burnt a core)."""
        mailbox = self.mailbox
        figures = self._figures()
        if figures != self._figures_seen:
            if self._figures_seen is None or figures[0] != self._figures_seen[0]:
                self._metrics_wake_at = 0.0  # connected, or not: at once
            self._figures_seen = figures
            mailbox.stats_changed = True
        now = time.monotonic()
        if mailbox.stats_changed and now >= self._metrics_wake_at:
            self._metrics_wake_at = now + METRICS_WAKE_EVERY_S
            mailbox.wake_engine()

    def maybe_wake_for_deadline(self) -> None:
        """Wake an idle engine for a step once per deadline it left that is due."""
        now = time.time()
        mailbox = self.mailbox
        due = frozenset(t for t in (mailbox.next_deadline, mailbox.stats_flush_at,
                                    mailbox.status_refresh_at) if t is not None and now >= t)
        if due - self._woken_for:
            mailbox.wake_engine()
        self._woken_for = due
