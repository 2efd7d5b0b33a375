"""What the router's metrics take from outside stays bounded, and what a response loses is
named: a hold release's action type from the wire, a forgotten worker's totals, a
response's missing usage."""

from __future__ import annotations

import time
import typing

from kvhint.router.policy import PlannerConfig
from kvhint.router.service.hint_dispatch import HintDispatcher, SentAction
from kvhint.router.service.metrics import RouterMetrics, TrafficTotals
from kvhint.router.service.response_scan import ResponseObservation, SseRelay
from kvhint.router.service.sessions import ACTIVE, ENDED, TOOL_GAP, SessionState
from kvhint.router.service.timeline import Timeline
from kvhint.router.service.workers import WorkerRegistry
from kvhint.schemas import Amount, HoldRelease, ReleaseReason, Subjects


def _row(action_id: str, action_type: str, status: str) -> dict:
    """A stored action on a session of its own (``default/<action_id>``)."""
    now = time.time()
    scope = f"default/{action_id}"
    return SentAction(action_id=action_id, message_id="m", worker_id="w0", tenant="default",
                      session_id=action_id, action_type=action_type, source="planner",
                      trigger="gap", payload={"target": {"session_id": scope}},
                      status=status, created_at=now, updated_at=now, requested_blocks=8,
                      applied_blocks=8, scope=scope, expires_at=now + 600).row()


def _release(action_id: str, action_type: str) -> HoldRelease:
    return HoldRelease(action_id=action_id, action_type=action_type,
                       session_id=f"default/{action_id}", reason=ReleaseReason.DISPLACED,
                       released=Amount(2, 8), held=Amount(6, 24))


def test_a_hold_releases_action_label_is_the_routers_own_or_bounded() -> None:
    """Before, the label was the release's action_type as the wire had it: any string a
    plugin sent became a series of its own. A type not a hint's is applied to no action
    (not even one of its id) and makes no series: it is a drop, counted."""
    metrics = RouterMetrics()
    hints = HintDispatcher(None, Subjects("t"), WorkerRegistry([("w0", "http://w0")]), None,
                           metrics, PlannerConfig(), seed=1)
    # One still pending (the router's record), two answered and held (no record).
    hints.restore([], [_row("kvh-pending", "kv.pin", "pending")],
                  held=[_row("kvh-held", "kv.retain", "accepted"),
                        _row("kvh-held-2", "kv.retain", "accepted")])
    hints.on_release(_release("kvh-pending", "kv.pin-from-a-plugin-bug"))
    hints.on_release(_release("kvh-held", "kv.retain"))
    hints.on_release(_release("kvh-held-2", "x" * 200))
    series = {(s.labels["action"], s.value)
              for family in metrics.hold_releases.collect() for s in family.samples
              if s.name.endswith("_total")}
    assert series == {("kv.retain", 2.0)}
    assert metrics.drops.labels("release_unknown_type")._value.get() == 2


def test_a_forgotten_workers_totals_are_kept_apart_and_the_timeline_starts_it_afresh(
        ) -> None:
    metrics = RouterMetrics()
    timeline = Timeline()
    metrics.record_request("chat", "w1", 200)
    metrics.record_usage("w1", 100, 40, None)
    timeline.sample(1.0, metrics.totals, {})
    metrics.forget_worker("w1")
    assert "w1" not in metrics.totals
    assert (metrics.retired.requests, metrics.retired.prompt_tokens) == (1, 100)
    assert 'worker="w1"' not in metrics.render().decode()
    timeline.sample(2.0, metrics.totals, {})
    # Heard again under the same id: its new traffic, not minus its old totals.
    metrics.record_request("chat", "w1", 200)
    metrics.record_usage("w1", 10, 5, None)
    point = timeline.sample(3.0, metrics.totals, {})
    assert (point.requests, point.prompt_tokens, point.by_worker["w1"]) == (1, 10, (10, 5))
    assert isinstance(metrics.retired, TrafficTotals)


def test_what_a_successful_response_lost_is_named() -> None:
    def observed(*payloads: bytes) -> ResponseObservation:
        observation = ResponseObservation()
        for payload in payloads:
            observation.observe_json(payload)
        return observation

    usage = b'{"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 1}}'
    answer = b'{"choices": [{"finish_reason": "stop", "message": {}}]}'
    assert observed(answer, usage).usage_lost(200) is None
    assert observed(answer).usage_lost(200) == "response_usage_missing"
    assert observed(b"{not json").usage_lost(200) == "response_unparsable"
    assert observed(b"{not json", usage).usage_lost(200) == "response_unparsable"
    # An error answer has no usage to lose: by status, or as an event in a stream.
    assert observed(b'{"error": {"message": "bad"}}').usage_lost(400) is None
    assert observed(b'{"error": {"message": "bad", "code": 400}}').usage_lost(200) is None
    assert observed(b"{not json").usage_lost(502) is None
    # A stream's error event is read (not skipped as a plain delta).
    relay = SseRelay(ResponseObservation(), strip_usage_chunk=False)
    relay.feed(b'data: {"error": {"message": "oops", "code": 500}}\n\ndata: [DONE]\n\n')
    assert relay.observation.usage_lost(200) is None


def test_the_session_states_the_admin_api_takes_are_the_registrys() -> None:
    assert set(typing.get_args(SessionState)) == {ACTIVE, TOOL_GAP, ENDED}


def test_the_hint_status_filter_admits_every_status_an_action_can_have() -> None:
    from kvhint.router.service.hint_records import EXPIRED, FAILED, PENDING, HintStatus
    from kvhint.schemas import OutcomeStatus

    assert set(typing.get_args(HintStatus)) == {PENDING, EXPIRED, FAILED,
                                                 *(s.value for s in OutcomeStatus)}
