"""The ``scope`` and ``expires_at`` the store derives for a hint action row written
without them (by a router of the store's first schema) are the ones the router writes
now: checked against what the planner and the sessions API send, so that a change to
how they name scopes or compute TTLs fails here instead of silently restoring holdings
that never end or never supersede."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from kvhint.router.policy import (
    FinishReason,
    GapObserved,
    LearnedStats,
    PlannedAction,
    PlannerConfig,
    PlannerContext,
    ResponseFinished,
    SessionChain,
    SessionEnded,
    TurnRouted,
    WorkerPlanView,
    find_shared_prefixes,
    plan_response_finished,
    plan_session_end,
    plan_shared_prefixes,
    plan_turn_routed,
)
from kvhint.router.policy.holdings import prefetch_held_until
from kvhint.router.service.hint_records import API_SOURCE, PLANNER_SOURCE, SentAction
from kvhint.router.service.hint_api_actions import held_for_s, holding_scope
from kvhint.router.store.legacy_rows import with_derived_columns, worker_budgets
from kvhint.schemas import Budgets, KvHintAction, parse_action
from kvhint.schemas.hints import OWNER_VERSION, ParsedAction

BS = 16
NOW = 1_700_000_000.0
BUDGETS = Budgets(max_pinned_blocks=100, max_pin_ttl_s=300.0, max_retained_blocks=1000,
                  max_retain_ttl_s=3600.0)


def _ctx(**config: float) -> PlannerContext:
    stats = LearnedStats()
    for _ in range(20):
        stats.apply(GapObserved("search", 1, 4.0))
    worker = WorkerPlanView("w0", BS, BUDGETS, frozenset({"kv.retain", "kv.pin"}))
    return PlannerContext(now=NOW, stats=stats, workers={"w0": worker},
                          rng=random.Random(1), config=replace(PlannerConfig(), **config))


def _row_without_columns(planned: PlannedAction, source: str, session_id: str | None
                         ) -> dict:
    """The row the router writes for ``planned`` when it sends it (HintDispatcher.send:
    sent at the planning time here), less the two columns a 0001 router did not write."""
    record = SentAction(
        action_id=planned.action.action_id, message_id="m1", worker_id=planned.worker_id,
        tenant=planned.tenant, session_id=session_id, action_type=planned.action_type,
        source=source, trigger=planned.reason, payload=planned.action.payload,
        status="accepted", created_at=NOW, updated_at=NOW, requested_blocks=planned.blocks)
    return record.row() | {"scope": None, "expires_at": None}


def _planner_actions() -> list[PlannedAction]:
    ctx = _ctx(ended_retain_ttl_s=30.0)
    session = plan_turn_routed(ctx, None, TurnRouted("t/s", "t", "w0", 8 * BS, NOW)).session
    actions = []
    for reason, tools in ((FinishReason.TOOL_CALLS, ("search",)), (FinishReason.STOP, ())):
        finished = plan_response_finished(ctx, session, ResponseFinished(
            "t/s", reason, 8 * BS, 100, NOW, tools))
        actions += finished.actions
    waiting = finished.session
    actions += plan_session_end(ctx, waiting, SessionEnded("t/s", NOW)).actions
    # Prefixes of 6 and 3 blocks that 4 sessions share: counted at 4 and 2 blocks.
    for length in (6, 3):
        shared = tuple(range(100, 100 + length))
        chains = [SessionChain("w0", "t", (*shared, 1000 + n), 1.0) for n in range(4)]
        actions += plan_shared_prefixes(ctx, find_shared_prefixes(chains, 3, {}))
    return actions


def test_planner_actions_get_the_scope_and_end_they_were_sent_with() -> None:
    actions = _planner_actions()
    assert [a.action_type for a in actions] == [
        "kv.pin", "kv.retain", "kv.retain", "kv.retain", "kv.retain"]
    assert [len(a.action.payload["target"].get("block_hashes", ())) for a in actions] \
        == [0, 0, 0, 6, 3]
    for planned in actions:
        session_id = None if planned.scope.startswith("prefix:") else "s"
        row = with_derived_columns(_row_without_columns(planned, PLANNER_SOURCE, session_id),
                                   BUDGETS)
        assert (row["scope"], row["expires_at"]) == (planned.scope, planned.expires_at), \
            planned


API_PAYLOADS = [
    ("kv.pin", {"target": {"session_id": "t/s"}, "ttl_s": 900.0}),  # over the maximum
    ("kv.pin", {"target": {"session_id": "t/s"}}),  # 60 s by default
    ("kv.pin", {"target": {"session_id": "t/s", "prefix_tokens": 32}, "ttl_s": 20.0}),
    ("kv.pin", {"target": {"block_hashes": [1, 2, 3]}, "ttl_s": 40.0}),
    ("kv.retain", {"target": {"session_id": "t/s"}, "ttl_s": 7200.0}),  # over the maximum
    ("kv.retain", {"target": {"session_id": "t/s"}, "priority": 10}),  # the maximum
    ("kv.retain", {"target": {"session_id": "t/s", "prefix_tokens": 32}, "ttl_s": 20.0}),
    ("kv.retain", {"target": {"block_hashes": [1, 2, 3]}, "ttl_s": 40.0}),
    ("kv.prefetch", {"target": {"session_id": "t/s"}, "deadline_s": 30.0}),
    ("kv.prefetch", {"target": {"session_id": "t/s"}, "deadline_s": 7200.0}),  # over it
]


def test_a_prefetch_is_held_no_longer_than_the_workers_retain_maximum() -> None:
    """The plugin retains a Prefetch's blocks as a Retain from its answer, clipped to
    ``max_retain_ttl_s`` (executor._retain), until its deadline: sent, it may hold until
    its deadline (its answer may come any time until then); answered, no longer than
    ``max_retain_ttl_s`` past the answer (test_service_prefetch_hold_end.py)."""
    for deadline, answered_at, held in ((30.0, 0.0, 30.0), (7200.0, 0.0, 3600.0),
                                        (7200.0, 5000.0, 7200.0)):
        parsed = parse_action(KvHintAction("kva-p", "kv.prefetch", "1.0", {
            "target": {"session_id": "t/s"}, "deadline_s": deadline}))
        assert held_for_s(parsed.payload, BUDGETS) == deadline
        assert prefetch_held_until(held_for_s(parsed.payload, BUDGETS), answered_at,
                                   BUDGETS.max_retain_ttl_s) == held


@pytest.mark.parametrize("owner", [None, "agent"])
@pytest.mark.parametrize(("action_type", "payload"), API_PAYLOADS)
def test_api_actions_get_the_scope_and_end_they_were_sent_with(
        action_type: str, payload: dict, owner: str | None) -> None:
    """As the sessions API sends them: the target bound to the session (``t/s``), the
    agent as owner where the worker takes it; held as the worker clips them."""
    payload = payload | ({"owner": owner} if owner else {})
    action = KvHintAction("kva-1", action_type, OWNER_VERSION, payload)
    parsed = parse_action(action)
    assert isinstance(parsed, ParsedAction), parsed
    planned = PlannedAction("w0", action, holding_scope(action, "t/s"), "t", 4,
                            NOW + held_for_s(parsed.payload, BUDGETS), "api")
    row = with_derived_columns(_row_without_columns(planned, API_SOURCE, "s"), BUDGETS)
    # A Prefetch answered (at NOW, the row says) ends as the router ends it at an answer.
    end = (prefetch_held_until(planned.expires_at, NOW, BUDGETS.max_retain_ttl_s)
           if action_type == "kv.prefetch" else planned.expires_at)
    assert (row["scope"], row["expires_at"]) == (planned.scope, end)


def test_what_cannot_be_derived_stays_missing_and_stored_values_are_kept() -> None:
    pin = _planner_actions()[0]
    row = _row_without_columns(pin, PLANNER_SOURCE, "s")
    # A Retain without TTL on a worker whose maximum is not known: no end.
    retain = row | {"action_type": "kv.retain", "source": API_SOURCE,
                    "payload": {"target": {"session_id": "t/s"}}}
    assert with_derived_columns(retain, None)["expires_at"] is None
    assert with_derived_columns(retain, None)["scope"] == "t/s"
    assert with_derived_columns(retain, BUDGETS)["expires_at"] == NOW + 3600.0
    # A payload that does not parse, an unknown type: nothing.
    for broken in ({"payload": {"ttl_s": 5.0}}, {"action_type": "kv.unknown"}):
        derived = with_derived_columns(row | broken, BUDGETS)
        assert (derived["scope"], derived["expires_at"]) == (None, None)
    # A shared prefix's Retain of no tenant: no scope (its key names the tenant).
    prefix = row | {"tenant": None, "payload": {"target": {"block_hashes": [1]}}}
    assert with_derived_columns(prefix, BUDGETS)["scope"] is None
    stored = row | {"scope": "kept", "expires_at": 5.0}
    assert with_derived_columns(stored, BUDGETS) is stored
    half = with_derived_columns(row | {"scope": "kept"}, BUDGETS)
    assert (half["scope"], half["expires_at"]) == ("kept", pin.expires_at)


def test_worker_budgets_come_from_the_last_heartbeat_stored() -> None:
    rows = [{"worker_id": "w0", "status": {"budgets": {
                "max_pinned_blocks": 1, "max_pin_ttl_s": 2.0, "max_retained_blocks": 3,
                "max_retain_ttl_s": 4.0}}},
            {"worker_id": "w1", "status": None},
            {"worker_id": "w2", "status": {"budgets": {"max_pin_ttl_s": "soon"}}}]
    assert worker_budgets(rows) == {"w0": Budgets(max_pinned_blocks=1, max_pin_ttl_s=2.0,
                                                  max_retained_blocks=3,
                                                  max_retain_ttl_s=4.0)}
