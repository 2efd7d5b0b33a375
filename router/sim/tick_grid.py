"""The simulator's tick grid: tick k runs at k * tick_s (k >= 1), and the ticks an idle
fleet may skip (engine.Simulation._next_tick) land on it, where the unskipped schedule
would run its shared-prefix scans. Pure functions of numbers."""

from __future__ import annotations

import math


def grid_floor(at: float, tick_s: float) -> int:
    """The index of the last tick at or before ``at``."""
    index = math.floor(at / tick_s)
    while index * tick_s > at:
        index -= 1
    while (index + 1) * tick_s <= at:
        index += 1
    return index


def grid_ceil(at: float, tick_s: float) -> int:
    """The index of the first tick at or after ``at``."""
    index = grid_floor(at, tick_s)
    return index if index * tick_s >= at else index + 1


def scan_aligned(index: int, target: int, anchor: int, tick_s: float, scan_s: float) -> int:
    """``target``, or the last tick in ``(index, target]`` at which the unskipped schedule
    runs a shared-prefix scan, given that one ran at tick ``anchor`` (``scan_due`` keeps
    its clock from the last scan that ran: landing elsewhere would move every later
    scan). Scans run every ``p`` ticks when the scan period is ``p`` whole ticks;
    otherwise the skip stops at the next scan."""
    period = scan_s / tick_s
    if all(float(x).is_integer() for x in (tick_s, scan_s, period)):
        if target < anchor:
            return target
        last = anchor + (target - anchor) // int(period) * int(period)
        return last if last > index else target
    upcoming = anchor if anchor > index else grid_ceil(anchor * tick_s + scan_s, tick_s)
    return min(target, upcoming)
