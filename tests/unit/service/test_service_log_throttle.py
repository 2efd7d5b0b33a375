"""router/service/log_throttle.py: the first occurrence per key logged, then one per
``every_s`` with the count held back since; the keys (a publisher's subjects) bounded."""

from __future__ import annotations

import pytest

from kvhint.router.service.log_throttle import PerKeyLogThrottle

pytestmark = pytest.mark.unit


def test_first_per_key_then_one_a_while_with_the_count_held_back() -> None:
    now = [0.0]
    throttle = PerKeyLogThrottle(every_s=60.0, clock=lambda: now[0])
    assert throttle.admit("a") == 0
    assert throttle.admit("b") == 0  # each key's first, at once
    now[0] = 59.0
    assert [throttle.admit("a") for _ in range(3)] == [None, None, None]
    now[0] = 60.0
    assert throttle.admit("a") == 3
    assert throttle.admit("a") is None
    assert throttle.admit("b") == 0  # b held none back


def test_the_keys_remembered_are_bounded_the_least_recent_forgotten_first() -> None:
    now = [0.0]
    throttle = PerKeyLogThrottle(every_s=60.0, max_keys=2, clock=lambda: now[0])
    assert throttle.admit("a") == 0 and throttle.admit("b") == 0
    assert throttle.admit("a") is None  # a heard again: b is the least recent
    assert throttle.admit("c") == 0  # b forgotten
    assert len(throttle._keys) == 2
    assert throttle.admit("a") is None
    assert throttle.admit("b") == 0  # a first again
