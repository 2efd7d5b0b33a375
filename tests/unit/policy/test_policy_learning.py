"""Learned statistics, outcome feedback and the holdings ledger: plain data, exact rules."""

from __future__ import annotations

import json

import pytest

from kvhint.router.policy import (
    ANY_TOOL,
    MAX_GAP_KEYS,
    USER_GAP,
    CompletionReadObserved,
    FeedbackConfig,
    GapObserved,
    Holdings,
    HoldingsLedger,
    LearnedStats,
    ReturnObserved,
    WorkerFeedback,
    apply_outcome,
    user_gap_kind,
)
from kvhint.router.policy.holdings import prefetch_scope
from kvhint.schemas import Amount, HintOutcome, OutcomeStatus


def test_gap_statistics_are_learnt_per_tool_and_depth_and_pooled_for_unseen_tools() -> None:
    stats = LearnedStats(decay=1.0)
    for _ in range(30):
        stats.apply(GapObserved("search", 1, 2.0))
        stats.apply(GapObserved("build", 3, 300.0))
    assert stats.gap_quantile("search", 1, 0.9) == pytest.approx(2.0, rel=0.5)
    assert 200.0 <= stats.gap_quantile("build", 3, 0.9) <= 450.0
    # "build" at an unseen depth falls back to its all-depth histogram.
    assert stats.gap_quantile("build", 7, 0.9) == stats.gap_quantile("build", 3, 0.9)
    # An unseen tool uses the pool of every tool at that depth.
    assert stats.gap_quantile("new_tool", 1, 0.5) == pytest.approx(2.0, rel=0.5)
    assert f"{ANY_TOOL}|1" in stats.gaps
    assert stats.gap_survival("build", 3, 1.0) == pytest.approx(1.0, abs=1e-3)
    # Past the longest gap seen the survival is small but never exactly 0: a session
    # away longer than ever before is unlikely, not impossible, to come back.
    assert 0.0 < stats.gap_survival("build", 3, 1000.0) < 0.05
    assert stats.gap_survival("build", 3, 1000.0) < stats.gap_survival("build", 3, 400.0)


def test_tool_names_beyond_the_bounds_are_learnt_under_the_pool_only() -> None:
    """Tool names are the model's: 5,000 distinct ones (or a 1,000-character one) no
    longer grow the statistics, and their saved row, without bound; their gaps still
    feed the pooled ANY_TOOL histogram every unknown tool falls back to. Names known
    before the bound keep learning."""
    stats = LearnedStats(decay=1.0)
    for _ in range(10):
        stats.apply(GapObserved("search", 1, 2.0))
    for number in range(5000):
        stats.apply(GapObserved(f"tool_{number}", 1, 30.0))
    stats.apply(GapObserved("x" * 1000, 1, 30.0))
    assert len(stats.gaps) <= MAX_GAP_KEYS
    assert not any(key.startswith("x" * 200) for key in stats.gaps)
    assert stats.gaps[f"{ANY_TOOL}|1"].total == 5011
    before = stats.gaps["search|1"].total
    stats.apply(GapObserved("search", 1, 2.0))
    assert stats.gaps["search|1"].total == before + 1
    assert len(json.dumps(stats.to_dict())) < 4 << 20


def test_return_probability_moves_from_the_prior_to_what_is_observed() -> None:
    stats = LearnedStats(decay=1.0, prior_strength=10.0)
    assert stats.return_probability(1) == pytest.approx(0.30)
    assert stats.return_probability(6) == pytest.approx(0.72)
    for i in range(90):
        stats.apply(ReturnObserved(1, i % 10 == 0))  # 10% come back
    assert stats.return_probability(1) == pytest.approx((9 + 3) / 100)
    # Tool gaps are counted apart from user gaps.
    assert stats.return_probability(1, "search") == pytest.approx(0.95)


def test_return_within_horizon_decays_with_idle_time() -> None:
    stats = LearnedStats(decay=1.0)
    for seconds in (10.0, 20.0, 40.0, 80.0, 160.0) * 4:
        stats.apply(GapObserved(USER_GAP, 2, seconds))
    values = [stats.return_within(USER_GAP, 2, idle, 60.0) for idle in (0, 30, 90, 200)]
    assert values == sorted(values, reverse=True)
    assert values[-1] < 0.01  # long past every gap seen: close to, never exactly, 0


def test_stats_round_trip_through_json_and_reject_unknown_versions() -> None:
    stats = LearnedStats()
    stats.apply(GapObserved("search", 2, 3.0))
    stats.apply(ReturnObserved(2, True))
    stats.apply(CompletionReadObserved(False))
    data = json.loads(json.dumps(stats.to_dict()))
    again = LearnedStats.from_dict(data)
    assert again.to_dict() == stats.to_dict()
    assert again.gap_quantile("search", 2, 0.5) == stats.gap_quantile("search", 2, 0.5)
    assert again.completion_read_probability() == stats.completion_read_probability() < 1.0
    with pytest.raises(ValueError, match="version"):
        LearnedStats.from_dict({**data, "version": 99})
    # Statistics saved before completion reads were learnt still load, at the prior.
    older = {k: v for k, v in data.items() if k != "completion_reads"}
    assert LearnedStats.from_dict(older).completion_read_probability() == 1.0
    with pytest.raises(ValueError, match="completion_reads"):
        LearnedStats.from_dict({**data, "completion_reads": {"read": 3}})


def test_stats_restore_refuses_values_learning_never_makes() -> None:
    """A stored row with a NaN, infinite or negative count, or a decay outside (0, 1] (a
    hand edit, a restore from elsewhere): before, it was taken, and a NaN made every
    retain priority computed from it raise. Now from_dict refuses it (ValueError: the
    router counts it ``learned_stats_unreadable``)."""
    stats = LearnedStats()
    stats.apply(GapObserved("search", 2, 3.0))
    stats.apply(ReturnObserved(2, True))
    data = json.loads(json.dumps(stats.to_dict()))
    gap_key, return_key = next(iter(data["gaps"])), next(iter(data["returns"]))
    histogram = data["gaps"][gap_key]

    def with_gap(**changes: object) -> dict:
        return {**data, "gaps": {**data["gaps"], gap_key: {**histogram, **changes}}}

    bad = [
        with_gap(total=float("nan")),
        with_gap(total=-1.0),
        with_gap(counts=[float("nan")] + histogram["counts"][1:]),
        with_gap(counts=[float("inf")] + histogram["counts"][1:]),
        with_gap(counts=[-2.0] + histogram["counts"][1:]),
        {**data, "returns": {**data["returns"], return_key: [float("nan"), 1.0]}},
        {**data, "returns": {**data["returns"], return_key: [3.0, -1.0]}},
        {**data, "returns": {**data["returns"], return_key: [3.0]}},
        {**data, "completion_reads": [float("inf"), 0.0]},
        {**data, "decay": 0.0}, {**data, "decay": 1.5}, {**data, "decay": -0.5},
        {**data, "decay": float("nan")},
    ]
    for row in bad:
        with pytest.raises(ValueError, match="learned stats"):
            LearnedStats.from_dict(row)
    assert LearnedStats.from_dict({**data, "decay": 1.0}).decay == 1.0


def test_completion_reads_start_at_the_prior_and_follow_what_is_seen() -> None:
    stats = LearnedStats(decay=1.0)
    assert stats.completion_read_probability() == 1.0  # vLLM caches output blocks
    for _ in range(10):
        stats.apply(CompletionReadObserved(False))
    assert stats.completion_read_probability() == 0.5  # the prior weighs 10 observations
    stats.apply(CompletionReadObserved(False))
    assert stats.completion_read_probability() < 0.5
    for _ in range(30):
        stats.apply(CompletionReadObserved(True))
    assert stats.completion_read_probability() > 0.7


def _outcome(kind: str, status: OutcomeStatus, requested: int = 0, applied: int = 0,
             action_id: str = "a1") -> HintOutcome:
    return HintOutcome(message_id="m", action_id=action_id, action_type=kind, worker_id="w0",
                       status=status, reason="r", requested=Amount(requested),
                       applied=Amount(applied), at=0.0)


def test_feedback_rules() -> None:
    config = FeedbackConfig(min_pin_scale=0.25, pin_recovery=2.0, reject_disable_after=2)
    fb = WorkerFeedback("w0")
    fb = apply_outcome(fb, _outcome("kv.pin", OutcomeStatus.CLIPPED, 10, 1), config)
    assert fb.pin_ask_scale == 0.25  # floored
    fb = apply_outcome(fb, _outcome("kv.pin", OutcomeStatus.ACCEPTED, 3, 3), config)
    assert fb.pin_ask_scale == 0.5
    fb = apply_outcome(fb, _outcome("kv.demote", OutcomeStatus.REJECTED), config)
    fb = apply_outcome(fb, _outcome("kv.demote", OutcomeStatus.MISSING), config)
    assert fb.allows("kv.demote")  # one rejection, and missing says nothing
    fb = apply_outcome(fb, _outcome("kv.demote", OutcomeStatus.REJECTED), config)
    assert not fb.allows("kv.demote") and fb.disabled_reasons == {"kv.demote": "r"}
    assert WorkerFeedback.from_dict(json.loads(json.dumps(fb.to_dict()))) == fb


def test_ledger_supersedes_per_scope_settles_and_expires() -> None:
    ledger = HoldingsLedger()
    ledger.record(action_id="p1", worker_id="w0", tenant="t", scope="t/s", action_type="kv.pin",
                  blocks=8, expires_at=10.0)
    ledger.record(action_id="r1", worker_id="w0", tenant="t", scope="t/x",
                  action_type="kv.retain", blocks=5, expires_at=100.0)
    assert ledger.worker("w0") == Holdings(8, 5) and ledger.tenant("t") == Holdings(8, 5)
    # A newer protection of the same session replaces the pin.
    ledger.record(action_id="r2", worker_id="w0", tenant="t", scope="t/s",
                  action_type="kv.retain", blocks=8, expires_at=50.0)
    assert ledger.worker("w0") == Holdings(0, 13)
    ledger.settle(_outcome("kv.retain", OutcomeStatus.CLIPPED, 8, 3, action_id="r2"))
    assert ledger.worker("w0") == Holdings(0, 8)
    assert ledger.expire(60.0) == 1 and ledger.worker("w0") == Holdings(0, 5)
    ledger.settle(_outcome("kv.retain", OutcomeStatus.REJECTED, action_id="r1"))
    assert ledger.worker("w0") == Holdings() and len(ledger) == 0
    # A Demote releases the scope's holding.
    ledger.record(action_id="r3", worker_id="w1", tenant=None, scope="t/y",
                  action_type="kv.retain", blocks=4, expires_at=100.0)
    # A Prefetch or Share of the session does not: the plugin keeps its claims through
    # them (a session moving back to a worker that still retains it, say). A Prefetch's
    # own retain (what it brought into G1, until its deadline) is a holding of its own,
    # one per action (tests/unit/policy/test_holdings_prefetch_claims.py).
    ledger.record(action_id="s1", worker_id="w1", tenant=None, scope="t/y",
                  action_type="kv.share", blocks=4, expires_at=0.0)
    assert ledger.worker("w1") == Holdings(0, 4) and ledger.holds("w1", "t/y")
    ledger.record(action_id="f1", worker_id="w1", tenant=None, scope="t/y",
                  action_type="kv.prefetch", blocks=6, expires_at=90.0, keys=range(6))
    assert ledger.worker("w1") == Holdings(0, 10)
    assert ledger.holds("w1", prefetch_scope("t/y", "f1")) and ledger.holds("w1", "t/y")
    ledger.settle(_outcome("kv.prefetch", OutcomeStatus.ACCEPTED, 6, 5, action_id="f1"))
    assert ledger.worker("w1") == Holdings(0, 9)
    assert ledger.expire(91.0) == 1 and ledger.worker("w1") == Holdings(0, 4)
    # One that ends clipped at its deadline (with part in G1) retains nothing: the answer
    # comes past its TTL (tests/unit/policy/test_holdings_clipped_prefetch.py: the other
    # clipped ones).
    ledger.record(action_id="f2", worker_id="w1", tenant=None, scope="t/y",
                  action_type="kv.prefetch", blocks=6, expires_at=1e9)
    ledger.settle(_outcome("kv.prefetch", OutcomeStatus.CLIPPED, 6, 3, action_id="f2"),
                  now=1e9)
    assert ledger.worker("w1") == Holdings(0, 4) and ledger.holds("w1", "t/y")
    ledger.record(action_id="d1", worker_id="w1", tenant=None, scope="t/y",
                  action_type="kv.demote", blocks=4, expires_at=0.0)
    assert ledger.worker("w1") == Holdings() and not ledger.holds("w1", "t/y")


def test_ledger_shrinks_a_holding_by_what_the_worker_let_go_unasked() -> None:
    ledger = HoldingsLedger()
    ledger.record(action_id="r1", worker_id="w0", tenant="t", scope="t/s",
                  action_type="kv.retain", blocks=6, expires_at=100.0)
    ledger.record(action_id="p1", worker_id="w0", tenant="t", scope="t/x", action_type="kv.pin",
                  blocks=4, expires_at=100.0)
    ledger.released("r1", 2)  # displaced: 2 of 6 left
    assert ledger.worker("w0") == Holdings(4, 2) and ledger.tenant("t") == Holdings(4, 2)
    ledger.released("r1", 5)  # never grows back
    assert ledger.worker("w0") == Holdings(4, 2)
    ledger.released("p1", 0)  # reset: the pin is over
    assert ledger.worker("w0") == Holdings(0, 2) and len(ledger) == 1
    ledger.released("unknown", 0)  # an action this router never recorded: nothing
    ledger.released("r1", 0)
    assert ledger.worker("w0") == Holdings() and ledger.tenant("t") == Holdings()
    assert len(ledger) == 0


def test_ledger_stays_whole_when_an_action_id_comes_again() -> None:
    # Ids are unique by construction; if one ever repeats (a restored holding and a new
    # action), the ledger must not keep a scope pointing at a holding it dropped.
    ledger = HoldingsLedger()
    ledger.record(action_id="x", worker_id="w0", tenant="t", scope="t/a",
                  action_type="kv.retain", blocks=4, expires_at=100.0)
    ledger.record(action_id="x", worker_id="w0", tenant="t", scope="t/b",
                  action_type="kv.retain", blocks=2, expires_at=100.0)
    assert ledger.worker("w0") == Holdings(0, 2) and len(ledger) == 1
    ledger.record(action_id="y", worker_id="w0", tenant="t", scope="t/a",
                  action_type="kv.pin", blocks=3, expires_at=100.0)
    assert ledger.worker("w0") == Holdings(3, 2)


def test_a_restarted_engine_holds_nothing() -> None:
    ledger = HoldingsLedger()
    for action_id, worker in (("a", "w0"), ("b", "w0"), ("c", "w1")):
        ledger.record(action_id=action_id, worker_id=worker, tenant="t", scope=f"t/{action_id}",
                      action_type="kv.retain", blocks=2, expires_at=100.0)
    assert ledger.forget_worker("w0") == 2
    assert ledger.worker("w0") == Holdings() and ledger.worker("w1") == Holdings(0, 2)
    assert ledger.tenant("t") == Holdings(0, 2) and len(ledger) == 1


def test_tempo_kinds_learn_their_own_returns_and_fall_back_to_the_pooled_user_figures() -> None:
    stats = LearnedStats(decay=1.0)
    fast, slow = user_gap_kind(10.0), user_gap_kind(1000.0)
    # Before anything is seen a tempo kind predicts what the pooled user kind does.
    assert stats.return_probability(2, fast) == stats.return_probability(2, USER_GAP)
    assert stats.gap_quantile(fast, 2, 0.5) == stats.gap_quantile(USER_GAP, 2, 0.5)
    for _ in range(40):
        stats.apply(ReturnObserved(2, True, fast))
        stats.apply(GapObserved(fast, 2, 5.0))
        stats.apply(ReturnObserved(2, False, slow))
    # The pooled user figures saw both (half returned, smoothed toward the depth prior)
    # and are each tempo's prior, with the usual strength.
    pooled = stats.return_probability(2, USER_GAP)
    assert pooled == pytest.approx((40 + 0.45 * 10) / (80 + 10))
    assert stats.return_probability(2, fast) == pytest.approx((40 + pooled * 10) / (40 + 10))
    assert stats.return_probability(2, slow) == pytest.approx((0 + pooled * 10) / (40 + 10))
    assert stats.gap_quantile(user_gap_kind(100.0), 2, 0.5) == stats.gap_quantile(fast, 2, 0.5)
    assert stats.returns[f"{USER_GAP}|2"].finished == 80


def test_hit_density_is_remembered_only_until_the_next_observation() -> None:
    """hit_density is memoised (the shared-prefix scan asks it for every in-flight
    session); every observation must still show in the next answer."""
    stats = LearnedStats(decay=1.0)
    before = stats.hit_density(USER_GAP, 2, 0.0, 100.0)
    assert stats.hit_density(USER_GAP, 2, 0.0, 100.0) == before
    fresh = LearnedStats(decay=1.0)
    for _ in range(20):
        stats.apply(GapObserved(USER_GAP, 2, 5.0))
        fresh.apply(GapObserved(USER_GAP, 2, 5.0))
    after = stats.hit_density(USER_GAP, 2, 0.0, 100.0)
    assert after > before  # sessions seen back within seconds are worth more
    assert after == fresh.hit_density(USER_GAP, 2, 0.0, 100.0)
    # Depths in one bucket share a value; other idle times are their own.
    assert stats.hit_density(USER_GAP, 9, 0.0, 100.0) == stats.hit_density(USER_GAP, 8, 0.0,
                                                                            100.0)
    assert stats.hit_density(USER_GAP, 2, 30.0, 100.0) != after
