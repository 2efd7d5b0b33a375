"""vLLM's Responses API through the router: ``POST /v1/responses`` (routed like chat),
``GET /v1/responses/{id}`` and ``POST /v1/responses/{id}/cancel``.

A new response is routed as a chat request is (tenancy, session, prefix hashes where
the prompt is all in the body: hashing/responses_input.py). The router names it: the
forwarded body's ``request_id`` (vLLM's response id) is the router's, never the client's,
so no client can name (and overwrite, in a worker's store) another's response. The id
says which worker it was sent to, bound to the tenant (responses_id_codec.py), so every
replica reaches it; once a worker has answered it (status < 400, stored as vLLM reads
``store``: :func:`stores_response`; a stream not in the background at its terminal
event, when vLLM has stored it), ``id -> (tenant, worker, session)`` is remembered too
(responses_ids.py), and the session it was made in is written to the store for every
replica (responses_sessions.py).

A request naming a stored response goes to the worker that holds it, or nowhere:
``previous_response_id`` (forwarded to that worker only, never retried elsewhere; a
follow-up naming no session continues the session of the response it follows), the
GET and the cancel. Another tenant's id is answered as an unknown one (404, as vLLM
answers an id it does not hold); a worker gone or restarted since is a 404 saying so;
one down now a 503 (retry later). Nothing is ever sent to a worker other than the one
the id names for the requesting tenant. A worker a GET or cancel cannot reach is
marked down as for any request (forwarding.py ``note_failure``). A background
response's streams are ended by the router where vLLM leaves them open: after a cancel
relayed by any replica (responses_cancels.py, responses_cancel_notices.py), an ``error``
event, or ``responses.background_idle_s`` without an event (its background task died);
one its worker breaks, closes before a terminal event, or leaves silent for
``request_timeout_s`` ends with ``response.failed``, as a POST's stream does. A GET of a
background response this router relayed queued whose run it knows ended without its
answer (its worker lost it, its stream relayed vLLM's ``error``) reads ``failed``
(responses_background.py).

A GET and a cancel are bounded per tenant: a streamed GET holds its worker's connection
while the response lasts, so it takes one of the tenant's ``max_in_flight`` slots
(tenant_slots.py), given back once however its stream ends; a plain GET and a cancel
take one of its ``api_calls`` (tenant_call_rate.py). Past either, a 429 sent nowhere.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import Callable
from functools import partial
from typing import Any
from urllib.parse import quote, urlencode

from starlette.requests import Request
from starlette.responses import Response

from kvhint.router.service.cross_site import cross_site_refusal
from kvhint.router.service.forwarding import SHUTTING_DOWN, WORKER_HEADER, unavailable_answer
from kvhint.router.service.inbound import InboundRequest, error_response
from kvhint.router.service.relay_response import RelayResponse
from kvhint.router.service.request_fields import runs_in_background, stores_response
from kvhint.router.service.responses_background import BackgroundReads
from kvhint.router.service.responses_cancel_rechecks import recheck_streams
from kvhint.router.service.responses_get_stream import Slot, streamed_get
from kvhint.router.service.responses_id_codec import ResponseIdCodec
from kvhint.router.service.responses_ids import IdEntry, IdMiss, ResponseIds
from kvhint.router.service.responses_cancels import CancelWatches
from kvhint.router.service.responses_scan import ResponsesObservation, ResponsesRelay
from kvhint.router.service.responses_sessions import ResponseSessions
from kvhint.router.service.routing_service import HeldConversation
from kvhint.router.service.runtime import RouterRuntime
from kvhint.router.service.tenancy import AuthError, api_key_of
from kvhint.router.service.tenant_slots import over_in_flight_answer
from kvhint.router.service.upstream import (
    DATA_PARALLEL_RANK_HEADER,
    UpstreamBroken,
    UpstreamResponse,
    UpstreamTimeout,
    UpstreamUnavailable,
)
from kvhint.router.service.workers import WorkerState
from kvhint.schemas import ResponseCancelled

# The query parameters vLLM's GET reads (the rest are not passed on).
_GET_PARAMETERS = ("starting_after", "stream")
# pydantic's lax bool's false strings (vLLM reads ``?stream=`` as a bool).
_FALSE_VALUES = frozenset({"0", "off", "f", "false", "n", "no"})
_STORED_ONLY = ("vLLM keeps a stored response in the memory of the server that made it "
                "only")


class ResponsesGateway:
    """The Responses API's routes, on the app's state (``app.state.responses``)."""

    def __init__(self, runtime: RouterRuntime) -> None:
        self._runtime = runtime
        self.codec = ResponseIdCodec(runtime.settings.salt_secret)
        self.ids = ResponseIds(runtime.settings.responses.max_ids, runtime.workers,
                               runtime.metrics, self.codec)
        self.sessions = ResponseSessions(runtime.engine, runtime.writer, runtime.metrics,
                                         runtime.settings.responses.session_read_timeout_s)
        # GETs of background responses that ended without their answer.
        self.background = BackgroundReads(self.ids, runtime.metrics)
        # The background responses' streams relayed now, for their cancels.
        self.cancels = CancelWatches(
            runtime.settings.responses.cancel_grace_s,
            runtime.settings.responses.background_idle_s,
            on_forgotten=lambda: runtime.metrics.drop("response_cancel_forgotten"))
        # Cancels relayed by other replicas (responses_cancel_notices.py).
        if runtime.cancel_notices is not None:
            runtime.cancel_notices.listener = self._on_cancel_notice
            runtime.cancel_notices.on_link_up = self._recheck_cancels

    # --- POST /v1/responses -------------------------------------------------------------

    async def create(self, inbound: InboundRequest,
                     gone: asyncio.Future[None] | None) -> Response:
        """Forward a parsed ``POST /v1/responses`` (app.py checked the key, the body and
        its type as for chat)."""
        runtime = self._runtime
        body = inbound.body
        cap = inbound.tenant.max_in_flight
        if cap is not None and runs_in_background(body):
            # Answered queued, it runs on its worker after its slot is given back: a
            # capped tenant could queue any number of them past its max_in_flight.
            runtime.metrics.gateway_rejections.labels(inbound.tenant.name,
                                                      "background_over_cap").inc()
            return self._refused(error_response(
                "background responses run on the worker after this request ends, outside "
                f"your key's limit of {cap} requests in flight (max_in_flight): send it "
                "without 'background'", 400, "background"))
        previous = body.get("previous_response_id")
        only_worker: str | None = None
        conversation: HeldConversation | None = None
        session_conversation = False
        if previous is not None:
            if not isinstance(previous, str):
                return self._refused(error_response("'previous_response_id' must be a string", 400,
                                            "previous_response_id"))
            found = self.ids.find(previous, inbound.tenant.name)
            if isinstance(found, IdMiss):
                return self._refused(_miss_answer(previous, found))
            if (refusal := self._model_refusal(inbound, found)) is not None:
                return self._refused(refusal)
            only_worker, conversation = found.worker_id, follow_up_of(found)
            if inbound.client_session_id is None and found.session_id is not None:
                inbound = _in_session(inbound, found.session_id)
            elif inbound.client_session_id is None and found.in_unknown_session:
                # Another replica's response (or one forgotten): its session is not in
                # its id; the store has it once the replica that relayed it wrote it.
                session_id = await self.sessions.session_of(previous, inbound.tenant.name)
                if session_id is not None:
                    inbound = _in_session(inbound, session_id)
            # Its usage not kept here: its session's record may size it (forwarding.py).
            session_conversation = (conversation is None
                                    and _continues_its_session(found, inbound))
        body.pop("request_id", None)  # a client's: replaced for each worker tried
        tenant, in_session = inbound.tenant.name, inbound.client_session_id is not None

        def name_for(worker: WorkerState) -> str:
            """The router's name for the response (module doc)."""
            return self.codec.mint(tenant, worker.worker_id, worker.epoch, in_session)

        observation = ResponsesObservation()
        response = await runtime.forwarder.forward(inbound, gone, only_worker=only_worker,
                                                   observation=observation,
                                                   name_for=name_for,
                                                   conversation=conversation,
                                                   session_conversation=session_conversation)
        worker_id = response.headers.get(WORKER_HEADER)
        response_id = body.get("request_id")
        if (response.status_code < 400 and worker_id and response_id
                and stores_response(body)):
            learn = partial(self._learn, response_id, tenant, worker_id,
                            inbound.client_session_id)
            background = runs_in_background(body)
            if isinstance(response, RelayResponse) and not background:
                # vLLM stores a streamed response once it has made it all, just before
                # its response.completed (responses/serving.py responses_stream_generator
                # ends in responses_full_generator), never one whose stream failed or was
                # left: learnt at that event, before the client has it (a follow-up can
                # only come after), not at the stream's start.
                observation.on_end = learn
            else:  # answered whole, or a background one: stored queued before its answer
                learn(observation)
            if background:  # running until seen ended (responses_background.py)
                self.ids.running(response_id, inbound.model, int(time.time()))
            if isinstance(response, RelayResponse) and background:
                # Its cancel may leave its stream open for good (responses_cancels.py).
                observation.watch_cancel = partial(self.cancels.watch, response_id,
                                                   worker_id=worker_id)
                self.background.follow(observation, response_id)
        if observation.background:
            runtime.metrics.responses_background.inc()
        return response

    def _learn(self, response_id: str, tenant: str, worker_id: str, session_id: str | None,
               observation: ResponsesObservation) -> None:
        """``worker_id`` holds ``response_id`` now (module doc)."""
        self.ids.learn(response_id, tenant, worker_id, session_id)
        # Its usage, for a follow-up's load: a whole answer's is read already, a
        # stream's at its terminal event, after this.
        observation.on_usage = partial(_measure, self.ids, response_id)
        if observation.prompt_tokens is not None:
            _measure(self.ids, response_id, observation)
        if session_id is not None:
            self.sessions.remember(response_id, tenant, session_id)

    def _refused(self, response: Response) -> Response:
        self._runtime.metrics.record_request("responses", "none", response.status_code)
        return response

    def _model_refusal(self, inbound: InboundRequest, entry: IdEntry) -> Response | None:
        """A follow-up naming a model its response's worker does not serve gets vLLM's
        answer for such a model, not a 503 for the lack of any other worker."""
        worker = self._runtime.workers.get(entry.worker_id)
        if inbound.model is None or worker is None or worker.may_serve(inbound.model):
            return None
        return error_response(f"The model `{inbound.model}` does not exist.", 404, "model",
                      "NotFoundError")

    # --- GET /v1/responses/{id}, POST /v1/responses/{id}/cancel -------------------------

    async def retrieve(self, request: Request) -> Response:
        query = {k: request.query_params[k] for k in _GET_PARAMETERS
                 if k in request.query_params}
        return await self._stored(request, "get", "GET", "", query)

    async def cancel(self, request: Request) -> Response:
        return await self._stored(request, "cancel", "POST", "/cancel", {})

    async def _stored(self, request: Request, op: str, method: str, suffix: str,
                      query: dict[str, str]) -> Response:
        runtime = self._runtime
        counted = runtime.metrics.response_id_requests
        response_id = request.path_params["response_id"]
        try:
            tenant = runtime.directory.client(api_key_of(request.headers))
        except AuthError as exc:
            counted.labels(op, str(exc.status)).inc()
            return error_response(exc.message, exc.status)
        # After the key (none is still a 401): a cancel changes state.
        refusal = cross_site_refusal(method, request.headers, runtime.metrics,
                                     "responses_cancel") if op == "cancel" else None
        if refusal is not None:
            counted.labels(op, "403").inc()
            return error_response(refusal, 403)
        # A streamed GET holds its worker's connection for the response's life: one of
        # the tenant's max_in_flight slots, as an inference request, taken below. A plain
        # GET and a cancel are short calls (a cancel ends work): one of its api_calls,
        # as a session end is.
        streamed = op == "get" and _asks_stream(query.get("stream"))
        if not streamed and (over := runtime.call_rate.take(tenant)) is not None:
            counted.labels(op, "429").inc()
            return over.answer()
        found = self.ids.find(response_id, tenant.name)
        if isinstance(found, IdMiss):
            answer = (self.background.lost(response_id, tenant.name, found.reason, streamed)
                      if op == "get" else None) or _miss_answer(response_id, found)
            counted.labels(op, str(answer.status_code)).inc()
            return answer
        slots = runtime.forwarder.slots
        if streamed and not slots.admit(tenant):
            counted.labels(op, "429").inc()
            return over_in_flight_answer(tenant)
        slot = Slot(partial(slots.give_back, tenant.name) if streamed else None)
        try:
            return await self._opened(found, response_id, op, method, suffix, query,
                                      counted, slot)
        except asyncio.CancelledError:
            # The router stopping past http_shutdown_grace_s, the worker's answer still to
            # come: a JSON 503, not uvicorn's plain-text 500 (Forwarder.forward).
            counted.labels(op, "503").inc()
            return error_response(SHUTTING_DOWN, 503)
        finally:
            if not slot.relayed:  # answered whole, refused, or cancelled: given back now
                slot.give_back()

    async def _opened(self, found: IdEntry, response_id: str, op: str, method: str,
                      suffix: str, query: dict[str, str], counted: Any,
                      slot: Slot) -> Response:
        runtime = self._runtime
        worker = runtime.workers.get(found.worker_id)
        assert worker is not None and worker.url is not None  # find() checked it
        url = f"{worker.url}/v1/responses/{quote(response_id, safe='')}{suffix}"
        if query:
            url += "?" + urlencode(query)
        dp_rank = worker.status.data_parallel_header if worker.status is not None else None
        try:
            upstream = await runtime.pool.open(
                worker.worker_id, url, b"",
                None if dp_rank is None else {DATA_PARALLEL_RANK_HEADER: str(dp_rank)},
                method=method)
        except UpstreamUnavailable as exc:
            # What any request's failure says of the worker (forwarding.py): down now,
            # probed, its address's other ranks too where it took no connection.
            runtime.forwarder.note_failure(worker, exc)
            answer = (unavailable_answer(exc) if exc.status is not None else error_response(
                f"Response with id '{response_id}' is held by worker {worker.worker_id}, "
                f"which could not be reached ({exc.client_reason}); retry later "
                f"({_STORED_ONLY}).", 502, "response_id"))
            counted.labels(op, str(answer.status_code)).inc()
            return answer
        except UpstreamTimeout as exc:
            runtime.forwarder.note_silence(worker)
            counted.labels(op, "504").inc()
            return error_response(str(exc), 504)
        worker.note_answered()
        return await self._relayed(upstream, lambda code: counted.labels(op, str(code)).inc(),
                                   response_id, op, query.get("starting_after"),
                                   found, slot)

    async def _relayed(self, upstream: UpstreamResponse, count: Callable[[int], None],
                       response_id: str, op: str, starting_after: str | None,
                       found: IdEntry, slot: Slot) -> Response:
        """The worker's answer to a GET or cancel, as it is: whole, or an event stream (a
        background response's events, ``?stream=true``) relayed as it comes, each event
        whole, ended by the router where a cancel left it open (responses_cancels.py). A
        cancel the worker accepted starts the grace of that response's streams, here and
        on every other replica (responses_cancel_notices.py); a stream of a response
        cancelled before (``found.cancelled``, or a cancel seen lately) starts in it. A
        GET of a background response the router knows ended without its answer is
        answered ``failed`` (responses_background.py)."""
        tenant = found.tenant
        headers = dict(upstream.headers)
        headers[WORKER_HEADER] = upstream.worker_id
        if not headers.get("content-type", "").startswith("text/event-stream"):
            try:
                payload = await upstream.read()
            except UpstreamBroken as exc:  # past upstream_answer_max_bytes too
                # A broken answer, as a POST's or a streamed GET's is (forwarding.py).
                self._runtime.metrics.broken_streams.labels(upstream.worker_id).inc()
                code = 504 if exc.timed_out else 502
                count(code)
                return error_response(f"worker failed while responding: {exc}", code)
            if op == "get" and (answer := self.background.read_back(
                    response_id, tenant, upstream.status, payload,
                    slot.streamed)) is not None:
                count(answer.status_code)
                return answer
            count(upstream.status)
            if op == "cancel" and 200 <= upstream.status < 300:
                self._cancelled(response_id, _json_object(payload))
                if self._runtime.cancel_notices is not None:
                    await self._runtime.cancel_notices.publish(response_id, tenant,
                                                               upstream.worker_id)
            return Response(payload, status_code=upstream.status, headers=headers)
        # vLLM numbers a GET's events on from starting_after (the router's own last one
        # goes on from there).
        first = int(starting_after) + 1 if starting_after and starting_after.isdigit() else 0
        observation = ResponsesObservation(events=first)
        if (held := self.ids.held(response_id, tenant)) and held.running_since is not None:
            self.background.follow(observation, response_id)
        relay = ResponsesRelay(observation)
        watch = self.cancels.watch(response_id, upstream.close, upstream.worker_id)
        if found.cancelled or self.cancels.was_cancelled(response_id):
            watch.cancelled(None, self.cancels.grace_s)
        slot.relayed = True  # given back by the stream, at its end
        return streamed_get(upstream, headers, count, relay, watch, self._runtime, slot)


    def _on_cancel_notice(self, notice: ResponseCancelled) -> int | None:
        """Another replica relayed a cancel of ``notice.response_id`` its worker
        accepted: this replica's streams of it start their grace; how many (None: an id
        not minted for its tenant and worker under this fleet's key, not acted on)."""
        minted = self.codec.read(notice.response_id)
        if (minted is None or minted.worker_id != notice.worker_id
                or not self.codec.binds(minted, notice.tenant)):
            return None
        return self._cancelled(notice.response_id, None)

    def _cancelled(self, response_id: str, answer: dict[str, Any] | None) -> int:
        """A worker accepted a cancel of ``response_id`` (``answer``: its word, if
        known): its streams here start their grace; how many."""
        self.ids.cancelled(response_id)
        return self.cancels.cancelled(response_id, answer)

    def _recheck_cancels(self) -> None:
        """The NATS link came up again: the notices of the cancels while it was down are
        lost; the workers are asked instead (responses_cancel_rechecks.py)."""
        runtime = self._runtime
        # The runtime's task (task_set.py): ended at its stop, before the pool it uses.
        runtime.tasks.spawn(recheck_streams(
            self.cancels, runtime.workers, runtime.pool, runtime.metrics, self._cancelled),
            "kvhint-cancel-rechecks")


def _asks_stream(value: str | None) -> bool:
    """Whether vLLM may stream a GET with ``?stream=value``: anything but absent or a
    false value of pydantic's lax bool, which vLLM's ``stream: bool`` query reads (a
    value it refuses is its 422 at once: the slot taken for it comes back then)."""
    return value is not None and value.lower() not in _FALSE_VALUES


def _json_object(payload: bytes) -> dict[str, Any] | None:
    """``payload`` as a JSON object, or None."""
    try:
        value = json.loads(payload)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def follow_up_of(entry: IdEntry) -> HeldConversation | None:
    """What a follow-up of ``entry``'s response prompts its worker with beyond its own
    body: the conversation so far (the response's prompt and completion, its reasoning
    left out, as vLLM renders it), of which that worker likely still holds the prompt it
    just served in its prefix cache (a session's gap is protected there: DESIGN.md). An
    estimate, booked as load only, never a prediction. None while the response's usage
    is unknown (a stream not ended, a background response, an id read from itself):
    the session's record may size it then (routing_service.py
    ``conversation_of_session``), else the body alone is counted, as before."""
    if entry.prompt_tokens is None or entry.context_tokens is None:
        return None
    return HeldConversation(entry.worker_id, entry.context_tokens, entry.prompt_tokens)


def _continues_its_session(entry: IdEntry, inbound: InboundRequest) -> bool:
    """Whether ``inbound`` continues the session ``entry``'s response was made in, as
    far as this replica can tell: the one this map holds for it, or, for an id read from
    itself (made in a session not named in it), whichever the follow-up continues (the
    one the store named for it, or the client's own: a client naming another session
    than its response's is not told apart). A response made in no session: never."""
    if inbound.client_session_id is None:
        return False
    if entry.session_id is not None:
        return entry.session_id == inbound.client_session_id
    return entry.in_unknown_session


def _measure(ids: ResponseIds, response_id: str, observation: ResponsesObservation) -> None:
    """Keep ``response_id``'s usage, once read, on its id (:func:`follow_up_of`). Of its
    completion, vLLM renders into a follow-up's prompt the output messages' text only
    (responses/utils.py ``construct_input_messages``): not the reasoning, nor a tool
    call (an answer with one counts none of its completion: the text beside a call is
    short, and a call's arguments may be long)."""
    if observation.prompt_tokens is None:
        return
    completion = 0 if observation.tool_names else max(
        (observation.completion_tokens or 0) - observation.reasoning_tokens, 0)
    ids.measured(response_id, observation.prompt_tokens,
                 observation.prompt_tokens + completion)


def _in_session(inbound: InboundRequest, session_id: str) -> InboundRequest:
    """``inbound`` continuing the client's session ``session_id``."""
    inbound.body["session_id"] = inbound.tenant.worker_session_id(session_id)
    return dataclasses.replace(inbound, client_session_id=session_id)


def _miss_answer(response_id: str, miss: IdMiss) -> Response:
    """What a client is told for a response id the router does not send on."""
    if miss.reason in ("unknown", "other_tenant", "unverified"):
        # vLLM's own words for an id it does not hold: another tenant's id looks the same.
        return error_response(f"Response with id '{response_id}' not found.", 404, "response_id")
    if miss.reason == "worker_down":
        return error_response(f"Response with id '{response_id}' is held by worker "
                      f"{miss.worker_id}, which is unavailable now; retry later "
                      f"({_STORED_ONLY}).", 503, "response_id")
    why = ("has left the fleet" if miss.reason == "worker_gone"
           else "has restarted since")
    return error_response(f"Response with id '{response_id}' not found: worker {miss.worker_id}, "
                  f"which stored it, {why} ({_STORED_ONLY}).", 404, "response_id")

