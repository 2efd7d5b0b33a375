"""The router's ASGI app: :func:`create_app` builds it, its lifespan builds everything else
(:class:`~kvhint.router.service.runtime.RouterRuntime`).

The inference routes bypass FastAPI on purpose (:class:`RouterApp`): they read the raw body
once, skip FastAPI's body validation (vLLM validates, and its errors pass through), and
keep the router's added latency and CPU per streamed token small. Handlers are thin: authenticate, parse into a typed
:class:`InboundRequest`, hand it to the forwarder.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.convertors import PathConvertor
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from kvhint.router.service.admin_api import build_admin_router
from kvhint.router.service.dashboard import build_dashboard_router
from kvhint.router.service.relay_response import wait_disconnect
from kvhint.router.service.inbound import (
    SESSION_END_HEADER,
    SESSION_HEADER,
    BadRequest,
    BodyTimeout,
    Endpoint,
    check_json_media_type,
    error_response,
    parse_inbound,
    read_body_within,
    refusal_headers,
)
from kvhint.router.service.metrics import CONTENT_TYPE
from kvhint.router.service.origin_policy import OriginPolicy
from kvhint.router.service.responses_api import ResponsesGateway
from kvhint.router.service.runtime import RouterRuntime
from kvhint.router.service.sampling import check_parallel_samples
from kvhint.router.service.sessions_api import build_sessions_router
from kvhint.router.service.settings import RouterSettings
from kvhint.router.service.store_errors import STORE_ERRORS, StoreReadErrors
from kvhint.router.service.tenancy import AuthError, api_key_of, bearer_matches

log = logging.getLogger("kvhint.router")


class RouterApp:
    """The ASGI app uvicorn runs: the inference routes go straight to their handler
    (the path every token takes: no middleware frames around each streamed chunk);
    everything else, lifespan included, is the FastAPI app."""

    def __init__(self, api: FastAPI, origins: OriginPolicy) -> None:
        self.api = api
        self.origins = origins

    @property
    def state(self) -> Any:
        return self.api.state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.api(scope, receive, send)
            return
        if _ambiguous_length(scope):
            # Content-Length and Transfer-Encoding both: h11 reads the chunked body and
            # kept the connection open. A proxy in front that goes by Content-Length
            # (one connection carrying every tenant's requests) then sends the rest of
            # this body's bytes, or the next client's request, as what the router
            # takes for this body's end or the next request: one client's bytes in
            # another's request (RFC 9112 6.1: reject it, or close after it). Refused,
            # unread, and the connection closed; counted.
            runtime = getattr(self.api.state, "runtime", None)
            if runtime is not None:
                runtime.metrics.route_refusals.labels("ambiguous_length").inc()
            answer = error_response("a request may carry Content-Length or "
                                    "Transfer-Encoding, not both", 400)
            answer.headers["connection"] = "close"
            await answer(scope, receive, send)
            return
        grant = None
        if self.origins.active:  # dev mode's Host check, CORS (origin_policy.py)
            answer = self.origins.screen(scope, self.api.state.runtime.metrics)
            if answer is not None:
                await answer(scope, receive, send)
                return
            grant = self.origins.cors_grant(scope)
        if scope["method"] == "POST":
            endpoint = _INFERENCE_PATHS.get(scope["path"])
            if endpoint is not None:
                scope["app"] = self.api
                request = Request(scope, receive)
                try:
                    response = await _inference(request, endpoint)
                except Exception as exc:  # noqa: BLE001 - answer 500, count, log
                    response = await _internal_error(request, exc)
                if grant is not None:  # on the response: no frame around its chunks
                    grant.apply(response.headers)
                await response(scope, receive, send)
                return
        await self.api(scope, receive, send if grant is None else grant.wrap(send))


def _ambiguous_length(scope: Scope) -> bool:
    """Whether the request's headers carry both a Content-Length and a
    Transfer-Encoding (a request smuggling attempt, or a broken client). ASGI servers
    give header names lower-cased."""
    length = coded = False
    for name, _ in scope["headers"]:
        if name == b"content-length":
            length = True
        elif name == b"transfer-encoding":
            coded = True
    return length and coded


def create_app(settings: RouterSettings) -> RouterApp:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        runtime = await RouterRuntime.start(settings)
        app.state.runtime = runtime
        app.state.responses = ResponsesGateway(runtime)
        try:
            yield
        finally:
            await runtime.stop()

    docs = settings.api_docs  # off by default: swagger-ui comes from a CDN
    # redirect_slashes off: Starlette built its trailing-slash redirect's absolute URL
    # from the request's Host header, so a forged Host sent clients to another origin.
    # No route needs a second spelling: a path with a stray "/" is a 404.
    app = FastAPI(title="kvhint router", version="0.1.0", lifespan=lifespan,
                  docs_url="/docs" if docs else None, redoc_url="/redoc" if docs else None,
                  openapi_url="/openapi.json" if docs else None, redirect_slashes=False)
    # Also known to FastAPI (a GET gets 405, not 404); POSTs never reach these.
    app.router.add_route("/v1/chat/completions", _chat, methods=["POST"])
    app.router.add_route("/v1/completions", _completions, methods=["POST"])
    app.router.add_route("/v1/responses", _responses, methods=["POST"])
    app.router.add_route("/v1/responses/{response_id}", _response_get, methods=["GET"])
    app.router.add_route("/v1/responses/{response_id}/cancel", _response_cancel,
                         methods=["POST"])
    app.router.add_route("/v1/models", _models, methods=["GET"])
    _no_head(app, ("/v1/responses/{response_id}", "/v1/models"))
    app.router.add_route("/health", _health, methods=["GET"])
    app.router.add_route("/ready", _ready, methods=["GET"])
    app.router.add_route("/metrics", _metrics, methods=["GET"])
    app.include_router(build_sessions_router())
    app.include_router(build_admin_router())
    app.include_router(build_dashboard_router())
    _path_parameters_take_line_breaks(app)
    store_errors = StoreReadErrors()  # a failed store read: 503 if it may pass, else 500
    for store_error in STORE_ERRORS:
        app.add_exception_handler(store_error, store_errors)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(Exception, _internal_error)
    return RouterApp(app, OriginPolicy(settings, error_response))


def _no_head(app: FastAPI, paths: tuple[str, ...]) -> None:
    """HEAD off on the GET routes at ``paths``: a 405 (with ``Allow: GET``), counted
    as ``method_not_allowed``, as on the admin and dashboard routes. Starlette adds
    HEAD to every GET route and runs the GET handler for it: a HEAD of a stored
    response made the worker call a GET does and took one of its tenant's
    ``api_calls``, a HEAD of ``/v1/models`` asked every worker, all for a body
    thrown away. HEAD stays where a GET calls no worker (``/health``, ``/ready``,
    ``/metrics``: what probes send)."""
    for route in app.router.routes:
        if getattr(route, "path", None) in paths and isinstance(route.methods, set):
            route.methods.discard("HEAD")


def _path_parameters_take_line_breaks(app: FastAPI) -> None:
    """A ``{name:path}`` parameter (a session id, which may hold ``/``) is Starlette's
    ``.*``, which stops at a line break: an id with ``%0A`` matched no route, a 404
    counted nowhere, where every other control character is refused by the route's own
    check and counted (400 on ``/v1``, 422 on ``/admin``). Matched across line breaks,
    it is refused the same way."""
    for route in app.router.routes:
        convertors = getattr(route, "param_convertors", {})
        if any(isinstance(c, PathConvertor) for c in convertors.values()):
            route.path_regex = re.compile(route.path_regex.pattern, re.DOTALL)


_INFERENCE_PATHS = {e.path: e for e in Endpoint}


def runtime_of(request: Request) -> RouterRuntime:
    return request.app.state.runtime


async def _chat(request: Request) -> Response:
    return await _inference(request, Endpoint.CHAT)


async def _completions(request: Request) -> Response:
    return await _inference(request, Endpoint.COMPLETION)


async def _responses(request: Request) -> Response:
    return await _inference(request, Endpoint.RESPONSES)


async def _response_get(request: Request) -> Response:
    return await request.app.state.responses.retrieve(request)


async def _response_cancel(request: Request) -> Response:
    return await request.app.state.responses.cancel(request)


async def _inference(request: Request, endpoint: Endpoint) -> Response:
    runtime = runtime_of(request)
    headers = request.headers
    try:
        tenant = runtime.directory.client(api_key_of(headers))
        body = await read_body_within(request.stream(), headers.get("content-length"),
                                      runtime.settings.max_body_bytes,
                                      runtime.settings.http_body_timeout_s)
        check_json_media_type(headers.get("content-type"))  # read first: no unread body
        inbound = parse_inbound(endpoint, body, tenant, headers.get(SESSION_HEADER),
                                headers.get(SESSION_END_HEADER))
        check_parallel_samples(inbound.body, runtime.settings.routing.max_n,
                               runtime.settings.routing.max_sequences, endpoint)
    except AuthError as exc:
        runtime.metrics.record_request(endpoint.value, "none", exc.status)
        return error_response(exc.message, exc.status)
    except BadRequest as exc:
        if isinstance(exc, BodyTimeout):
            runtime.metrics.client_timeouts.labels("body").inc()
        if exc.rejection is not None:  # a tenant policy's (parse_inbound: after the key)
            runtime.metrics.gateway_rejections.labels(tenant.name, exc.rejection).inc()
        runtime.metrics.record_request(endpoint.value, "none", exc.status)
        return error_response(exc.message, exc.status, exc.param, exc.error_type)
    except ClientDisconnect:
        # Gone before its body was whole: nothing to forward, nobody to answer; a 499
        # like any client that leaves (forwarding.py), not an error of the router's.
        runtime.metrics.record_request(endpoint.value, "none", 499)
        return Response(status_code=499)
    # Watches for the client leaving until the response starts (a worker still busy
    # before its first byte); a streamed response then watches for itself.
    gone = asyncio.ensure_future(wait_disconnect(request.receive))
    try:
        if endpoint is Endpoint.RESPONSES:  # names, and may continue, a stored response
            return await request.app.state.responses.create(inbound, gone)
        return await runtime.forwarder.forward(inbound, gone)
    finally:
        gone.cancel()


async def _models(request: Request) -> Response:
    """The union of the workers' /v1/models (by model id), as far as the caller's key may
    use them: a client key is required as for inference (outside dev mode)."""
    runtime = runtime_of(request)
    try:
        tenant = runtime.directory.client(api_key_of(request.headers))
    except AuthError as exc:
        # Counted as every other refusal is (before, counted nowhere).
        runtime.metrics.route_refusals.labels("unauthorized").inc()
        return error_response(exc.message, exc.status)
    workers = [w for w in runtime.workers.routable() if w.url]
    if not workers:
        # Counted (before: nowhere) as every refusal outside /admin is; an inference
        # request's 503 is requests_total's, whose error ratio a listing stays out of.
        runtime.metrics.route_refusals.labels("no_worker").inc()
        return error_response("no worker available", 503)
    results = await asyncio.gather(
        *(runtime.pool.get_json(w.url + "/v1/models", timeout_s=5.0, worker_id=w.worker_id)
          for w in workers),
        return_exceptions=True)
    merged: dict[str, Any] = {}
    answered = False
    for result in results:
        # A listing of another shape (``data`` no array, an id no string) is read as no
        # answer, as one that is not JSON is: one worker's answer never fails the
        # listing of the others' models (before, a TypeError here: every client's 500).
        models = result.get("data", []) if isinstance(result, dict) else None
        if not isinstance(models, list):
            continue
        answered = True
        for item in models:
            if (isinstance(item, dict) and isinstance(item.get("id"), str)
                    and tenant.may_use(item["id"])):
                merged.setdefault(item["id"], _client_model_card(item))
    if not answered:
        runtime.metrics.route_refusals.labels("no_worker_answered").inc()
        return error_response("no worker answered /v1/models", 502)
    return JSONResponse({"object": "list", "data": list(merged.values())})


# What a worker's model card holds that is no client's business: ``root``, the model's (or
# a LoRA adapter's) path on the worker's disk. The router reads it itself at start
# (runtime.py, for the tokenizer); OpenAI's card has id, object, created and owned_by,
# vLLM's adds parent, max_model_len (clients size prompts by it) and permission: kept.
_WORKER_ONLY_MODEL_FIELDS = frozenset({"root"})


def _client_model_card(item: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in item.items() if k not in _WORKER_ONLY_MODEL_FIELDS}


async def _health(request: Request) -> Response:
    """Liveness: always 200. Counts for anyone (a load balancer or kubelet probes it
    without a key; ``/ready`` likewise gives counts only); each worker's id and state only
    to an admin key (any, in dev mode), as ``/admin/workers`` does. Before, every caller
    got the fleet's worker ids, heartbeat-learned ones included. Never URLs nor errors."""
    runtime = runtime_of(request)
    workers = runtime.workers.all()
    body: dict[str, Any] = {
        "status": "ok",
        "dev_mode": runtime.directory.dev_mode,
        "known_workers": len(workers),
        "routable_workers": sum(1 for w in workers if w.routable),
        "plugins_alive": sum(1 for w in workers if w.plugin_alive),
        "nats_connected": runtime.link.connected if runtime.link is not None else False,
    }
    try:
        runtime.directory.admin(api_key_of(request.headers))
    except AuthError:
        return JSONResponse(body)
    body["workers"] = {w.worker_id: {"http_up": w.http_up, "plugin_alive": w.plugin_alive}
                       for w in workers}
    return JSONResponse(body)


async def _ready(request: Request) -> Response:
    """Readiness, not liveness (``/health``): 200 once some worker the router would route
    to has answered it over HTTP at its current address (listed its models, started a
    response, answered a /health probe: ``WorkerState.answered``), else 503 with the
    reason. A worker that moved has answered nowhere yet at its new address. A router
    that can only answer 503 "no worker available" is kept out of a load balancer's
    rotation by this, and not restarted; NATS is not required, as routing goes on
    without the KV events (on stale overlaps)."""
    workers = runtime_of(request).workers.all()
    routable = [w for w in workers if w.routable]
    answered = [w for w in routable if w.answered]
    if answered:
        return JSONResponse({"status": "ready", "ready_workers": len(answered)})
    if not workers:
        reason = "no worker configured or heard from yet"
    elif not routable:
        reason = "every known worker is down"
    else:
        reason = "no worker has answered yet"
    # An error answer as the router's others are (refusal_headers: ``nosniff``); its
    # body stays the probe's own shape, which load balancers and tests read.
    return JSONResponse({"status": "not_ready", "reason": reason,
                         "known_workers": len(workers)}, status_code=503,
                        headers=refusal_headers(503))


async def _metrics(request: Request) -> Response:
    runtime = runtime_of(request)
    token = runtime.settings.metrics_token
    if token is not None and not bearer_matches(request.headers.get("authorization"), token):
        runtime.metrics.route_refusals.labels("unauthorized").inc()  # before: uncounted
        return error_response("/metrics needs the metrics token (Authorization: Bearer <token>)", 401)
    return Response(runtime.metrics.render(), media_type=CONTENT_TYPE)


async def _http_error(request: Request, exc: HTTPException) -> Response:
    """Starlette's own refusals (no route: 404; a route without the method: 405, with
    its ``Allow``) and the admin API's, in the OpenAI error shape every other answer has
    (FastAPI's default body is ``{"detail": ...}``); status and headers unchanged.
    Starlette's are counted here (:func:`_count_unrouted`); the admin API counts its own."""
    _count_unrouted(request, exc)
    return error_response(str(exc.detail), exc.status_code, headers=exc.headers)


def _count_unrouted(request: Request, exc: HTTPException) -> None:
    """Count a request Starlette's routing refused, by a bounded reason (never the path):
    no route matched it (404: Starlette sets ``scope["route"]`` on a match only), or a
    route matched its path without its method (405: raised by the route before its
    handler; no handler raises 405). Under ``/admin`` in ``admin_rejections`` (the
    refusals the admin API counts, its handlers' own included), elsewhere in
    ``route_refusals``. Before, both were counted nowhere."""
    if "route" not in request.scope:
        reason = "unknown_path"
    elif exc.status_code == 405:
        reason = "method_not_allowed"
    else:
        return  # a handler's own refusal: its API counts it
    runtime = getattr(request.app.state, "runtime", None)
    if runtime is None:
        return
    path = request.scope.get("path", "")
    if path == "/admin" or path.startswith("/admin/"):
        runtime.metrics.admin_rejections.labels(reason).inc()
    else:
        runtime.metrics.route_refusals.labels(reason).inc()


# Where FastAPI found a bad parameter (the first item of a validation error's ``loc``),
# as an error message names it.
_PARAMETER_PLACES = {"query": "query parameter", "path": "path parameter",
                     "header": "header", "cookie": "cookie"}


async def _validation_error(request: Request, exc: RequestValidationError) -> Response:
    """A path or query parameter FastAPI refused (the admin API's bounds and names): 422
    as before (clients and tests read it), in the error shape of :func:`_http_error`
    instead of FastAPI's ``{"detail": [...]}``. The message names each parameter and
    pydantic's ``msg`` (what was expected); the value sent (``input``, ``ctx``) is left
    out, so no key or name a caller put in a URL comes back. ``param`` is the first
    parameter's name. A body error names no field: past its top level a ``loc`` holds
    the body's own keys."""
    problems: list[str] = []
    param: str | None = None
    for error in exc.errors():
        loc = error.get("loc") or ()
        place = _PARAMETER_PLACES.get(str(loc[0])) if loc else None
        if place is not None and len(loc) > 1:
            name = str(loc[1])
            param = param or name
            problems.append(f"{place} {name!r}: {error.get('msg', 'invalid')}")
        else:
            problems.append(f"request body: {error.get('msg', 'invalid')}")
    return error_response("; ".join(problems) or "invalid request", 422, param)


async def _internal_error(request: Request, exc: Exception) -> Response:
    # repr'd: the path is the client's, percent-decoded (a %0A would start a line).
    log.exception("unhandled error on %r", request.url.path[:500], exc_info=exc)
    runtime = getattr(request.app.state, "runtime", None)
    if runtime is not None:
        runtime.metrics.drop("internal_error")
    return error_response(f"internal router error: {type(exc).__name__}", 500)


