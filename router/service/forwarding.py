"""One inference request through the router: session, route, forward, relay, account.

Retry rule: a worker that fails before it has the request (connection refused or timed
out, a connection reset before any answer) or answers 502/503/504 is marked down and the
request goes once to the next-best worker; an address that takes no connection at all
marks the other workers there (a vLLM server's other data-parallel ranks) down too. What a
request learns of a worker's address (it failed, it held the request without answering,
it answered) is recorded on the state (address) it was sent to: a worker that moved
meanwhile is not marked down at its new address, and may take the retry there. A worker
that has the request but does not answer within ``request_timeout_s`` is slow, not down,
and may still be running it: the client gets a 504 and the request is not run again
elsewhere. Once bytes have reached the client, a failure ends the stream with an
OpenAI-style error event instead (the SDKs raise it as an ``APIError``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Callable

import msgspec
from starlette.responses import Response

from kvhint.router.hashing import HashConfig
from kvhint.router.policy import NoWorkerAvailable
from kvhint.router.service.flight_accounting import Flight, FlightAccounting
from kvhint.router.service.inbound import InboundRequest, error_response
from kvhint.router.service.lifecycle import SessionLifecycle
from kvhint.router.service.metrics import RouterMetrics
from kvhint.router.service.relay_end import RelayEnd
from kvhint.router.service.relay_response import RelayResponse
from kvhint.router.service.response_scan import ResponseObservation
from kvhint.router.service.responses_scan import ResponsesRelay, relay_for
from kvhint.router.service.routing_service import (
    HeldConversation,
    RoutePlan,
    RoutingService,
    conversation_of_session,
)
from kvhint.router.service.sampling import batched_prompts
from kvhint.router.service.tenant_slots import TenantSlots
from kvhint.router.service.trace_recorder import TraceRecorder
from kvhint.router.service.upstream_opening import ClientGone, drop_opening, until_open
from kvhint.router.service.upstream import (
    DATA_PARALLEL_RANK_HEADER,
    UpstreamBroken,
    UpstreamPool,
    UpstreamResponse,
    UpstreamTimeout,
    UpstreamUnavailable,
)
from kvhint.router.service.workers import WorkerRegistry, WorkerState

log = logging.getLogger(__name__)

WORKER_HEADER = "x-kvhint-worker"
MAX_ATTEMPTS = 2
# Requests in a row a worker held past request_timeout_s without sending its headers,
# after which the prober checks its /health at once (see Forwarder._open).
SUSPECT_AFTER_TIMEOUTS = 2
# A request the router's stop cut short before its worker answered (Forwarder.forward).
SHUTTING_DOWN = ("the router is shutting down: the request ended before its worker "
                 "answered; retry the request")


def _closes_upstream_when_gone(flight: Flight, upstream: UpstreamResponse
                               ) -> Callable[[asyncio.Future[None]], None]:
    """A done callback for a disconnect watcher: once the client went away, close the
    worker's response now, which ends a read waiting on a silent worker (and has vLLM
    abort the request) instead of at its next chunk. A watcher cancelled (the response
    ended first) or failed changes nothing."""
    def on_done(gone: asyncio.Future[None]) -> None:
        if not gone.cancelled() and gone.exception() is None:
            flight.client_gone = True
            upstream.close()
    return on_done


class Forwarder:
    def __init__(self, workers: WorkerRegistry, routing: RoutingService, pool: UpstreamPool,
                 lifecycle: SessionLifecycle, metrics: RouterMetrics,
                 on_worker_down: Callable[[WorkerState], None],
                 recorder: TraceRecorder | None = None,
                 index_exact: Callable[[str], bool] | None = None,
                 max_event_bytes: int | None = None) -> None:
        """``max_event_bytes``: the bound on a relayed stream's unfinished event
        (``stream_event_max_bytes``: relay_end.py; None: none).
        ``index_exact(worker_id)``: whether the cluster index's view of the worker is
        exact now (``KvEventIngestor.view_exact``); a prediction read off another view
        is not checked against the worker's answer. None: no index feed, trust the plan.
        ``on_worker_down(worker)``: the address of ``worker`` (its current state) failed a
        request, or held several without answering: the prober checks it."""
        self._workers = workers
        self._routing = routing
        self._pool = pool
        self._lifecycle = lifecycle
        self._metrics = metrics
        self._on_worker_down = on_worker_down
        self._recorder = recorder
        self._index_exact = index_exact
        self._max_event_bytes = max_event_bytes
        # Each tenant's requests in flight, against its max_in_flight.
        self.slots = TenantSlots(metrics)
        self._accounting = FlightAccounting(workers, routing, lifecycle, metrics,
                                            self.slots, recorder)

    async def forward(self, inbound: InboundRequest,
                      client_gone: asyncio.Future[None] | None = None, *,
                      only_worker: str | None = None,
                      observation: ResponseObservation | None = None,
                      name_for: Callable[[WorkerState], str] | None = None,
                      conversation: HeldConversation | None = None,
                      session_conversation: bool = False) -> Response:
        """``client_gone``: done when the client disconnects before the response to it
        starts (a streamed response then watches its own); the request to the worker, or
        the worker's response, is then closed at once, not when it finishes.
        ``only_worker``: there or nowhere, no retry (a stored response's: responses_api.py);
        ``observation``: what reads the answer (a Responses one: responses_scan.py);
        ``name_for(worker)``: the body's ``request_id`` for each worker tried (a
        Responses id names its worker: responses_id_codec.py); ``conversation``: the
        stored turns its worker prepends to its prompt (a Responses follow-up's), counted
        in the load it books (routing_service.py ``HeldConversation``);
        ``session_conversation``: without ``conversation``, the follow-up continues its
        session's conversation on ``only_worker``, whose size the session's record then
        gives, where it can (routing_service.py ``conversation_of_session``)."""
        # Admitted here; the slot is given back by the accounting, which every way a
        # request ends runs once (answered, failed, client gone, a stream's end, a
        # cancellation).
        if (refusal := self.slots.take(inbound)) is not None:
            return refusal
        flight = Flight(inbound, None, None, time.perf_counter())
        flight.tenant_slot = True
        flight.only_worker, flight.observation = only_worker, observation or flight.observation
        flight.observation.prompts = batched_prompts(inbound.body, inbound.endpoint)
        flight.name_for, flight.conversation = name_for, conversation
        flight.session_conversation = session_conversation
        flight.client_gone_signal = client_gone
        if self._recorder is not None:
            flight.trace_ticket = self._recorder.arrived()
        try:
            return await self._forward(flight)
        except asyncio.CancelledError:
            # The router is stopping: uvicorn cancels the requests still running once
            # http_shutdown_grace_s ran out (nothing else cancels a request's handler; a
            # client that leaves is client_gone), and never awaits them after. The
            # worker's request is closed (vLLM aborts it), its slot, routed load and the
            # session's open turn settled once, as a 503 (the router's doing, as a
            # stream's RelayEnd.stopping), and the cancel ends here: the client gets a
            # JSON 503 it may retry elsewhere. Before, the cancel went on to uvicorn,
            # which answered its plain-text 500 and logged a traceback; counted 499.
            await self._abandon(flight, 503)
            return error_response(SHUTTING_DOWN, 503)
        except Exception:
            # A router bug: the app answers 500 (and counts it as an internal error);
            # the request is still settled, or its worker's slot and the session's
            # turn would stay open for good.
            await self._abandon(flight, 500)
            raise

    async def _abandon(self, flight: Flight, status: int) -> None:
        """Settle a request that ends by an exception: close its worker's response if one
        is open, then account it (a no-op when it was accounted already). Shielded: a
        second cancellation while the session's turn is being closed does not cut the
        accounting short (it then finishes on its own)."""
        if flight.accounted:
            return
        if flight.upstream is not None:
            flight.upstream.close()
        await asyncio.shield(self._accounting.account(flight, status))

    async def _forward(self, flight: Flight) -> Response:
        inbound = flight.inbound
        if inbound.client_session_id is not None:
            await self._lifecycle.recall(inbound.tenant.name, inbound.client_session_id)
            flight.record = self._lifecycle.begin_turn(inbound.tenant.name,
                                                       inbound.client_session_id)
            if (flight.session_conversation and flight.conversation is None
                    and flight.only_worker is not None):
                # As read before this turn was routed: its own routing changes the plan.
                flight.conversation = conversation_of_session(flight.record.plan,
                                                              flight.only_worker)
        body = msgspec.json.encode(inbound.body)
        # only_worker: every other worker out, and no second attempt.
        excluded = frozenset(w.worker_id for w in self._workers.all()
                             if flight.only_worker not in (None, w.worker_id))
        attempts = MAX_ATTEMPTS if flight.only_worker is None else 1
        last_error: UpstreamUnavailable | None = None
        for attempt in range(attempts):
            record = flight.record
            try:
                flight.plan = await self._routing.plan(
                    inbound, record.worker_id if record else None,
                    record.turns if record else 0, exclude=excluded, earlier=flight.plan,
                    conversation=flight.conversation)
            except NoWorkerAvailable as exc:
                if last_error is not None:
                    break  # the retry found no other worker: report the first failure
                await self._accounting.account(flight, 503)
                return error_response(f"no worker available: {exc}", 503)
            worker_id = flight.plan.decision.worker_id
            worker = self._workers.get(worker_id)
            assert worker is not None
            if flight.name_for is not None:
                inbound.body["request_id"] = flight.name_for(worker)
                body = msgspec.json.encode(inbound.body)
            try:
                upstream = await self._open(flight, worker, body)
            except ClientGone:
                await self._accounting.account(flight, 499)
                return Response(status_code=499)
            except UpstreamTimeout as exc:
                await self._accounting.account(flight, 504)
                return error_response(str(exc), 504)
            except UpstreamUnavailable as exc:
                last_error = exc
                if self._workers.is_current(worker):
                    excluded = excluded | {worker_id}
                # else it moved while the request was on its way: its new address may
                # take the retry
                if attempt + 1 < attempts:
                    self._metrics.retries.labels(worker_id).inc()
                continue
            return await self._respond(flight, upstream)
        assert last_error is not None
        await self._accounting.account(flight, last_error.status or 502)
        return unavailable_answer(last_error)

    async def _open(self, flight: Flight, worker: WorkerState, body: bytes
                    ) -> UpstreamResponse:
        """Send the request to ``worker``'s address; returns once its response has started.

        Contract: the worker's in-flight slot and its dispatched load are taken here and,
        on every way out before the worker has the request (ClientGone, a failure, a
        cancellation, an error), given back here exactly once, and the request to the
        worker cancelled (a response that opened anyway is closed). Once the worker has
        it (:meth:`_took`: headers came, or it timed out holding the request), the
        accounting (flight_accounting.py) settles them instead. What the worker's answer
        (or its failure, or its silence) says of its address is noted on ``worker``, the
        state the request went to (:meth:`_still_its_address`)."""
        worker_id = worker.worker_id
        assert worker.url is not None and flight.plan is not None
        worker.inflight += 1
        # One data-parallel rank of a vLLM server (its heartbeat names the rank): vLLM's
        # header sends it to that engine, whose cache the plan counted on; without it vLLM
        # balances across its ranks. No client header is ever passed on (upstream.py).
        dp_rank = worker.status.data_parallel_header if worker.status is not None else None
        opening = asyncio.ensure_future(self._pool.open(
            worker_id, worker.url + flight.inbound.endpoint.path, body,
            None if dp_rank is None else {DATA_PARALLEL_RANK_HEADER: str(dp_rank)}))
        plan = flight.plan
        uncached = 0
        dispatched = taken = False
        try:
            if plan.deferred and (flight.record is not None or self._recorder is not None):
                # One candidate: the decision needed no prompt hashes. A session still
                # wants them (its blocks, the prediction), and so does the trace
                # recorder, computed while the request is on its way; otherwise a
                # request without a session skips hashing (and makes no prediction).
                await asyncio.sleep(0)
                plan = flight.plan = await self._routing.complete(plan, flight.inbound)
            predicted = plan.predicted_for(worker_id)
            uncached = plan.uncached_on(worker_id)
            self._routing.dispatched(worker_id, uncached, plan.booked_tokens, plan.block_size)
            dispatched = True
            try:
                upstream = await until_open(opening, flight.client_gone_signal)
            except UpstreamUnavailable as exc:
                self.note_failure(worker, exc)
                raise
            except UpstreamTimeout as exc:
                # The worker took the request and may be running it: it stays up, the
                # turn counts as routed there, and the accounting (504) gives its slot
                # back.
                # Several in a row and no headers in between: a worker that accepts
                # connections but never answers (a hung server) looks just like this, and
                # no failure ever marks it down, so the prober checks it now (a slow
                # worker answers its /health and stays up).
                log.warning("%s", exc)
                taken = True
                self.note_silence(worker)
                await self._took(flight, worker_id, predicted, uncached)
                raise
            taken = True
            flight.upstream = upstream
            worker.note_answered()
            await self._took(flight, worker_id, predicted, uncached)
            return upstream
        finally:
            if not taken:
                # Looked up again: the registry may hold a new state for a worker that
                # moved meanwhile (it carries the in-flight count over).
                current = self._workers.get(worker_id)
                if current is not None:
                    current.inflight = max(current.inflight - 1, 0)
                if dispatched:
                    self._routing.finished(worker_id, plan.booked_tokens, plan.block_size,
                                           uncached)
                drop_opening(opening)

    def note_failure(self, worker: WorkerState, exc: UpstreamUnavailable) -> None:
        """A request failed before ``worker`` (the state it was sent to) had it: the
        worker is marked down and probed, and where its address took no connection at
        all, the other workers there too (module doc). Every request to a worker notes
        it so, a stored response's GET and cancel as well (responses_api.py)."""
        worker.mark_http_failure(exc.reason)
        if self._still_its_address(worker, "failure"):
            self._on_worker_down(worker)
            log.warning("worker %s failed before responding: %s", worker.worker_id,
                        exc.reason)
            if exc.unreachable:
                self._address_down(worker, exc.reason)

    def note_silence(self, worker: WorkerState) -> None:
        """``worker`` held a request past ``request_timeout_s`` without answering: slow,
        not down; several in a row and no headers in between, the prober
        checks it (see :meth:`_open`)."""
        silent = worker.note_timeout()
        if self._still_its_address(worker, "timeout") and silent >= SUSPECT_AFTER_TIMEOUTS:
            self._on_worker_down(worker)

    def _address_down(self, worker: WorkerState, reason: str) -> None:
        """``worker``'s address took no connection: the other workers there (the other
        data-parallel ranks of its vLLM server) are marked down and probed each on its
        own too, so the retry goes elsewhere, not to a rank of the same dead server."""
        for sibling in self._workers.mark_address_down(worker.url or "", worker.worker_id,
                                                       reason):
            self._on_worker_down(sibling)
            log.warning("worker %s: its address failed worker %s's request: marked "
                        "down too", sibling.worker_id, worker.worker_id)

    def _still_its_address(self, worker: WorkerState, what: str) -> bool:
        """Whether a failure (``what``) noted on ``worker``'s address concerns the worker
        now. Not once it has moved (a heartbeat named a new address while the request was
        on its way): its new address is neither marked down nor probed for what the one
        it left did; counted."""
        if self._workers.is_current(worker):
            return True
        self._metrics.drop(f"worker_left_address:{what}")
        log.info("worker %s: %s at %r, an address it has left; its new one is left alone",
                 worker.worker_id, what, worker.url)
        return False

    async def _took(self, flight: Flight, worker_id: str, predicted: int,
                    uncached: int) -> None:
        """Worker ``worker_id`` has the request: from now on the accounting settles it."""
        plan = flight.plan
        worker = self._workers.get(worker_id)  # the worker's count: by id (workers.py)
        assert plan is not None and worker is not None
        worker.requests += 1
        flight.worker_id = worker_id
        flight.uncached = flight.prefill_pending = uncached
        # The prompt's hashes are vLLM's own (plan.exact), at the worker's block size,
        # and the index's view of the worker is current: only then is the prediction
        # what its cache holds.
        exact = plan.exact and (self._index_exact is None or (
            self._index_exact(worker_id) and self._hashed_as_it_does(worker, plan)))
        flight.predicted_cached = predicted if exact else None
        if flight.record is not None:
            await self._lifecycle.routed(flight.record, worker_id, plan.prompt_tokens,
                                         predicted, plan.block_hashes, exact)

    def _hashed_as_it_does(self, worker: WorkerState, plan: RoutePlan) -> bool:
        """Whether the plan's prompt was hashed as the worker's heartbeat says it hashes:
        block size, ``hash_algo`` and NONE_HASH seed. Before its first heartbeat (its KV
        events can come first, its stream live), the prompt was hashed at another
        worker's block size or the router's ``block_size`` setting (routing_service
        ``_hash_config``), which the worker may not use (vLLM's default differs by
        platform); so it was too when another candidate of another block size was heard
        first (``block_size_unheard``). A worker of the same block size that hashes with
        another algorithm or seed than the candidate heard first (a fleet configured
        apart: ``--prefix-caching-hash-algo``, ``PYTHONHASHSEED``) holds none of these
        hashes either (``hash_config_differs``; its cache is invisible to routing, which
        is the operator's to fix). Either way no hash matches its blocks, and the
        prediction (nothing cached) says nothing of its cache: it is not checked against
        the worker's answer, nor learnt from; counted. Routing is unchanged."""
        status = worker.status
        if status is None or status.block_size != plan.block_size:
            self._metrics.drop("cached_prediction_unchecked:block_size_unheard")
            return False
        if HashConfig.from_status(status) != plan.hash_config:
            self._metrics.drop("cached_prediction_unchecked:hash_config_differs")
            return False
        return True

    async def _respond(self, flight: Flight, upstream: UpstreamResponse) -> Response:
        headers = dict(upstream.headers)
        headers[WORKER_HEADER] = upstream.worker_id
        streaming = flight.inbound.stream and upstream.status < 400
        if not streaming:
            signal = flight.client_gone_signal
            client_gone = _closes_upstream_when_gone(flight, upstream)
            if signal is not None:
                signal.add_done_callback(client_gone)
            try:
                payload = await upstream.read()
            except UpstreamBroken as exc:
                if flight.client_gone:  # nobody reads this answer
                    await self._accounting.account(flight, 499)
                    return Response(status_code=499)
                self._metrics.broken_streams.labels(upstream.worker_id).inc()
                code = 504 if exc.timed_out else 502
                await self._accounting.account(flight, code)
                return error_response(f"worker failed while responding: {exc}", code)
            finally:
                if signal is not None:
                    signal.remove_done_callback(client_gone)
            self._first_byte(flight)
            if upstream.status < 400:
                flight.observation.observe_json(payload)
            await self._accounting.account(flight, upstream.status)
            return Response(payload, status_code=upstream.status, headers=headers)
        return RelayResponse(self._relay(flight, upstream), upstream.status, headers,
                              _closes_upstream_when_gone(flight, upstream),
                              lambda: self._abandon(flight, 499))

    async def _relay(self, flight: Flight, upstream: UpstreamResponse
                     ) -> AsyncGenerator[bytes, None]:
        relay = relay_for(flight.observation, flight.inbound.strip_usage_chunk)
        first = True
        # A background response's stream, which its cancel may leave open for good.
        watch = (relay.observation.watch_cancel(upstream.close)
                 if isinstance(relay, ResponsesRelay)
                 and relay.observation.watch_cancel is not None else None)
        # A client that leaves once it has the whole answer (the OpenAI SDK closes right
        # after [DONE]) was served: its usage counts, its session is planned.
        end = RelayEnd(relay, watch, upstream, self._metrics, served_once_finished=True,
                       max_event_bytes=self._max_event_bytes)
        try:
            async for chunk in relay.relay(upstream.chunks()):
                end.heard()
                if first:
                    self._first_byte(flight)
                    first = False
                yield chunk
                if end.read_no_further():
                    break
            if (last := end.ended(flight.client_gone)) is not None:
                yield last
        except UpstreamBroken as exc:
            if (last := end.broken(exc, flight.client_gone)) is not None:
                yield last
        except asyncio.CancelledError:
            # The router is stopping: uvicorn cancels the requests still running once
            # http_shutdown_grace_s ran out (a client that leaves closes the generator at
            # a yield instead, GeneratorExit: relay_response.py), and never awaits them
            # after. The cancel ends here: the client gets an error event and the body's
            # clean end, not a connection cut mid-body (relay_end.py).
            if (last := end.stopping()) is not None:
                yield last
        except GeneratorExit:
            # Closed at a yield: the client went away before the stream's end (or just
            # after [DONE], before the worker's own end of the stream: served).
            end.left()
            raise
        finally:
            if watch is not None:
                watch.end()
            upstream.close()
            await self._accounting.account(flight, end.status)

    def _first_byte(self, flight: Flight) -> None:
        flight.first_byte_at = time.perf_counter()
        if flight.worker_id is not None and flight.prefill_pending:
            self._routing.first_byte(flight.worker_id, flight.prefill_pending)
            flight.prefill_pending = 0
        self._metrics.ttfb.labels(flight.inbound.endpoint.value).observe(
            time.perf_counter() - flight.received)


def unavailable_answer(exc: UpstreamUnavailable) -> Response:
    """What a client is told when its worker could not be reached: the worker's own
    refusal (e.g. 503 overloaded) as it is, else a 502."""
    if exc.status is not None:
        # Labelled JSON whatever it is (a proxy's HTML error page in front of a worker):
        # nosniff, so no browser reads it as HTML from the origin that serves the
        # dashboard (upstream._copy_headers does the same for every other relayed answer).
        return Response(exc.body, status_code=exc.status, media_type="application/json",
                        headers={"x-content-type-options": "nosniff"})
    return error_response(f"worker unavailable: {exc.client_reason}", 502)
