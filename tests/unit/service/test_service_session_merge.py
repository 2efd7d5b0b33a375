"""session_merge.merge_into: this replica's record of a session, made from an older row,
merged with another replica's newer save of it: counters add up from the base, closed
tool gaps are kept once per depth, the latest event decides where the session is, the
planner's depth follows the turns."""

from __future__ import annotations

from kvhint.router.policy.session import SessionPlanState
from kvhint.router.service.session_merge import MAX_GAPS_KEPT, SessionBase, merge_into
from kvhint.router.service.sessions import SessionRecord


def _gap(depth: int, seconds: float = 1.0) -> dict:
    return {"tools": ["search"], "seconds": seconds, "depth": depth}


def _record(turns: int, last_activity: float, gaps: list[dict], **fields) -> SessionRecord:
    plan = SessionPlanState("acme/s", "acme", worker_id=fields.get("worker_id"),
                            turns=turns, last_activity=last_activity)
    return SessionRecord("acme", "s", fields.pop("created_at", 10.0), last_activity, plan,
                         turns=turns, gaps=list(gaps), prompt_tokens=40 * turns, **fields)


def test_the_other_replicas_later_turns_decide_where_the_session_is() -> None:
    base_gaps = [_gap(1)]
    mine = _record(3, 50.0, [*base_gaps, _gap(2, 9.0)], worker_id="w0", state="active")
    mine.base = SessionBase(turns=2, prompt_tokens=80, gaps=tuple(base_gaps))
    # The other replica went from the same base to 4 turns, closing gaps 2 and 3, and
    # saw the session's latest event (a response opening a tool gap on w1).
    theirs = _record(4, 60.0, [*base_gaps, _gap(2, 2.0), _gap(3)], worker_id="w1",
                     state="tool_gap", created_at=5.0,
                     open_gap={"tools": ["x"], "started_at": 60.0, "worker_id": "w1"})
    merge_into(mine, theirs)
    assert mine.turns == 5 and mine.prompt_tokens == 200  # 4 theirs + 1 mine
    # Gap 2 once (the other replica's: it closed it first), then 3.
    assert mine.gaps == [_gap(1), _gap(2, 2.0), _gap(3)]
    assert (mine.worker_id, mine.state, mine.last_activity) == ("w1", "tool_gap", 60.0)
    assert mine.open_gap == theirs.open_gap and mine.created_at == 5.0
    assert mine.plan.worker_id == "w1" and mine.plan.turns == 5


def test_this_replicas_later_turn_keeps_its_state_and_shifts_its_depth() -> None:
    mine = _record(3, 70.0, [_gap(1), _gap(2)], worker_id="w0", state="active")
    mine.base = SessionBase(turns=1, prompt_tokens=40, gaps=(_gap(1),))
    theirs = _record(2, 60.0, [_gap(1)], worker_id="w1", state="ended", ended_at=60.0)
    merge_into(mine, theirs)
    assert mine.turns == 4 and mine.prompt_tokens == 160
    assert mine.gaps == [_gap(1), _gap(2)]
    assert (mine.worker_id, mine.state, mine.ended_at) == ("w0", "active", None)
    assert mine.plan.worker_id == "w0" and mine.plan.turns == 4


def test_a_record_never_stored_adds_all_it_holds() -> None:
    mine = _record(2, 70.0, [_gap(1)])
    theirs = _record(3, 60.0, [_gap(1), _gap(2)])
    merge_into(mine, theirs)  # no base: everything this record counted is its own
    assert mine.turns == 5 and mine.prompt_tokens == 200
    assert [g["depth"] for g in mine.gaps] == [1, 2]


def test_the_merged_gaps_keep_the_newest_as_many_as_stored() -> None:
    mine = _record(40, 70.0, [_gap(d) for d in range(9, 41)])
    mine.base = SessionBase(turns=39, gaps=tuple(_gap(d) for d in range(8, 40)))
    theirs = _record(40, 60.0, [_gap(d) for d in range(9, 41)])
    merge_into(mine, theirs)
    assert [g["depth"] for g in mine.gaps] == list(range(9, 41))
    assert len(mine.gaps) == MAX_GAPS_KEPT


def test_an_end_its_client_asked_for_is_an_event_an_abandonment_is_not() -> None:
    """The other replica ended the session at its client's DELETE after this record's
    last turn: ended. This replica's planner abandoning its older record (idle past the
    horizon as it last saw it) does not end a session the other replica served since."""
    mine = _record(2, 50.0, [], state="active")
    mine.base = SessionBase(turns=2, prompt_tokens=80)
    theirs = _record(2, 40.0, [], state="ended", ended_at=55.0)
    theirs.plan = SessionPlanState("acme/s", "acme", turns=2, last_activity=40.0,
                                   ended=True, ended_explicitly=True)
    merge_into(mine, theirs)
    assert (mine.state, mine.ended_at, mine.plan.ended_explicitly) == ("ended", 55.0, True)

    abandoned = _record(2, 50.0, [], state="ended", ended_at=4000.0)
    abandoned.plan = SessionPlanState("acme/s", "acme", turns=2, last_activity=50.0,
                                      ended=True)
    abandoned.base = SessionBase(turns=2, prompt_tokens=80)
    served = _record(3, 60.0, [], state="active")
    merge_into(abandoned, served)
    assert (abandoned.state, abandoned.ended_at, abandoned.plan.ended) == (
        "active", None, False)
    assert abandoned.turns == 3


def _open(started_at: float) -> dict:
    return {"tools": ["fetch"], "started_at": started_at, "worker_id": "w0"}


def test_a_turn_served_from_an_older_record_closes_the_other_replicas_open_gap() -> None:
    """Turn 1 on this replica (its gap opened at 10), turn 2 on the other (began at 20,
    closed gap 1, opened its own at 25), turn 3 here at 30 from a record without turn 2
    (its read came first, or was skipped): it closed its own gap 1 again. Turn 3 closed
    turn 2's gap: kept at depth 2, 5 s. Before, gaps [1] only."""
    mine = _record(2, 32.0, [_gap(1, 20.0)], state="tool_gap", open_gap=_open(32.0))
    mine.began = [0.0, 30.0]
    mine.base = SessionBase(turns=1, prompt_tokens=40)
    theirs = _record(2, 25.0, [_gap(1, 10.0)], state="tool_gap", open_gap=_open(25.0))
    theirs.began = [0.0, 20.0]
    merge_into(mine, theirs)
    assert mine.turns == 3 and mine.plan.turns == 3
    assert mine.gaps == [_gap(1, 10.0), {"tools": ["fetch"], "seconds": 5.0, "depth": 2}]
    assert mine.open_gap == _open(32.0) and mine.began == [0.0, 20.0, 30.0]


def test_the_other_replicas_turn_from_an_older_record_closes_this_ones_open_gap() -> None:
    """The same turns, the other way round: this replica served turn 2 (its gap opened
    at 25, not saved yet), the other served turn 3 at 30 from turn 1's row and saved
    first. Merged here: turn 2's gap closed by turn 3, at depth 2."""
    mine = _record(2, 25.0, [_gap(1, 10.0)], state="tool_gap", open_gap=_open(25.0))
    mine.began = [0.0, 20.0]
    mine.base = SessionBase(turns=1, prompt_tokens=40)
    theirs = _record(2, 32.0, [_gap(1, 20.0)], state="tool_gap", open_gap=_open(32.0))
    theirs.began = [0.0, 30.0]
    merge_into(mine, theirs)
    assert mine.turns == 3 and mine.plan.turns == 3
    assert [(g["depth"], g["seconds"]) for g in mine.gaps] == [(1, 20.0), (2, 5.0)]
    assert mine.open_gap == _open(32.0)


def test_a_stale_turn_with_no_gap_of_its_own_still_closes_the_other_ones() -> None:
    """This replica's record had no open gap (turn 1 ended in a stop): its turn 3 closed
    nothing it knew of, yet began after turn 2's gap opened."""
    mine = _record(2, 32.0, [], state="active")
    mine.began = [0.0, 30.0]
    mine.base = SessionBase(turns=1, prompt_tokens=40)
    theirs = _record(2, 25.0, [], state="tool_gap", open_gap=_open(25.0))
    theirs.began = [0.0, 20.0]
    merge_into(mine, theirs)
    assert mine.gaps == [{"tools": ["fetch"], "seconds": 5.0, "depth": 2}]


def test_an_open_gap_no_turn_began_after_stays_unclosed() -> None:
    """A turn that began before the other's gap opened (turns of both at the same
    moment) did not close it; nor does a gap both records hold open close."""
    mine = _record(2, 32.0, [], state="active")
    mine.began = [0.0, 22.0]  # began before the other's gap opened at 25
    mine.base = SessionBase(turns=1, prompt_tokens=40)
    theirs = _record(2, 25.0, [], state="tool_gap", open_gap=_open(25.0))
    merge_into(mine, theirs)
    assert mine.gaps == []
    same = _record(2, 40.0, [], state="tool_gap", open_gap=_open(25.0))
    same.began = [0.0, 30.0]  # held open by both: still open, whatever began says
    same.base = SessionBase(turns=2, prompt_tokens=80)
    merge_into(same, _record(2, 25.0, [], state="tool_gap", open_gap=_open(25.0)))
    assert same.gaps == [] and same.open_gap == _open(25.0)


def test_a_record_that_saw_nothing_since_its_base_takes_theirs_whatever_the_clocks() -> None:
    """The other replica served a turn since the row this record was made from, its
    clock 5 s behind (its reading 45 against this record's 50): its state is taken. Before,
    the larger reading (this record's older one) kept the stale state."""
    mine = _record(2, 50.0, [_gap(1)], worker_id="w0", state="tool_gap",
                   open_gap={"tools": ["x"], "started_at": 50.0, "worker_id": "w0"})
    mine.base = SessionBase(turns=2, prompt_tokens=80, gaps=(_gap(1),), latest=50.0)
    theirs = _record(3, 45.0, [_gap(1), _gap(2)], worker_id="w1", state="tool_gap",
                     open_gap={"tools": ["y"], "started_at": 45.0, "worker_id": "w1"})
    merge_into(mine, theirs)
    assert (mine.worker_id, mine.last_activity, mine.open_gap) == ("w1", 45.0, theirs.open_gap)
    assert mine.latest_elsewhere and mine.plan.worker_id == "w1" and mine.turns == 3


def test_a_row_that_saw_nothing_since_this_records_base_leaves_this_record_later() -> None:
    """Only this record saw an event since its base (a turn here, its clock behind): it
    stays where it is, though the row's reading is the larger."""
    mine = _record(3, 40.0, [_gap(1), _gap(2)], worker_id="w0", state="active")
    mine.base = SessionBase(turns=2, prompt_tokens=80, gaps=(_gap(1),), latest=50.0)
    theirs = _record(2, 50.0, [_gap(1)], worker_id="w1", state="tool_gap")
    merge_into(mine, theirs)
    assert (mine.worker_id, mine.state, mine.last_activity) == ("w0", "active", 40.0)
    assert not mine.latest_elsewhere


def test_events_on_both_replicas_since_the_base_are_ordered_by_the_clocks() -> None:
    """Turns on both replicas since the base: concurrent, the larger reading wins (a
    replica's clock skew orders only these; docs/router.md)."""
    mine = _record(3, 55.0, [_gap(1)], worker_id="w0", state="active")
    mine.base = SessionBase(turns=2, prompt_tokens=80, gaps=(_gap(1),), latest=50.0)
    theirs = _record(3, 58.0, [_gap(1)], worker_id="w1", state="tool_gap")
    merge_into(mine, theirs)
    assert (mine.worker_id, mine.last_activity) == ("w1", 58.0) and mine.turns == 4
