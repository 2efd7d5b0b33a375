"""The router's map of stored Responses API ids (responses_ids.py) on a real worker
registry: bounded with counted evictions, a tenant's ids only its own, and a worker gone
or restarted since (vLLM's store is in its process's memory) told apart from one down."""

from __future__ import annotations

import random
import time

from kvhint.router.service.metrics import RouterMetrics
from kvhint.router.service.responses_id_codec import ResponseIdCodec
from kvhint.router.service.responses_ids import IdEntry, IdMiss, ResponseIds
from kvhint.router.service.workers import WorkerRegistry
from kvhint.schemas import WorkerStatus
from kvhint.schemas.status import Budgets, Usage


def _heartbeat(registry: WorkerRegistry, worker_id: str, epoch: str, at: float) -> None:
    registry.on_heartbeat(WorkerStatus(
        worker_id=worker_id, epoch=epoch, model="tiny", cache_namespace="ns", block_size=4,
        hash_algo="sha256", none_hash_seed="vllm-none-hash",
        supported_actions={"kv.pin": ["1.0"]},
        budgets=Budgets(max_pinned_blocks=50, max_pin_ttl_s=600, max_retained_blocks=200,
                        max_retain_ttl_s=3600),
        usage=Usage(gpu_blocks_total=100, gpu_blocks_free=100, kv_usage=0.0),
        interval_s=1.0, at=time.time(), http_url=f"http://{worker_id}"), now=at)


def _reason(found: IdEntry | IdMiss) -> str:
    return found.reason if isinstance(found, IdMiss) else "found"


def test_ids_are_bounded_least_recently_used_first_and_counted() -> None:
    metrics = RouterMetrics()
    ids = ResponseIds(2, WorkerRegistry([("w0", "http://w0")]), metrics,
                      ResponseIdCodec("secret"))
    ids.learn("r1", "acme", "w0", "s1")
    ids.learn("r2", "acme", "w0", None)
    assert ids.find("r1", "acme") == IdEntry("acme", "w0", "s1", None)  # r1 now recent
    ids.learn("r3", "acme", "w0", None)
    assert [_reason(ids.find(r, "acme")) for r in ("r1", "r2", "r3")] == [
        "found", "unknown", "found"]
    assert len(ids) == 2
    assert metrics.response_ids_evicted._value.get() == 1
    assert metrics.response_ids._value.get() == 2
    assert metrics.response_id_misses.labels("unknown")._value.get() == 1


def test_another_tenants_id_and_a_worker_down_gone_or_restarted() -> None:
    metrics = RouterMetrics()
    registry = WorkerRegistry([("w0", "http://w0")])
    _heartbeat(registry, "w1", "epoch-1", time.monotonic())  # learnt from its plugin
    _heartbeat(registry, "w2", "epoch-1", time.monotonic())
    ids = ResponseIds(10, registry, metrics, ResponseIdCodec("secret"))
    for number, worker in enumerate(("w0", "w1", "w2")):
        ids.learn(f"r{number}", "acme", worker, None)
    assert _reason(ids.find("r0", "beta")) == "other_tenant"
    registry.get("w0").mark_http_failure("refused")
    assert ids.find("r0", "acme") == IdMiss("worker_down", "w0")
    registry.get("w0").mark_http_ok()
    assert _reason(ids.find("r0", "acme")) == "found"
    _heartbeat(registry, "w1", "epoch-2", time.monotonic())  # its engine restarted
    assert ids.find("r1", "acme") == IdMiss("worker_restarted", "w1")
    # w2 silent long enough to be forgotten: it left the fleet.
    assert registry.forget_silent(time.monotonic() + 7200, after_s=3600) == ["w1", "w2"]
    assert ids.find("r2", "acme") == IdMiss("worker_gone", "w2")
    counted = {r: metrics.response_id_misses.labels(r)._value.get()
               for r in ("other_tenant", "worker_down", "worker_restarted", "worker_gone")}
    assert counted == {"other_tenant": 1, "worker_down": 1, "worker_restarted": 1,
                       "worker_gone": 1}


def _ids(max_ids: int, metrics: RouterMetrics) -> ResponseIds:
    return ResponseIds(max_ids, WorkerRegistry([("w0", "http://w0")]), metrics,
                       ResponseIdCodec("secret"))


def test_one_tenants_churn_evicts_its_own_ids_never_anothers() -> None:
    """Past the bound the tenant holding the most ids gives up its least recently used:
    a tenant creating many stored responses forgets its own, and another tenant's
    follow-ups keep their sessions (before, one LRU over all tenants lost them all)."""
    metrics = RouterMetrics()
    ids = _ids(4, metrics)
    ids.learn("a1", "acme", "w0", "s1")
    ids.learn("a2", "acme", "w0", "s2")
    for number in range(20):
        ids.learn(f"b{number}", "beta", "w0", None)
    assert ids.find("a1", "acme") == IdEntry("acme", "w0", "s1", None)
    assert ids.find("a2", "acme") == IdEntry("acme", "w0", "s2", None)
    assert [_reason(ids.find(f"b{n}", "beta")) for n in (17, 18, 19)] == [
        "unknown", "found", "found"]
    assert (ids.held_by("acme"), ids.held_by("beta"), len(ids)) == (2, 2, 4)
    assert metrics.response_ids_evicted._value.get() == 18
    assert metrics.response_ids._value.get() == 4
    # Now acme holds the most: its own least recently used goes (a1 was used since a2).
    ids.find("a1", "acme")
    ids.learn("a3", "acme", "w0", "s3")
    assert [_reason(ids.find(r, "acme")) for r in ("a1", "a2", "a3")] == [
        "found", "unknown", "found"]
    assert (ids.held_by("acme"), ids.held_by("beta")) == (2, 2)


def test_on_a_tie_the_tenant_learning_gives_up_its_own() -> None:
    """Holding as many as the largest after its new id, the tenant learning one forgets
    one of its own rather than take from a tenant that reached that many first."""
    metrics = RouterMetrics()
    ids = _ids(3, metrics)
    ids.learn("b1", "beta", "w0", None)
    ids.learn("b2", "beta", "w0", None)
    ids.learn("a1", "acme", "w0", None)
    ids.learn("a2", "acme", "w0", None)  # acme 2, beta 2: acme gives up a1
    assert [_reason(ids.find(r, t)) for r, t in (
        ("a1", "acme"), ("a2", "acme"), ("b1", "beta"), ("b2", "beta"))] == [
        "unknown", "found", "found", "found"]
    ids.learn("a2", "acme", "w0", "s9")  # learnt again: replaced, not held twice
    assert (ids.held_by("acme"), len(ids)) == (1, 3)
    assert ids.find("a2", "acme") == IdEntry("acme", "w0", "s9", None)


def test_evictions_always_take_from_a_tenant_holding_the_most() -> None:
    """Many tenants, skewed, ids used again at random: every eviction takes from a
    tenant that held the most ids at that moment, and the bound holds."""
    rng = random.Random(7)
    tenants = [f"t{n}" for n in range(6)]
    ids = _ids(50, RouterMetrics())
    learnt: list[tuple[str, str]] = []
    for step in range(5000):
        if learnt and rng.random() < 0.3:
            ids.find(*rng.choice(learnt))
            continue
        tenant = rng.choices(tenants, weights=[40, 20, 10, 5, 2, 1])[0]
        before = {t: ids.held_by(t) for t in tenants}
        ids.learn(f"r{step}", tenant, "w0", None)
        after = {t: ids.held_by(t) for t in tenants}
        learnt.append((f"r{step}", tenant))
        grown = dict(before, **{tenant: before[tenant] + 1})
        for name in tenants:
            if after[name] < grown[name]:
                assert grown[name] == max(grown.values()), (step, name, grown)
        assert len(ids) == sum(after.values()) <= 50
    assert len(ids) == 50 and min(ids.held_by(t) for t in tenants) >= 1
