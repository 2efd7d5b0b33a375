"""Property checks of routing, the shared-prefix scan and donor choice over many seeded
random inputs (hypothesis is not installed: seeded ``random`` loops; a failure names its
seed). The planner's own: test_policy_planner_properties.py.

- ``route``: never an unhealthy (down, excluded) worker, first choice or fallback; the
  same decision whatever order the workers come in (ties broken by the seeded rng in
  worker-id order); a cached prediction never over vLLM's cap (whole blocks, never the
  prompt's last token).
- ``find_shared_prefixes`` / ``plan_shared_prefixes``: one tenant's sessions never make
  a prefix of another tenant's, nor count towards one; the result does not depend on
  the order the sessions come in; each retain's priority is within the wire's 0..100 and
  its tenant's retain budget holds.
- ``choose_donor``: only a donor of the request's own tenant and namespace, on a healthy
  worker, similar enough and longer by the margin; the same choice in any order.
"""

from __future__ import annotations

import random

from planner_fixtures import make_ctx

from kvhint.router.policy import (
    DonorCandidate,
    DonorContext,
    Holdings,
    NoWorkerAvailable,
    Overlap,
    PlannerConfig,
    PlannerContext,
    RouteRequest,
    RoutingConfig,
    RoutingContext,
    RoutingPolicy,
    SessionChain,
    SessionPlacement,
    WorkerLoad,
    choose_donor,
    find_shared_prefixes,
    plan_shared_prefixes,
    route,
)
from kvhint.schemas import parse_action
from kvhint.schemas.hints import ParsedAction


def test_route_never_picks_an_unhealthy_worker_and_ignores_the_workers_order() -> None:
    for seed in range(3000):
        r = random.Random(seed)
        workers = [WorkerLoad(f"w{i}", healthy=r.random() < 0.75,
                              active_requests=r.randrange(5), active_blocks=r.randrange(200),
                              pending_prefill_tokens=r.randrange(0, 30_000),
                              recent_prefill_tokens=r.choice([0.0, r.random() * 2e5]),
                              recent_sessions=r.random() * 3)
                   for i in range(r.randrange(1, 6))]
        block = r.choice([16, 512])
        request = RouteRequest(
            r.randrange(0, 40_000), block, r.choice([None, "t/s"]), r.randrange(10),
            {w.worker_id: Overlap(r.randrange(0, 100), r.randrange(0, 20))
             for w in workers if r.random() < 0.6})
        session = r.choice([None, SessionPlacement(None),
                            SessionPlacement(r.choice(workers).worker_id, 3)])
        config = RoutingConfig(policy=r.choice(list(RoutingPolicy)))
        healthy = {w.worker_id for w in workers if w.healthy}
        try:
            decision = route(RoutingContext(tuple(workers), config, session), request,
                             random.Random(seed))
        except NoWorkerAvailable:
            assert not healthy, seed
            continue
        chosen = [decision.worker_id, *decision.fallbacks]
        assert sorted(chosen) == sorted(healthy), seed
        cap = max(request.prompt_tokens - 1, 0) // block * block
        assert 0 <= decision.predicted_host_tokens <= decision.predicted_cached_tokens <= cap
        shuffled = list(workers)
        r.shuffle(shuffled)
        again = route(RoutingContext(tuple(shuffled), config, session), request,
                      random.Random(seed))
        assert again == decision, seed


def _random_chains(r: random.Random) -> list[SessionChain]:
    systems = {t: tuple(r.randrange(1 << 40) for _ in range(r.randrange(1, 9)))
               for t in ("a", "b")}
    # Tenants whose salt makes them share blocks (the same hashes) are still apart.
    if r.random() < 0.5:
        systems["b"] = systems["a"]
    chains = []
    for _ in range(r.randrange(0, 25)):
        tenant = r.choice(("a", "b"))
        tail = tuple(r.randrange(1 << 40) for _ in range(r.randrange(0, 6)))
        chains.append(SessionChain(r.choice(("w0", "w1")), tenant,
                                   systems[tenant][:r.randrange(1, 9)] + tail,
                                   r.choice([0.0, 1 / 60, 1 / 600, 1.0])))
    return chains


def test_shared_prefixes_stay_within_their_tenant_and_do_not_depend_on_order() -> None:
    for seed in range(1500):
        r = random.Random(seed)
        chains = _random_chains(r)
        min_sessions = r.choice([1, 2, 3])
        prefixes = find_shared_prefixes(chains, min_sessions, {})
        shuffled = list(chains)
        r.shuffle(shuffled)
        assert find_shared_prefixes(shuffled, min_sessions, {}) == prefixes, seed
        for prefix in prefixes:
            own = [c for c in chains if c.tenant == prefix.tenant
                   and c.worker_id == prefix.worker_id and c.hit_density > 0
                   and c.block_hashes[:len(prefix.block_hashes)] == prefix.block_hashes]
            assert len(own) == prefix.sessions >= min_sessions, seed
            assert prefix.key.startswith(f"{prefix.tenant}:"), seed
        cap = r.choice([None, 0, 3, 10])
        held = {t: Holdings(0, r.randrange(0, 8)) for t in ("a", "b")}
        ctx = make_ctx(now=100.0, config=PlannerConfig(shared_prefix_min_sessions=min_sessions,
                                                       tenant_max_retained_blocks=cap))
        for tenant in ("a", "b"):
            tenant_ctx = PlannerContext(now=ctx.now, stats=ctx.stats, workers=ctx.workers,
                                        rng=random.Random(seed), config=ctx.config,
                                        tenant_held={tenant: held[tenant]})
            group = [p for p in prefixes if p.tenant == tenant]
            actions = plan_shared_prefixes(tenant_ctx, group)
            total = held[tenant].retained_blocks
            for planned in actions:
                parsed = parse_action(planned.action)
                assert isinstance(parsed, ParsedAction), (seed, parsed)
                assert planned.tenant == tenant and planned.scope.startswith(f"prefix:{tenant}:")
                assert 0 <= parsed.payload.priority <= 100
                total += planned.blocks
            assert cap is None or not actions or total <= cap, seed


def test_a_donor_is_always_the_requests_own_tenant_and_namespace() -> None:
    for seed in range(3000):
        r = random.Random(seed)
        candidates = [DonorCandidate(
            r.choice(("w0", "w1", "w2")), r.choice(("ns", "other-ns")), r.choice(("a", "b")),
            r.choice((None, "a/s1", "b/s2")), tuple(range(r.randrange(0, 12))),
            r.choice((0.5, 0.8, 0.9, 0.9, 1.0, float("nan"))))
            for _ in range(r.randrange(0, 8))]
        ctx = DonorContext("ns", "a", frozenset(w for w in ("w0", "w1", "w2")
                                                if r.random() < 0.7), r.randrange(0, 6))
        choice = choose_donor(ctx, candidates)
        shuffled = list(candidates)
        r.shuffle(shuffled)
        assert choose_donor(ctx, shuffled) == choice, seed
        if choice is None:
            continue
        donor = choice.candidate
        assert donor.tenant == "a" and donor.namespace == "ns", seed
        assert donor.worker_id in ctx.healthy_workers and donor.similarity >= 0.8, seed
        assert len(donor.donor_block_hashes) >= ctx.best_exact_blocks + 2, seed
