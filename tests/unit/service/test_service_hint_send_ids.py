"""The router never sends an envelope naming an action id twice (router/service/
hint_send.py): a worker answers such an id once, ``rejected``, applying none of its
actions, and the router tracks an action by its id. A send naming one twice is a bug:
refused before anything is recorded or published."""

from __future__ import annotations

import pytest

from kvhint.router.policy import HoldingsLedger, PlannedAction
from kvhint.router.service.hint_records import SentAction
from kvhint.router.service.hint_send import HintSender
from kvhint.router.service.metrics import RouterMetrics
from kvhint.schemas import RetainPayload, Subjects, Target, make_action


def _planned(action_id: str, worker_id: str = "w0") -> PlannedAction:
    payload = RetainPayload(target=Target(session_id="t/s"), priority=50, ttl_s=60)
    return PlannedAction(worker_id, make_action(action_id, payload), "t/s", "t", 4,
                         1_060.0, "test")


async def test_a_send_naming_an_action_id_twice_records_and_sends_nothing() -> None:
    holdings, pending = HoldingsLedger(), {}
    saved: list[SentAction] = []
    finished: list[SentAction] = []
    sender = HintSender(None, Subjects(), holdings, pending, RouterMetrics(),
                        lambda _worker: 16, saved.append, finished.append, lambda: 1_000.0)
    with pytest.raises(ValueError, match="kvh-1"):
        # On two workers it would be two envelopes, but one id names one action.
        await sender.send([_planned("kvh-1"), _planned("kvh-2"), _planned("kvh-1", "w1")],
                          {}, "planner", {})
    assert (pending, saved, finished) == ({}, [], [])
    assert "kvh-1" not in holdings
    # Distinct ids go on as before (no link here: each ends failed, counted).
    sent = await sender.send([_planned("kvh-1"), _planned("kvh-2")], {}, "planner", {})
    assert [r.action_id for r in sent] == ["kvh-1", "kvh-2"]
    assert [r.status for r in finished] == ["failed", "failed"]
