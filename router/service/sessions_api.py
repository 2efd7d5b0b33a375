"""Session endpoints for clients and agent runtimes.

- ``DELETE /v1/sessions/{id}``: end a session (the tenant's own key, or an admin key);
  the planner demotes or releases what the session held.
- ``POST /v1/sessions/{id}/hints``: explicit hints from an agent runtime (admin key; a
  tenant admin key acts for its own tenant, a global one names ``?tenant=``). The router
  checks tenancy, bounds (each action's: :mod:`.hint_api_actions`) and budgets before
  anything is sent; a request with any invalid action changes nothing (422), one over
  budget changes nothing (429). Otherwise the
  actions go to the session's worker and the answer carries their outcomes (202 when
  some are still pending after ``wait_s``; a tenant's key reads their reasons without
  the worker-wide budget figures, :mod:`.tenant_reasons`). A session its client ended
  (DELETE, or ``X-Session-End``) takes no hints (409) until its next turn opens it again; one the
  planner abandoned when idle still does. Pins, Retains and Demotes go as the agent's
  (``owner: agent``) to workers that take it, whatever ``owner`` the caller wrote, so the
  planner's re-planning of the session never undoes them; the router keeps them as their
  own holding (:func:`agent_scope`).
- Both refuse what a page on another site can make a browser send (:mod:`.cross_site`:
  they are open in dev mode), and calls past their key's tenant's ``api_calls`` rate
  (429 with ``Retry-After``, :mod:`.tenant_call_rate`), before they read the store.
"""

from __future__ import annotations

import math
import time
from typing import Any

import msgspec
from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response
from starlette.requests import ClientDisconnect

from kvhint.router.policy import PlannedAction
from kvhint.router.service.cross_site import cross_site_refusal
from kvhint.router.service.hint_api_actions import (
    STILL_PENDING,
    HintRequestAction,
    call_action_ids,
    checked_action,
    held_for_s,
    holding_scope,
    target_blocks,
)
from kvhint.router.service.hint_open_calls import OPEN_HINTS_REJECTION, HintOpenCalls
from kvhint.router.service.hint_open_calls import RETRY_AFTER_S as OPEN_HINTS_RETRY_AFTER_S
from kvhint.router.service.hint_records import FAILED
from kvhint.router.service.inbound import (
    BadRequest,
    BodyTimeout,
    check_session_id,
    openai_error,
    read_body_within,
    refusal_headers,
)
from kvhint.router.service.runtime import RouterRuntime
from kvhint.router.service.sessions import ENDED
from kvhint.router.service.settings import TenantBudget
from kvhint.router.service.tenancy import DEFAULT_TENANT, AuthError, Principal, api_key_of
from kvhint.router.service.tenant_call_rate import CALL_RATE_REJECTION
from kvhint.router.service.tenant_reasons import rows_for
from kvhint.schemas import MAX_HEARTBEAT_INTERVAL_S, ActionType

MAX_ACTIONS_PER_CALL = 16


class HintRequest(msgspec.Struct, forbid_unknown_fields=True):
    actions: list[HintRequestAction]
    # Override the session's current worker (e.g. prefetch on the worker it will move to).
    worker_id: str | None = None
    wait_s: float | None = None


def _json_error(message: str, status: int, **extra: Any) -> JSONResponse:
    body = msgspec.json.decode(openai_error(message, status))
    body["error"].update(extra)
    return JSONResponse(body, status_code=status, headers=refusal_headers(status))


class _Rejected(Exception):
    """A hints call refused (nothing sent): answered and counted in one place,
    :func:`_rejection`, under ``reason`` (one of ``metric_labels.HINT_API_REJECTIONS``)."""

    def __init__(self, reason: str, message: str, status: int,
                 headers: dict[str, str] | None = None, **extra: Any) -> None:
        super().__init__(message)
        self.reason, self.message, self.status = reason, message, status
        self.headers, self.extra = headers or {}, extra


# On a 409 or 429 that the same call sent again cannot change (a budget, not a rate; an
# ended session; no worker yet): OpenAI's SDKs retry every 409 and 429 unless told not
# to by this header, twice by default, each time for nothing.
_NO_RETRY = {"x-should-retry": "false"}
_AUTH_REASONS = {401: "unauthorized", 403: "forbidden"}
_BAD_REQUEST_REASONS = {413: "too_large", 408: "body_timeout"}


def _rejection(runtime: RouterRuntime, rejected: _Rejected) -> Response:
    runtime.metrics.hint_api_rejections.labels(rejected.reason).inc()
    if rejected.status == 499:  # the client is gone: nobody reads an answer
        return Response(status_code=499)
    response = _json_error(rejected.message, rejected.status, **rejected.extra)
    response.headers.update(rejected.headers)
    return response


def _principal(runtime: RouterRuntime, request: Request) -> Principal:
    key = api_key_of(request.headers)
    return runtime.directory.principal(key)


def _tenant_for(principal: Principal, tenant: str | None) -> str:
    if principal.tenant is not None:
        if tenant is not None and tenant != principal.tenant.name:
            raise AuthError(403, f"this key acts for tenant {principal.tenant.name!r} only")
        return principal.tenant.name
    return tenant or DEFAULT_TENANT


def build_sessions_router() -> APIRouter:
    router = APIRouter(tags=["sessions"])
    open_calls = HintOpenCalls()  # each tenant's hints calls open now

    @router.delete("/v1/sessions/{session_id:path}")
    async def end_session(session_id: str, request: Request,
                          tenant: str | None = Query(None)) -> Response:
        runtime: RouterRuntime = request.app.state.runtime
        refused = runtime.metrics.session_end_rejections  # each refusal, by reason
        try:
            check_session_id(session_id)
            principal = _principal(runtime, request)
            tenant_name = _tenant_for(principal, tenant)
        except AuthError as exc:
            refused.labels(_AUTH_REASONS.get(exc.status, "forbidden")).inc()
            return _json_error(exc.message, exc.status)
        except BadRequest as exc:
            refused.labels("bad_request").inc()
            return _json_error(exc.message, exc.status)
        # After the key (none is still a 401): what a page on another site can send.
        refusal = cross_site_refusal(request.method, request.headers, runtime.metrics,
                                     "session_end")
        if refusal is not None:
            refused.labels("cross_site").inc()
            return _json_error(refusal, 403)
        # Before the store read and the end's sends: a tenant's ends are bounded too.
        if (over := runtime.call_rate.take(principal.tenant)) is not None:
            refused.labels(CALL_RATE_REJECTION).inc()
            return over.answer()
        await runtime.lifecycle.recall(tenant_name, session_id)  # forgotten from memory
        record = runtime.sessions.get(tenant_name, session_id)
        if record is None:
            refused.labels("unknown_session").inc()
            return _json_error(f"unknown session {session_id!r} for tenant {tenant_name!r}", 404)
        sent = await runtime.lifecycle.end(record)
        return JSONResponse({"tenant": tenant_name, "session_id": session_id,
                             "state": record.state,
                             "hints": rows_for(principal, [a.row() for a in sent])})

    @router.post("/v1/sessions/{session_id:path}/hints")
    async def send_hints(session_id: str, request: Request,
                         tenant: str | None = Query(None)) -> Response:
        runtime: RouterRuntime = request.app.state.runtime
        try:
            principal, tenant_name, hint_request = await _read_call(
                runtime, request, session_id, tenant)
            # Charged as the call rate is (hint_open_calls.py), before anything is sent.
            charged = runtime.directory.charged(principal.tenant).name
            if (over := open_calls.enter(charged, runtime.settings.hints.api_max_open_calls,
                                         runtime.metrics)) is not None:
                raise _Rejected(OPEN_HINTS_REJECTION, over, 429,
                                {"retry-after": str(OPEN_HINTS_RETRY_AFTER_S)})
            try:
                return await _send_hints(runtime, principal, tenant_name, session_id,
                                         hint_request)
            finally:
                open_calls.leave(charged)
        except _Rejected as rejected:
            return _rejection(runtime, rejected)

    return router


async def _read_call(runtime: RouterRuntime, request: Request, session_id: str,
                     tenant: str | None) -> tuple[Principal, str, HintRequest]:
    """Who calls, for which tenant, and what it asks; or :class:`_Rejected`."""
    try:
        check_session_id(session_id)
        principal = _principal(runtime, request)
        if not principal.is_admin:
            raise AuthError(403, "sending hints needs an admin key")
        tenant_name = _tenant_for(principal, tenant)
        # After the key (none is still a 401), before the body is read: what a page on
        # another site can send (a form's POST of a JSON-looking text/plain body).
        refusal = cross_site_refusal(request.method, request.headers, runtime.metrics,
                                     "session_hints")
        if refusal is not None:
            raise _Rejected("cross_site", refusal, 403)
        # Before the body, the store read and anything sent: every call counts, not only
        # the actions sent (budget.max_actions_per_minute counts those).
        if (over := runtime.call_rate.take(principal.tenant)) is not None:
            raise _Rejected(CALL_RATE_REJECTION, over.message, over.STATUS, over.headers)
        body = await read_body_within(request.stream(), request.headers.get("content-length"),
                                      runtime.settings.max_body_bytes,
                                      runtime.settings.http_body_timeout_s)
        return principal, tenant_name, msgspec.json.decode(body, type=HintRequest)
    except AuthError as exc:
        raise _Rejected(_AUTH_REASONS.get(exc.status, "forbidden"), exc.message,
                        exc.status) from None
    except BadRequest as exc:
        if isinstance(exc, BodyTimeout):
            runtime.metrics.client_timeouts.labels("body").inc()
        raise _Rejected(_BAD_REQUEST_REASONS.get(exc.status, "bad_request"), exc.message,
                        exc.status) from None
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise _Rejected("bad_request", f"invalid hints request: {exc}", 400) from None
    except RecursionError:  # msgspec gives up around 1,000 levels of nesting
        raise _Rejected("bad_request", "hints request is nested too deeply", 400) from None
    except ClientDisconnect:
        raise _Rejected("client_gone", "the client left while sending its body",
                        499) from None


async def _send_hints(runtime: RouterRuntime, principal: Principal, tenant_name: str,
                      session_id: str, hint_request: HintRequest) -> JSONResponse:
    tenant = runtime.directory.get(tenant_name)
    if tenant is None:
        raise _Rejected("unknown_session", f"unknown tenant {tenant_name!r}", 404)
    # What is refused whatever the session holds is refused before its store read (the
    # recall below: a lookup by key, a read slot of the tenant's): the number of
    # actions, their ids, the tenant's rate. Before, every such refusal read the session
    # first (a refreshed one too), and an agent retrying over its rate cost a read a try.
    if not hint_request.actions or len(hint_request.actions) > MAX_ACTIONS_PER_CALL:
        raise _Rejected("invalid_action", f"send 1 to {MAX_ACTIONS_PER_CALL} actions", 422)
    action_ids, id_problems = call_action_ids(hint_request.actions, tenant_name, runtime)
    if id_problems:
        if all(p["reason"].endswith(STILL_PENDING) for p in id_problems):
            raise _Rejected("conflict", "invalid action ids; nothing was sent", 409,
                            actions=id_problems)
        raise _Rejected("invalid_action", "invalid action ids; nothing was sent", 422,
                        actions=id_problems)
    now = time.time()
    count = len(hint_request.actions)
    if (over := runtime.hints.api_rate_problem(tenant_name, count, tenant.budget, now)) \
            is not None and (rejected := _over_rate(runtime, tenant_name, tenant.budget,
                                                    count, now, over)) is not None:
        raise rejected
    await runtime.lifecycle.recall(tenant_name, session_id)  # forgotten from memory
    record = runtime.sessions.get(tenant_name, session_id)
    if record is None:
        raise _Rejected("unknown_session",
                        f"unknown session {session_id!r} for tenant {tenant_name!r}", 404)
    worker_id = hint_request.worker_id or record.worker_id
    if worker_id is None:
        raise _Rejected("conflict", "the session has no worker yet (send a turn first, or "
                        "name worker_id)", 409, _NO_RETRY)
    if worker_id not in runtime.workers and worker_id != record.worker_id:
        raise _Rejected("unknown_worker", f"unknown worker {worker_id!r}", 404)
    worker = await runtime.workers.wait_heard(worker_id, _heartbeat_wait_s(runtime))
    if worker is None or worker.status is None:
        raise _no_plugin(runtime, worker_id)
    # Checked after the last wait before the send, so an end that came meanwhile counts.
    if record.state == ENDED and record.plan.ended_explicitly:
        raise _Rejected("session_ended", f"session {session_id!r} was ended (DELETE, "
                        "X-Session-End or an admin's end); its next turn opens it again", 409,
                        _NO_RETRY)
    worker_sid = record.worker_session_id
    now = time.time()
    blocks = max(record.plan.context_tokens // max(worker.status.block_size, 1), 0)
    planned: list[PlannedAction] = []
    problems: list[dict[str, str]] = []
    for index, (item, action_id) in enumerate(zip(hint_request.actions, action_ids)):
        problem, checked = checked_action(item, action_id, worker_sid, principal,
                                          tenant.budget, worker, runtime)
        if problem is not None:
            problems.append({"index": str(index), "action_id": action_id, "reason": problem})
            continue
        assert checked is not None
        action, payload = checked
        planned.append(PlannedAction(worker.worker_id, action,
                                     holding_scope(action, worker_sid), tenant_name,
                                     target_blocks(action, blocks, worker.status.block_size),
                                     now + held_for_s(payload, worker.status.budgets), "api"))
    if problems:
        raise _Rejected("invalid_action", "invalid hint actions; nothing was sent", 422,
                        actions=problems)
    over = runtime.hints.api_budget_problem(tenant_name, tenant.budget, worker.worker_id,
                                            planned, now, record.last_block_hashes,
                                            tenant.worker_share)
    if over is not None:
        # The rate filled while this call waited (the session's read, a heartbeat).
        rejected = _over_rate(runtime, tenant_name, tenant.budget, len(planned), now, over)
        if rejected is not None:
            raise rejected
        # A budget: a retry passes only once room comes back, which no wait the router
        # knows says (holds end by their TTL, or when released): not retried for nothing
        # by OpenAI's SDKs, and told what frees room.
        raise _Rejected("over_budget", f"over budget; nothing was sent: {over}. Sent again "
                        "now it is refused the same way: room comes back as held blocks' "
                        "TTLs pass, or when they are released (this tenant's own: a "
                        "kv.retain with priority 0 releases a session's agent holds, and "
                        "so does the session's end)", 429, _NO_RETRY)
    scopes = {action.scope for action in planned}
    # No await from the ended and budget checks to here: send records the actions before
    # its first await, so the checks and the record are one step. An end or another call
    # that comes while it publishes sees them (an end releases them, after them).
    sent = await runtime.hints.send(planned, dict.fromkeys(scopes, session_id), source="api",
                                    chains=dict.fromkeys(scopes, record.last_block_hashes))
    # What NATS refused never reached the worker: it costs no rate, and a refused Demote
    # leaves the planner's claims there standing (the worker never let them go).
    if refused := sum(a.status == FAILED for a in sent):
        runtime.hints.api_rate_refund(tenant_name, now, refused)
    if any(a.action_type == ActionType.DEMOTE.value and a.scope != worker_sid
           and a.status != FAILED for a in sent):
        runtime.lifecycle.agent_demoted(record, worker.worker_id)
    wait_s = runtime.settings.hints.api_outcome_timeout_s if hint_request.wait_s is None \
        else min(max(hint_request.wait_s, 0.0), 60.0)
    await runtime.hints.wait_terminal(sent, wait_s)
    body = {"tenant": tenant_name, "session_id": session_id, "worker_id": worker.worker_id,
            "actions": rows_for(principal, [a.row() for a in sent])}
    status = 200 if all(a.terminal for a in sent) else 202
    return JSONResponse(body, status_code=status, headers=refusal_headers(status))


def _over_rate(runtime: RouterRuntime, tenant_name: str, budget: TenantBudget,
               actions: int, now: float, over: str) -> _Rejected | None:
    """The refusal of a call of ``actions`` whose problem is ``over``, where that is the
    tenant's per-minute rate: when a retry fits, or never (too many in one call). None:
    the rate has room now (``over`` is a budget's: budgets have no time)."""
    wait_s = runtime.hints.api_rate_wait_s(tenant_name, actions, budget, now)
    if wait_s is None:
        # The call itself can never pass, now or later: a 422 (a 429, even with
        # x-should-retry: false, says "later"), naming the bound.
        rate = budget.max_actions_per_minute
        return _Rejected("invalid_action", f"{actions} actions in one call: more than "
                         f"tenant {tenant_name!r} may send in a minute (its "
                         f"budget.max_actions_per_minute is {rate}); nothing was sent"
                         + (", send fewer per call" if rate else ""), 422)
    if wait_s:
        return _Rejected("over_rate", f"over its rate; nothing was sent: {over} (its "
                         "budget.max_actions_per_minute): retry after Retry-After "
                         "seconds", 429, {"retry-after": str(math.ceil(wait_s))})
    return None


def _heartbeat_wait_s(runtime: RouterRuntime) -> float:
    """How long a hints call may still wait for a worker's first heartbeat: only within
    ``hints.api_heartbeat_wait_s`` of the router's start, when it has heard no plugin yet
    (a restarted router would otherwise answer 503 for up to a heartbeat interval). 0
    without NATS: no heartbeat can come."""
    if runtime.link is None:
        return 0.0
    started = runtime.started_at + runtime.settings.hints.api_heartbeat_wait_s
    return max(started - time.time(), 0.0)


def _no_plugin(runtime: RouterRuntime, worker_id: str) -> _Rejected:
    """503 for a worker with no live plugin, with when to ask again: its heartbeat interval
    where one was heard, else the plugin's default (2 s)."""
    worker = runtime.workers.get(worker_id)
    if worker is None or worker.last_heartbeat is None:
        message = (f"worker {worker_id} runs no kvhint plugin (no heartbeat since the "
                   f"router started)")
    else:
        message = f"worker {worker_id}'s kvhint plugin is silent (missed heartbeats)"
    interval = worker.status.interval_s if worker is not None and worker.status else 2.0
    interval = min(interval, MAX_HEARTBEAT_INTERVAL_S)  # as the liveness window takes it
    return _Rejected("no_plugin", message, 503,
                     {"Retry-After": str(max(math.ceil(interval), 1))})

