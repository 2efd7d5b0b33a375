"""A stored session row whose closed tool gaps (``tool_gap_stats.gaps``) are dicts of
another shape: a gap's ``depth`` no number (a hand edit, a restore from elsewhere).

``readable_row`` (sessions.py) checked only that the gaps were a list of objects, so such
a row was read as it was; a merge with another replica's save (``SessionRegistry.refresh``
before a turn, or ``_conflicted`` inside the store writer's flush) then sorts the gaps by
depth and sets their depths, and raised TypeError: the turn a 500, or the writer's flush
broken. Now such a column is read as absent and counted (``session_row_unreadable``),
as every other unreadable column is."""

from __future__ import annotations

import time
from typing import Any

import pytest

from kvhint.router.service.sessions import SessionRegistry, readable_row

GOOD_GAP = {"tools": ["search"], "seconds": 3.0, "depth": 1}


@pytest.mark.parametrize("gaps", [
    [{"tools": [], "seconds": 1.0, "depth": "x"}],  # a string against numbers: sort fails
    [{"tools": [], "seconds": 1.0, "depth": [2]}],  # unhashable: the depths' set fails
], ids=["depth_a_string", "depth_a_list"])
def test_a_gap_of_another_shape_is_read_as_absent_not_raised_in_a_merge(
        gaps: list[dict[str, Any]]) -> None:
    drops: list[str] = []
    registry = SessionRegistry(None, 100, on_drop=lambda what, n: drops.append(what))
    now = time.time()
    record = registry.open("a", "s", now)
    record.gaps.append(dict(GOOD_GAP))  # this replica's own closed gap
    row = {**record.row(), "tenant": "a", "session_id": "s", "created_at": now,
           "last_activity": now + 5, "revision": 3,
           "tool_gap_stats": {"gaps": gaps}}
    assert readable_row(row)[1] == ("tool_gap_stats",)
    assert registry.refresh(record, row) is True
    assert drops == ["session_row_unreadable"]
    assert record.gaps == [GOOD_GAP]  # its own kept, the unreadable ones left out


def test_gaps_of_the_routers_own_form_are_readable() -> None:
    """What the router writes (lifecycle.py), an older row's gap without a depth, and a
    row without gaps read as they are."""
    for stats in ({"gaps": [GOOD_GAP, {"tools": [], "seconds": 2.0}]},
                  {"gaps": [], "began": [1.0]}, {}):
        row = {"tenant": "a", "session_id": "s", "tool_gap_stats": stats}
        assert readable_row(row)[1] == ()
