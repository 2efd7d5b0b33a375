"""Which of a repeated warning's occurrences are logged, per key (a policy; the caller logs).

A worker's heartbeat comes every second: one that never decodes (a plugin sending budgets
out of bounds) logged each time would flood the log, and logged never, the worker looks
dead apart from a counter. :class:`PerKeyLogThrottle` lets the first occurrence per key
through, then at most one per ``every_s``, and says how many it held back in between
(counted elsewhere: the caller's metric counts every occurrence).

Keys come from publishers (NATS subjects): at most ``max_keys`` are remembered, the one
heard from longest ago forgotten first (its next occurrence is logged as a first).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

LOG_EVERY_S = 60.0
MAX_KEYS = 1024


class PerKeyLogThrottle:
    """See the module doc. ``clock`` is monotonic seconds."""

    def __init__(self, every_s: float = LOG_EVERY_S, max_keys: int = MAX_KEYS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.every_s = every_s
        self._max_keys = max_keys
        self._clock = clock
        # key -> [when last logged, occurrences held back since], least recent first.
        self._keys: OrderedDict[str, list[float]] = OrderedDict()

    def admit(self, key: str) -> int | None:
        """None: do not log this occurrence of ``key``. Else log it: the number of its
        occurrences held back since its last one logged (0 for a first)."""
        now = self._clock()
        entry = self._keys.get(key)
        if entry is None:
            self._keys[key] = [now, 0]
            while len(self._keys) > self._max_keys:
                self._keys.popitem(last=False)
            return 0
        self._keys.move_to_end(key)
        if now - entry[0] < self.every_s:
            entry[1] += 1
            return None
        held = int(entry[1])
        entry[0], entry[1] = now, 0
        return held
