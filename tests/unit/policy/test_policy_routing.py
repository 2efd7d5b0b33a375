"""Routing policies: pure decisions from frozen contexts."""

from __future__ import annotations

import random

import pytest

from kvhint.router.policy import (
    NoWorkerAvailable,
    Overlap,
    RecentLoad,
    RouteRequest,
    RoutingConfig,
    RoutingContext,
    RoutingPolicy,
    SessionPlacement,
    WorkerLoad,
    cached_tokens,
    decay_recent,
    route,
)

BS = 512


def _ctx(policy: RoutingPolicy, *loads: WorkerLoad, session: SessionPlacement | None = None,
         **config: object) -> RoutingContext:
    """The caps at these tests' small loads, without the absolute floor unless a test asks
    for it (the floor: tests/unit/service/test_service_planning.py)."""
    config.setdefault("balance_floor_tokens", 0.0)
    return RoutingContext(workers=tuple(loads), config=RoutingConfig(policy=policy, **config),
                          session=session)


def _req(prompt: int = 8 * BS, seq: int = 0, session: str | None = "t/s",
         **overlaps: Overlap) -> RouteRequest:
    return RouteRequest(prompt, BS, session, seq, overlaps)


def test_round_robin_cycles_by_request_seq_and_ranks_the_rest_as_fallbacks() -> None:
    ctx = _ctx(RoutingPolicy.ROUND_ROBIN, WorkerLoad("w1"), WorkerLoad("w0"), WorkerLoad("w2"))
    chosen = [route(ctx, _req(seq=i), random.Random(0)).worker_id for i in range(4)]
    assert chosen == ["w0", "w1", "w2", "w0"]
    decision = route(ctx, _req(seq=1), random.Random(0))
    assert decision.fallbacks == ("w2", "w0")


def test_session_affinity_sticks_and_falls_back_to_least_busy_when_its_worker_is_down() -> None:
    loads = (WorkerLoad("w0", active_requests=5), WorkerLoad("w1", active_requests=1))
    sticky = _ctx(RoutingPolicy.SESSION_AFFINITY, *loads, session=SessionPlacement("w0", 3))
    assert route(sticky, _req(), random.Random(0)).worker_id == "w0"
    down = (WorkerLoad("w0", healthy=False, active_requests=5), loads[1])
    ctx = _ctx(RoutingPolicy.SESSION_AFFINITY, *down, session=SessionPlacement("w0", 3))
    decision = route(ctx, _req(), random.Random(0))
    assert (decision.worker_id, decision.fallbacks, decision.reason) == ("w1", (), "least_busy")


def test_kv_aware_prefers_overlap_and_weighs_active_decode_blocks() -> None:
    ctx = _ctx(RoutingPolicy.KV_AWARE, WorkerLoad("w0"), WorkerLoad("w1"))
    decision = route(ctx, _req(w1=Overlap(6)), random.Random(0))
    assert decision.worker_id == "w1"
    assert decision.predicted_cached_tokens == 6 * BS
    # 6 blocks of overlap are worth less than 10 blocks of decode load.
    busy = _ctx(RoutingPolicy.KV_AWARE, WorkerLoad("w0"), WorkerLoad("w1", active_blocks=10))
    assert route(busy, _req(w1=Overlap(6)), random.Random(0)).worker_id == "w0"


def test_kvhint_counts_host_blocks_as_cheap_and_reports_them() -> None:
    ctx = _ctx(RoutingPolicy.KVHINT, WorkerLoad("w0"), WorkerLoad("w1"))
    decision = route(ctx, _req(w0=Overlap(2), w1=Overlap(1, 4)), random.Random(0))
    assert decision.worker_id == "w1"
    assert (decision.predicted_cached_tokens, decision.predicted_host_tokens) == (5 * BS, 4 * BS)


def test_kvhint_affinity_is_bounded_by_load() -> None:
    """The session's worker wins a near-tie, but not once it carries more than its share."""
    balanced = _ctx(RoutingPolicy.KVHINT, WorkerLoad("w0", recent_prefill_tokens=10_000),
                    WorkerLoad("w1", recent_prefill_tokens=10_000),
                    session=SessionPlacement("w1", 4))
    assert route(balanced, _req(), random.Random(0)).reason == "cost+affinity"
    assert route(balanced, _req(), random.Random(0)).worker_id == "w1"
    hot = _ctx(RoutingPolicy.KVHINT, WorkerLoad("w0", recent_prefill_tokens=10_000),
               WorkerLoad("w1", recent_prefill_tokens=40_000), session=SessionPlacement("w1", 4))
    # Even with its whole prompt cached on w1, the hot worker is passed over.
    decision = route(hot, _req(w1=Overlap(7)), random.Random(0))
    assert decision.worker_id == "w0"
    assert decision.fallbacks == ("w1",)


def test_kvhint_keeps_a_session_on_its_worker_slightly_over_the_balance_line() -> None:
    """15% over the mean: past balance_cap, within affinity_cap. New work goes elsewhere,
    the session whose context is cached there stays (moving would recompute it)."""
    loads = (WorkerLoad("w0", recent_prefill_tokens=10_000),
             WorkerLoad("w1", recent_prefill_tokens=13_000))
    stays = _ctx(RoutingPolicy.KVHINT, *loads, session=SessionPlacement("w1", 3))
    assert route(stays, _req(w1=Overlap(6)), random.Random(0)).worker_id == "w1"
    new = _ctx(RoutingPolicy.KVHINT, *loads)
    assert route(new, _req(w1=Overlap(6)), random.Random(0)).worker_id == "w0"


def test_kvhint_moves_a_session_off_its_cache_only_for_an_excess_larger_than_that_cache() -> None:
    """Past affinity_cap by 1,250 tokens, the session's worker keeps a request with 3,072
    tokens cached there (moving would recompute more than it relieves); past it by 8,750
    it does not. Without the margin the first one moved too."""
    cached = Overlap(6)  # 3,072 tokens
    session = SessionPlacement("w1", 3)
    slightly = (WorkerLoad("w0", recent_prefill_tokens=10_000),
                WorkerLoad("w1", recent_prefill_tokens=20_000))  # line: 18,750
    ctx = _ctx(RoutingPolicy.KVHINT, *slightly, session=session)
    assert route(ctx, _req(w1=cached), random.Random(0)).worker_id == "w1"
    no_margin = _ctx(RoutingPolicy.KVHINT, *slightly, session=session, affinity_cache_margin=0.0)
    assert route(no_margin, _req(w1=cached), random.Random(0)).worker_id == "w0"
    far = (WorkerLoad("w0", recent_prefill_tokens=10_000),
           WorkerLoad("w1", recent_prefill_tokens=40_000))  # line: 31,250
    ctx = _ctx(RoutingPolicy.KVHINT, *far, session=session)
    assert route(ctx, _req(w1=cached), random.Random(0)).worker_id == "w0"


def test_kvhint_spreads_new_sessions_over_their_shared_prefix_when_asked() -> None:
    """With ``new_session_spread`` set, a new session goes where fewer sessions were
    recently placed, even though its system prompt is cached on the other worker; a
    continuing session does not care. Off by default (measured to cost hits): the cache
    decides."""
    loads = (WorkerLoad("w0", recent_sessions=3.0), WorkerLoad("w1", recent_sessions=2.0))
    new = _ctx(RoutingPolicy.KVHINT, *loads, new_session_spread=1.0)
    assert route(new, _req(w0=Overlap(3)), random.Random(0)).worker_id == "w1"
    continuing = _ctx(RoutingPolicy.KVHINT, *loads, session=SessionPlacement("w0", 2),
                      new_session_spread=1.0)
    assert route(continuing, _req(w0=Overlap(3)), random.Random(0)).worker_id == "w0"
    balanced = _ctx(RoutingPolicy.KVHINT, WorkerLoad("w0", recent_sessions=2.0),
                    WorkerLoad("w1", recent_sessions=2.0), new_session_spread=1.0)
    assert route(balanced, _req(w0=Overlap(3)), random.Random(0)).worker_id == "w0"
    by_default = _ctx(RoutingPolicy.KVHINT, *loads)
    assert route(by_default, _req(w0=Overlap(3)), random.Random(0)).worker_id == "w0"


def test_ties_break_by_the_seeded_rng_reproducibly() -> None:
    ctx = _ctx(RoutingPolicy.KVHINT, *(WorkerLoad(f"w{i}") for i in range(4)))
    first = [route(ctx, _req(), rng).worker_id for rng in [random.Random(7)] for _ in range(20)]
    again = [route(ctx, _req(), rng).worker_id for rng in [random.Random(7)] for _ in range(20)]
    assert first == again
    assert len(set(first)) > 1  # ties are spread, not always the first worker


def test_no_healthy_worker_raises() -> None:
    with pytest.raises(NoWorkerAvailable):
        route(_ctx(RoutingPolicy.KVHINT, WorkerLoad("w0", healthy=False)), _req(),
              random.Random(0))


def test_cached_tokens_follow_vllms_cap_of_prompt_minus_one() -> None:
    """vLLM's hit is whole blocks within the prompt less its last token: a fully cached
    prompt of 4 whole blocks hits 3 of them (before, 4 blocks less one token)."""
    assert cached_tokens(Overlap(4), 4 * BS, BS) == (3 * BS, 0)
    assert cached_tokens(Overlap(4), 4 * BS + 1, BS) == (4 * BS, 0)
    assert cached_tokens(Overlap(1, 2), 10 * BS, BS) == (3 * BS, 2 * BS)
    assert cached_tokens(None, 100, BS) == (0, 0)
    assert decay_recent(100.0, 120.0, 120.0) == pytest.approx(50.0)


def test_recent_load_halves_both_counts_per_half_life() -> None:
    """The bookkeeping the router and the simulator share for ``WorkerLoad``."""
    load = RecentLoad(half_life_s=10.0, at=100.0)
    load.add_prefill(100.0, 800)
    load.add_session(100.0)
    load.decay_to(110.0)
    assert (load.prefill_tokens, load.sessions, load.at) == pytest.approx((400.0, 0.5, 110.0))
    load.add_prefill(120.0, 100)  # decays to 120 s first: 800 / 4 + 100
    assert (load.prefill_tokens, load.sessions, load.at) == pytest.approx((300.0, 0.25, 120.0))


def test_kvhint_keeps_a_continuation_with_its_cache_despite_a_modest_load_lead() -> None:
    """A 40k-token lead in recent work (within the balance cap) does not outweigh a 10k-token
    cached prefix; a new session (no overlap) still goes to the less loaded worker."""
    loads = (WorkerLoad("w0", recent_prefill_tokens=500_000),
             WorkerLoad("w1", recent_prefill_tokens=540_000))
    ctx = _ctx(RoutingPolicy.KVHINT, *loads, session=SessionPlacement("w1", 2))
    decision = route(ctx, _req(prompt=24 * BS, w1=Overlap(20)), random.Random(0))
    assert decision.worker_id == "w1"
    fresh = _ctx(RoutingPolicy.KVHINT, *loads)
    assert route(fresh, _req(prompt=24 * BS), random.Random(0)).worker_id == "w0"


def test_kvhint_keeps_a_continuation_with_its_cache_behind_a_short_queue() -> None:
    """Moving a session off its cache for a shorter wait recomputes that cache elsewhere:
    new work for the fleet, where a queue is only waiting. A queue of 6k tokens does not
    outweigh a 3k-token cached prefix (it did at queue_weight 1); one of 20k still does."""
    cached = Overlap(6)  # 3,072 tokens
    for pending, expected in ((6_000, "w0"), (20_000, "w1")):
        loads = (WorkerLoad("w0", pending_prefill_tokens=pending), WorkerLoad("w1"))
        ctx = _ctx(RoutingPolicy.KVHINT, *loads, session=SessionPlacement("w0", 2))
        assert route(ctx, _req(prompt=8 * BS, w0=cached), random.Random(0)).worker_id == expected
    old = _ctx(RoutingPolicy.KVHINT, WorkerLoad("w0", pending_prefill_tokens=6_000),
               WorkerLoad("w1"), session=SessionPlacement("w0", 2), queue_weight=1.0)
    assert route(old, _req(prompt=8 * BS, w0=cached), random.Random(0)).worker_id == "w1"
