"""SplitFeedback: what a worker cannot do is every tenant's; the rest of what planner
outcomes teach is the tenant's own (the review's repro: tenant b's rejections turned a
hint type off on a worker for tenant a)."""

from __future__ import annotations

from kvhint.engine_plugin.inbound_checks import NO_PREFIX_CACHE_REASON
from kvhint.router.policy import SplitFeedback, WorkerFeedback, feedback_from_stored
from kvhint.schemas import (
    Amount,
    HintOutcome,
    KvHintAction,
    OutcomeStatus,
    decode_hints,
    parse_action,
)
from kvhint.schemas.outcomes import is_capability_rejection

PIN, RETAIN, DEMOTE = "kv.pin", "kv.retain", "kv.demote"


def _outcome(kind: str, status: OutcomeStatus, reason: str = "", requested: int = 8,
             applied: int = 8) -> HintOutcome:
    return HintOutcome(message_id="m", action_id="x", action_type=kind, worker_id="w0",
                       status=status, reason=reason, requested=Amount(requested, 0),
                       applied=Amount(applied, 0), at=0.0)


def _learn(feedback: SplitFeedback, tenant: str, *outcomes: HintOutcome) -> SplitFeedback:
    for outcome in outcomes:
        feedback = feedback.learn(tenant, outcome)
    return feedback


def test_a_tenants_rejections_and_clipped_pins_steer_its_own_planning_only() -> None:
    """b's Retains rejected for what b's session named, b's Pins clipped to a quarter:
    Retain is off and the pin ask scale a quarter for b; a (and a tenant never heard)
    still sends Retains to w0 and asks for its whole pin room. Before, one WorkerFeedback
    per worker took both from b's outcomes for every tenant."""
    own = "prefix_tokens 16 is less than one block (32 tokens)"
    feedback = _learn(SplitFeedback("w0"), "b",
                      _outcome(RETAIN, OutcomeStatus.REJECTED, own),
                      _outcome(RETAIN, OutcomeStatus.REJECTED, own),
                      _outcome(PIN, OutcomeStatus.CLIPPED, "pin budget", 8, 2))
    b = feedback.view("b")
    assert not b.allows(RETAIN) and b.pin_ask_scale == 0.25
    for tenant in ("a", "never-heard", None):
        view = feedback.view(tenant)
        assert view.allows(RETAIN) and view.pin_ask_scale == 1.0
    # a's own outcomes move a's part only.
    feedback = _learn(feedback, "a", _outcome(RETAIN, OutcomeStatus.REJECTED, own))
    assert feedback.view("a").rejections_in_row == {RETAIN: 1}
    assert feedback.view("b").rejections_in_row == {RETAIN: 2}


def test_what_the_worker_cannot_do_is_off_for_every_tenant() -> None:
    """Rejections whose reason says the worker cannot do the action at all (the
    schemas' own reasons for an unknown type, version or protocol; the plugin's for
    prefix caching off) turn the type off for every tenant, those never heard
    included; no tenant's accepted outcome turns it on again (only a new engine does:
    the caller starts afresh at a new epoch)."""
    unknown_type = parse_action(KvHintAction("x", "kv.teleport", "1.0", {}))
    old_version = parse_action(KvHintAction("x", PIN, "9.9", {}))
    protocol = decode_hints(b'{"protocol_version": "7", "message_id": "m", "actions": '
                            b'[{"action_id": "x", "action_type": "kv.pin", '
                            b'"action_version": "1.0", "payload": {}}]}').actions[0]
    reasons = [unknown_type.reason, old_version.reason, protocol.reason,  # type: ignore[union-attr]
               NO_PREFIX_CACHE_REASON]
    for reason in reasons:
        assert is_capability_rejection(reason), reason
        feedback = _learn(SplitFeedback("w0"), "b", *[_outcome(PIN, OutcomeStatus.REJECTED,
                                                               reason)] * 2)
        for tenant in ("a", "b", "never-heard", None):
            assert not feedback.view(tenant).allows(PIN), (reason, tenant)
        feedback = _learn(feedback, "a", _outcome(PIN, OutcomeStatus.ACCEPTED))
        assert not feedback.view("a").allows(PIN)
    # What a tenant's own actions cause is not the worker's.
    for reason in ("prefix_tokens 16 is less than one block (32 tokens)",
                   "invalid payload: target names 900 block hashes", "share destination "
                   "is this worker", "superseded by kvh-1 for the session while waiting "
                   "for host copies; nothing changed", "a newer plugin's reason"):
        assert not is_capability_rejection(reason), reason


def test_outcomes_that_teach_nothing_leave_the_feedback_as_it_is() -> None:
    feedback = SplitFeedback("w0")
    for outcome in (_outcome(PIN, OutcomeStatus.MISSING),
                    _outcome(PIN, OutcomeStatus.REJECTED, "worker inbox full (256)"),
                    _outcome(PIN, OutcomeStatus.REJECTED, "expired: expires_at 1.0")):
        assert feedback.learn("a", outcome) is feedback
    assert feedback.learn(None, _outcome(PIN, OutcomeStatus.REJECTED, "no")) is feedback


def test_stored_feedback_round_trips_and_a_pooled_row_keeps_the_workers_part_only() -> None:
    """The row keeps the worker's part at the top level (a router from before the split
    reads it as the worker's feedback) and each tenant's under ``tenants``. A row from
    before the split pooled every tenant's outcomes: only what the worker cannot do is
    kept of it, and the caller is told the rest was left out."""
    own = "prefix_tokens 16 is less than one block (32 tokens)"
    feedback = _learn(SplitFeedback("w0"), "b",
                      *[_outcome(DEMOTE, OutcomeStatus.REJECTED, NO_PREFIX_CACHE_REASON)] * 2,
                      *[_outcome(RETAIN, OutcomeStatus.REJECTED, own)] * 2)
    stored = feedback.to_dict()
    assert stored["disabled_actions"] == [DEMOTE] and stored["pin_ask_scale"] == 1.0
    assert WorkerFeedback.from_dict(stored).disabled_actions == {DEMOTE}
    assert feedback_from_stored(stored) == (feedback, False)
    pooled = {**WorkerFeedback("w0", pin_ask_scale=0.25,
                               disabled_actions=frozenset({DEMOTE, RETAIN}),
                               disabled_reasons={DEMOTE: NO_PREFIX_CACHE_REASON, RETAIN: own},
                               rejections_in_row={RETAIN: 2}).to_dict()}
    restored, left_out = feedback_from_stored(pooled)
    assert left_out and restored.tenants == {}
    assert restored.view("a").disabled_actions == {DEMOTE}
    assert restored.view("a").pin_ask_scale == 1.0
    clean = WorkerFeedback("w0", disabled_actions=frozenset({DEMOTE}),
                           disabled_reasons={DEMOTE: NO_PREFIX_CACHE_REASON}).to_dict()
    assert feedback_from_stored(clean)[1] is False


def test_a_tenants_dict_holds_the_workers_part_and_its_own_only() -> None:
    """What a tenant admin's workers view shows (admin_api): the stored row's shape, the
    worker's capability part at the top level and, under ``tenants``, that tenant's own
    part alone (none yet: empty), never another tenant's."""
    own = "prefix_tokens 16 is less than one block (32 tokens)"
    feedback = _learn(SplitFeedback("w0"), "b",
                      *[_outcome(DEMOTE, OutcomeStatus.REJECTED, NO_PREFIX_CACHE_REASON)] * 2,
                      *[_outcome(RETAIN, OutcomeStatus.REJECTED, f"b's {own}")] * 2)
    feedback = _learn(feedback, "a", _outcome(PIN, OutcomeStatus.CLIPPED, "", 8, 4))
    whole = feedback.to_dict()
    a = feedback.to_dict_of("a")
    assert {k: v for k, v in a.items() if k != "tenants"} == {
        k: v for k, v in whole.items() if k != "tenants"}
    assert a["disabled_actions"] == [DEMOTE]
    assert a["tenants"] == {"a": whole["tenants"]["a"]}
    assert a["tenants"]["a"]["pin_ask_scale"] == 0.5
    assert "b's" not in str(a)
    assert feedback.to_dict_of("never-heard")["tenants"] == {}
