"""The planner's depth of a session's turn (``plan.turns``, what it learns gaps and
returns by) counts the turns a worker answered, as the session's record does
(``turns``, what /admin/sessions shows): the live lifecycle on an injected clock with
the real planner (test_service_lifecycle.build; tests/integration/service/
test_service_session_end_turns.py drives failed turns through the router)."""

from __future__ import annotations

from dataclasses import replace

from test_service_lifecycle import answer, build


async def test_a_failed_turn_does_not_deepen_the_session_for_the_planner() -> None:
    """Before, every routed turn deepened it: a refused prompt retried twice made the
    session's next gap one of depth 4 where it had had 2 exchanges."""
    _clock, _link, _hints, _sessions, lifecycle, _ended = build(["w0"])
    record = lifecycle.begin_turn("default", "s1")
    await lifecycle.routed(record, "w0", 400, 0, ())
    await lifecycle.finished(record, "w0", answer(), False)
    assert record.turns == record.plan.turns == 1
    for _attempt in range(2):  # refused (or failed), and retried
        record = lifecycle.begin_turn("default", "s1")
        await lifecycle.routed(record, "w0", 400, 0, ())
        assert record.plan.turns == 2  # this turn's depth while it is in flight
        await lifecycle.finished(record, "w0", None, False, answered=False)
        assert record.turns == record.plan.turns == 1
    record = lifecycle.begin_turn("default", "s1")
    await lifecycle.routed(record, "w0", 400, 0, ())
    await lifecycle.finished(record, "w0", answer(), False)
    assert record.turns == record.plan.turns == 2


async def test_the_planner_takes_a_turns_depth_from_the_answered_turns() -> None:
    """A planner state that counted more turns than were answered (stored by a router
    that counted failed ones; one whose turn was answered while its session was ended,
    which plans nothing) is set right at the session's next turn. Before, the difference
    stayed for the session's life."""
    _clock, _link, _hints, _sessions, lifecycle, _ended = build(["w0"])
    record = lifecycle.begin_turn("default", "s1")
    await lifecycle.routed(record, "w0", 400, 0, ())
    await lifecycle.finished(record, "w0", answer(), False)
    record.plan = replace(record.plan, turns=5)  # as an older router stored it
    record = lifecycle.begin_turn("default", "s1")
    await lifecycle.routed(record, "w0", 400, 0, ())
    assert record.plan.turns == 2
    await lifecycle.finished(record, "w0", answer(), False)
    assert record.turns == record.plan.turns == 2
    # Ended before its turn was routed: that turn plans nothing, though it is answered.
    record = lifecycle.begin_turn("default", "s1")
    await lifecycle.end(record)
    await lifecycle.routed(record, "w0", 400, 0, ())
    await lifecycle.finished(record, "w0", answer(), False)
    assert (record.turns, record.plan.turns) == (3, 2)
    record = lifecycle.begin_turn("default", "s1")
    await lifecycle.routed(record, "w0", 400, 0, ())
    assert record.plan.turns == 4
