"""The worker registry: heartbeat verdicts, workers known only by their heartbeats."""

from __future__ import annotations

import msgspec

from kvhint.router.service.workers import HeartbeatVerdict, WorkerRegistry

from test_service_planning import status


def test_heartbeat_verdicts() -> None:
    registry = WorkerRegistry([("w0", "http://a")])
    assert registry.on_heartbeat(status("w0")) is HeartbeatVerdict.FIRST
    assert registry.on_heartbeat(status("w0")) is HeartbeatVerdict.SAME_EPOCH
    assert registry.on_heartbeat(status("w0", "e2")) is HeartbeatVerdict.NEW_EPOCH
    registry.get("w0").mark_http_failure("refused")
    assert registry.routable() == []
    registry.get("w0").mark_http_ok()
    assert [w.worker_id for w in registry.routable()] == ["w0"]


def test_a_worker_known_by_its_heartbeats_is_routed_where_it_says_it_is_now() -> None:
    """A pod rescheduled on another address keeps its worker id: its heartbeats' http_url
    wins over the one first heard (before, that one was kept for good: a worker marked
    down there was probed there forever). A configured URL is never replaced."""
    registry = WorkerRegistry([("w0", "http://configured")])
    for worker, url in (("w0", "http://elsewhere"), ("w1", "http://old"),
                        ("w1", "http://new")):
        registry.on_heartbeat(msgspec.structs.replace(status(worker), http_url=url))
        if url == "http://old":
            registry.get("w1").mark_http_failure("refused")
            registry.get("w1").served_models = frozenset({"tiny"})
    assert registry.get("w0").url == "http://configured"
    moved = registry.get("w1")
    assert (moved.url, moved.http_up, moved.served_models) == ("http://new", True, None)


def test_a_worker_known_by_its_heartbeats_and_silent_for_long_is_forgotten() -> None:
    """A pod gone for good: before, it stayed listed, probed and alerting for the router's
    life. A configured worker, or one with a request in flight, stays."""
    registry = WorkerRegistry([("w0", "http://configured")])
    for worker in ("w0", "w1", "w2"):
        registry.on_heartbeat(msgspec.structs.replace(status(worker),
                                                      http_url=f"http://{worker}"), now=0.0)
    registry.get("w2").inflight = 1
    assert registry.forget_silent(now=3000.0, after_s=3600.0) == []
    assert registry.forget_silent(now=3601.0, after_s=3600.0) == ["w1"]
    assert sorted(w.worker_id for w in registry.all()) == ["w0", "w2"]


def test_an_answer_counts_for_the_address_it_came_from_only() -> None:
    """``answered`` (what /ready reads): a response that started or a /health answer at
    the worker's address; a move to a new address starts it over (its request count,
    the worker's, carries over)."""
    registry = WorkerRegistry([])
    registry.on_heartbeat(msgspec.structs.replace(status("w1"), http_url="http://old"))
    old = registry.get("w1")
    assert not old.answered
    old.note_answered()
    old.requests = 3
    assert old.answered
    registry.on_heartbeat(msgspec.structs.replace(status("w1"), http_url="http://new"))
    new = registry.get("w1")
    assert new is not old and new.requests == 3 and not new.answered
    new.mark_http_ok()  # its /health answered
    assert new.answered
