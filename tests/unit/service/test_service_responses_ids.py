"""The router's map of stored Responses API ids (responses_ids.py) on a real worker
registry: bounded with counted evictions, a tenant's ids only its own, and a worker gone
or restarted since (vLLM's store is in its process's memory) told apart from one down."""

from __future__ import annotations

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
                      ResponseIdCodec("secret"), frozenset({"acme"}))
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
    ids = ResponseIds(10, registry, metrics, ResponseIdCodec("secret"),
                      frozenset({"acme", "beta"}))
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
