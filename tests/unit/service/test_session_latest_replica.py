"""The replica that saw a session's latest event, named in its row
(``sessions.latest_replica``, ``routing.replica_id``): what a save writes, what a read
of the row makes of it (whose idle review it is), and what a merge keeps. The two-replica
restart through real routers is test_service_replica_restart_review.py."""

from __future__ import annotations

from typing import Any

from kvhint.router.policy.session import SessionPlanState
from kvhint.router.service.session_merge import merge_into
from kvhint.router.service.sessions import SessionRecord, SessionRegistry

NOW = 1_700_000_000.0


def _record(last_activity: float = NOW, latest_replica: str | None = None) -> SessionRecord:
    return SessionRecord("acme", "s1", NOW, last_activity,
                         SessionPlanState("acme/s1", "acme"), latest_replica=latest_replica)


def _row(latest_replica: str | None) -> dict[str, Any]:
    return {**_record(latest_replica=latest_replica).row(), "revision": 3}


def test_a_save_names_this_replica_where_the_latest_event_is_its_own() -> None:
    record = _record(latest_replica="b")
    SessionRegistry(None, 10, replica_id="a").save(record)
    assert record.row()["latest_replica"] == "a"
    unnamed = _record(latest_replica="b")
    SessionRegistry(None, 10).save(unnamed)  # no id: names none (NULL), as before
    assert unnamed.row()["latest_replica"] is None
    elsewhere = _record(latest_replica="b")
    elsewhere.latest_elsewhere = True
    SessionRegistry(None, 10, replica_id="a").save(elsewhere)
    assert elsewhere.row()["latest_replica"] == "b"


def test_a_row_naming_another_replica_is_that_replicas_to_review() -> None:
    cases = [("a", "b", True), ("a", "a", False), ("a", None, False), (None, "b", False)]
    for mine, named, elsewhere in cases:
        restored = SessionRegistry(None, 10, replica_id=mine)
        restored.restore([_row(named)])
        assert restored.get("acme", "s1").latest_elsewhere is elsewhere, (mine, named)
        adopted = SessionRegistry(None, 10, replica_id=mine).adopt(_row(named))
        assert adopted.latest_elsewhere is elsewhere, (mine, named)
        assert adopted.latest_replica == named


def test_a_merge_takes_the_later_records_replica() -> None:
    mine = _record(NOW + 1.0, latest_replica="a")
    merge_into(mine, _record(NOW + 2.0, latest_replica="b"))
    assert mine.latest_elsewhere and mine.latest_replica == "b"
    mine = _record(NOW + 3.0, latest_replica="a")
    merge_into(mine, _record(NOW + 2.0, latest_replica="b"))
    assert not mine.latest_elsewhere and mine.latest_replica == "a"
