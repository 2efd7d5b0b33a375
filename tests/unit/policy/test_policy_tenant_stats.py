"""TenantStats: each tenant's own LearnedStats (the review's repro, per tenant)."""

from __future__ import annotations

from kvhint.router.policy import (
    MAX_GAP_KEYS,
    MAX_TENANTS,
    CompletionReadObserved,
    GapObserved,
    LearnedStats,
    ReturnObserved,
    TenantStats,
)

FRESH = LearnedStats()


def test_a_tenants_observations_move_its_own_predictions_only() -> None:
    stats = TenantStats(frozenset({"a", "b"}))
    before = stats.of("b").gap_quantile("search", 3, 0.9)
    assert before == FRESH.gap_quantile("search", 3, 0.9) > 400.0
    for _ in range(50):
        assert stats.apply("a", GapObserved("search", 3, 2.0))
        stats.apply("a", ReturnObserved(3, True))
        stats.apply("a", CompletionReadObserved(False))
    assert stats.of("a").gap_quantile("search", 3, 0.9) < 5.0
    b = stats.of("b")
    assert b.gap_quantile("search", 3, 0.9) == before
    assert b.return_probability(3) == FRESH.return_probability(3)
    assert b.completion_read_probability() == FRESH.completion_read_probability()
    assert b.gaps == {} and b.returns == {}  # the priors' object: never applied to


def test_the_key_cap_is_each_tenants_own() -> None:
    stats = TenantStats(frozenset({"a", "b"}))
    for n in range(MAX_GAP_KEYS):
        stats.apply("a", GapObserved(f"a_tool_{n}", 3, 5.0))
    assert len(stats.of("a").gaps) <= MAX_GAP_KEYS
    for _ in range(50):
        stats.apply("b", GapObserved("b_private_tool", 3, 300.0))
    assert "b_private_tool|*" in stats.of("b").gaps
    assert 300.0 <= stats.of("b").gap_quantile("b_private_tool", 3, 0.5) < 450.0


def test_only_listed_tenants_learn_and_unlisted_ones_are_bounded() -> None:
    listed = TenantStats(frozenset({"a"}))
    assert not listed.apply("x", GapObserved("search", 1, 2.0))
    assert not listed.apply(None, GapObserved("search", 1, 2.0))
    assert not listed.has_own("x") and listed.of("x").gaps == {}
    assert not listed.put("x", LearnedStats())
    anyone = TenantStats()
    for n in range(MAX_TENANTS + 5):
        anyone.apply(f"t{n}", GapObserved("search", 1, 2.0))
    assert sum(anyone.has_own(f"t{n}") for n in range(MAX_TENANTS + 5)) == MAX_TENANTS
