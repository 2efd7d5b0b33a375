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
