"""One request's flight through the router (its state between routing and accounting)
and its accounting: how a request that ended is counted and what it held settled.

Contract: :meth:`FlightAccounting.account` runs once per request, whichever way it ended
(answered, failed, refused, client gone, a stream's end, a cancellation); the first call
wins and later ones are no-ops. It gives back the tenant's in-flight slot (if the flight
holds one), counts the request (requests, duration, usage against the prediction), and,
once a worker had the request, gives back that worker's in-flight slot and routed load,
then finishes the request's trace and closes its session's turn. A 200 whose answer
carried the worker's error is counted and settled by that error's status.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvhint.router.policy import FinishReason
from kvhint.router.service.inbound import InboundRequest
from kvhint.router.service.lifecycle import SessionLifecycle
from kvhint.router.service.metrics import RouterMetrics
from kvhint.router.service.response_scan import ResponseObservation
from kvhint.router.service.routing_service import (
    HeldConversation,
    RoutePlan,
    RoutingService,
)
from kvhint.router.service.sampling import parallel_samples
from kvhint.router.service.sessions import SessionRecord
from kvhint.router.service.tenant_slots import TenantSlots
from kvhint.router.service.trace_recorder import TraceRecorder, TracedRequest
from kvhint.router.service.upstream import UpstreamResponse
from kvhint.router.service.workers import WorkerRegistry, WorkerState

# A turn its client ended: gone before the answer, or a Responses response it cancelled
# (responses_scan.py: the worker's ``cancelled`` status, or the router's end after a cancel).
CLIENT_CANCELLED = 499


@dataclass(slots=True)
class Flight:
    """One request's state between routing and accounting."""

    inbound: InboundRequest
    record: SessionRecord | None
    plan: RoutePlan | None
    received: float
    worker_id: str | None = None
    uncached: int = 0
    predicted_cached: int | None = 0
    prefill_pending: int = 0
    observation: ResponseObservation = field(default_factory=ResponseObservation)
    trace_ticket: int | None = None
    first_byte_at: float | None = None  # perf_counter
    client_gone: bool = False
    client_gone_signal: asyncio.Future[None] | None = None
    # The worker's response once it started (closed if the request ends by an exception).
    upstream: UpstreamResponse | None = None
    # FlightAccounting.account ran: every way a request ends settles it once, never twice.
    accounted: bool = False
    # It holds one of its tenant's in-flight slots (given back by the accounting).
    tenant_slot: bool = False
    only_worker: str | None = None  # see Forwarder.forward
    name_for: Callable[[WorkerState], str] | None = None  # see Forwarder.forward
    conversation: HeldConversation | None = None  # see Forwarder.forward
    session_conversation: bool = False  # see Forwarder.forward


class FlightAccounting:
    """Counts each request that ended and settles what it held (the module's contract)."""

    def __init__(self, workers: WorkerRegistry, routing: RoutingService,
                 lifecycle: SessionLifecycle, metrics: RouterMetrics, slots: TenantSlots,
                 recorder: TraceRecorder | None) -> None:
        self._workers = workers
        self._routing = routing
        self._lifecycle = lifecycle
        self._metrics = metrics
        self._slots = slots
        self._recorder = recorder

    async def account(self, flight: Flight, status: int) -> None:
        """Count the request and settle what it held (the worker's slot and routed load,
        the session's turn, the trace); runs once per request, the first call wins."""
        if flight.accounted:
            return
        flight.accounted = True
        # A 200 that carried the worker's error (vLLM's error event in a stream) failed:
        # counted, and settled for its session, by that error's status, as a stream
        # that broke mid-way is by the router's own (502/504); and, as that one is, as
        # a broken response: a 200 whose answer failed after it began. Not a response
        # its client cancelled (POST /v1/responses/{id}/cancel: 499): the worker did what
        # it was asked.
        worker_status = status
        status = flight.observation.turn_status(status)
        if status not in (worker_status, CLIENT_CANCELLED) and flight.worker_id is not None:
            self._metrics.broken_streams.labels(flight.worker_id).inc()
        if flight.tenant_slot:
            flight.tenant_slot = False
            self._slots.give_back(flight.inbound.tenant.name)
        endpoint = flight.inbound.endpoint.value
        worker_id = flight.worker_id or "none"
        self._metrics.record_request(endpoint, worker_id, status)
        self._metrics.duration.labels(endpoint).observe(time.perf_counter() - flight.received)
        plan = flight.plan
        if flight.worker_id is not None and plan is not None:
            worker = self._workers.get(flight.worker_id)
            if worker is not None:
                worker.inflight = max(worker.inflight - 1, 0)
            self._routing.finished(flight.worker_id, plan.booked_tokens, plan.block_size,
                                   flight.prefill_pending)
        observation = flight.observation
        if flight.worker_id is not None and (lost := observation.usage_lost(status)):
            self._metrics.drop(lost)
        predicted = None
        if observation.prompt_tokens is not None and flight.worker_id is not None:
            predicted = flight.predicted_cached
            inbound = flight.inbound
            if predicted is not None and parallel_samples(inbound.body, inbound.endpoint) > 1:
                # vLLM runs n > 1 as n child requests of one prompt, scheduled together:
                # the first prefills it, the others hit the blocks it just allocated.
                # usage counts the prompt once (as the prediction and the dispatched
                # load do), but its cached_tokens is one child's, often a sibling's hit,
                # not what the cache held before: not compared with the prediction.
                self._metrics.drop("cached_prediction_unchecked:parallel_sampling")
                predicted = None
            elif predicted is not None and observation.prompts > 1:
                # A completions batch is routed (and predicted) by its first prompt, but
                # usage sums every prompt's tokens and its cached_tokens is one prompt's
                # (vLLM reports the last to finish): not comparable with the prediction.
                self._metrics.drop("cached_prediction_unchecked:batched_prompts")
                predicted = None
            self._metrics.record_usage(worker_id, observation.prompt_tokens,
                                       observation.cached_tokens or 0, predicted)
        if self._recorder is not None and flight.trace_ticket is not None:
            self._recorder.finished(flight.trace_ticket, *_traced(flight, status))
        if flight.record is not None:
            answered = 200 <= status < 300
            ok = answered and observation.prompt_tokens is not None
            await self._lifecycle.finished(flight.record, flight.worker_id or "",
                                           observation if ok else None,
                                           self._ends_session(flight, answered, status),
                                           answered, predicted if ok else None)

    def _ends_session(self, flight: Flight, answered: bool, status: int) -> bool:
        """Whether the turn ends its session: it asked to (``X-Session-End``) and it
        succeeded. A turn that failed (the worker's error, as a status or as an error
        event in its stream, a broken stream, the client gone before the whole answer)
        is one its agent retries, into a session that must still be open: the end is
        skipped, and counted by the turn's status."""
        if not flight.inbound.session_end or answered:
            return flight.inbound.session_end
        reason = "client_gone" if status == 499 else "refused" if status < 500 else "failed"
        self._metrics.session_end_skips.labels(reason).inc()
        return False


def _traced(flight: Flight, status: int) -> tuple[TracedRequest | None, str]:
    """What the trace recorder gets for a finished request, or why it gets nothing."""
    plan, observation = flight.plan, flight.observation
    if plan is None or not 200 <= status < 300 or observation.prompt_tokens is None:
        return None, "trace_failed"
    if not plan.exact:
        return None, "trace_unhashed"
    finish = observation.finish()
    inbound = flight.inbound
    # One completion's (n > 1: n decode side by side; a session continues one of them).
    output = observation.completion_tokens_per_choice
    itl_ms = ttft_ms = None
    if inbound.stream and flight.first_byte_at is not None:
        ttft_ms = (flight.first_byte_at - flight.received) * 1000.0
        if output >= 2:  # the stream's first event to its end, per token after the first
            itl_ms = (time.perf_counter() - flight.first_byte_at) * 1000.0 / (output - 1)
    return TracedRequest(
        tenant=inbound.tenant.name, session_id=inbound.client_session_id,
        prompt_tokens=plan.prompt_tokens, block_hashes=plan.block_hashes,
        block_size=plan.block_size, output_tokens=output,
        finish_reason=finish.value if finish is not FinishReason.OTHER else "stop",
        tool_names=tuple(observation.tool_names), end=inbound.session_end,
        itl_ms=itl_ms, ttft_ms=ttft_ms), ""
