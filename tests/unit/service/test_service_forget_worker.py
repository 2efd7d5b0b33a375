"""A worker the router forgets (heard only by its heartbeats, silent for good) leaves
nothing of its own in memory: its registry entry, its metric series, and what it taught
the planner (feedback) and held. The feed's tick forgets it; NATS is not needed (a link
that is not connected)."""

from __future__ import annotations

import time
from dataclasses import dataclass

import msgspec

from kvhint.router.kv_index import InMemoryClusterKvIndex, KvEventIngestor
from kvhint.router.kv_index.stream import StreamConfig
from kvhint.router.policy import PlannerConfig, RoutingConfig
from kvhint.router.policy.feedback import WorkerFeedback
from kvhint.router.policy.tenant_feedback import SplitFeedback
from kvhint.router.service.cluster_feed import ClusterFeed
from kvhint.router.service.hint_dispatch import HintDispatcher, SentAction
from kvhint.router.service.metrics import RouterMetrics
from kvhint.router.service.routing_service import RoutingService
from kvhint.router.service.workers import WorkerRegistry
from kvhint.schemas import Subjects

from test_service_planning import status


@dataclass
class _Unconnected:
    """What the feed's tick reads of its NATS link."""

    subjects: Subjects
    connected: bool = False


def _held_row(action_id: str, worker_id: str) -> dict:
    now = time.time()
    scope = f"default/{action_id}"
    return SentAction(action_id=action_id, message_id="m", worker_id=worker_id,
                      tenant="default", session_id=action_id, action_type="kv.retain",
                      source="planner", trigger="gap",
                      payload={"target": {"session_id": scope}}, status="accepted",
                      created_at=now, updated_at=now, requested_blocks=8, applied_blocks=8,
                      scope=scope, expires_at=now + 86400).row()


def test_a_forgotten_worker_takes_its_feedback_holdings_and_load_with_it() -> None:
    """Before, the registry and the metrics forgot the worker, and its feedback stayed in
    the dispatcher for the router's life (one entry per pod ever seen, and shown by the
    admin API for a worker no longer listed). A worker still heard keeps its own."""
    subjects = Subjects("t")
    registry = WorkerRegistry([])
    metrics = RouterMetrics()
    hints = HintDispatcher(None, subjects, registry, None, metrics, PlannerConfig(), seed=1)
    ingestor = KvEventIngestor(InMemoryClusterKvIndex(), clock=time.monotonic,
                               config=StreamConfig(forget_dead_after_s=60.0))
    routing = RoutingService(registry, metrics, RoutingConfig(), hasher=None,
                             default_block_size=4, index=InMemoryClusterKvIndex())
    feed = ClusterFeed(_Unconnected(subjects), ingestor, registry, hints,  # type: ignore[arg-type]
                       metrics, None, None, None, snapshot_timeout_s=5.0,
                       on_hint_outcome=lambda _sent, _outcome: None,
                       on_hold_released=lambda _release: None,
                       on_worker_forgotten=routing.forget_worker)
    now = time.monotonic()
    for worker, heard in (("gone", now - 120.0), ("here", now)):
        registry.on_heartbeat(msgspec.structs.replace(status(worker),
                                                      http_url=f"http://{worker}"), now=heard)
        hints.feedback[worker] = SplitFeedback(
            worker, tenants={"default": WorkerFeedback(worker, pin_ask_scale=0.5)})
        routing.dispatched(worker, uncached_tokens=64, prompt_tokens=64, block_size=4)
    hints.restore([], [], held=[_held_row("kvh-gone", "gone"), _held_row("kvh-here", "here")])
    assert hints.holdings.worker("gone").retained_blocks > 0
    feed.tick()
    assert registry.get("gone") is None and registry.get("here") is not None
    assert "gone" not in hints.feedback
    assert hints.feedback["here"].view("default").pin_ask_scale == 0.5
    assert hints.holdings.worker("gone").retained_blocks == 0
    assert hints.holdings.worker("here").retained_blocks > 0
    # Its routing load figures too (the runtime wires the feed to the routing service).
    assert routing._loads.get("gone") is None and routing._loads.get("here") is not None
