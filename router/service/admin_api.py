"""Admin API (``/admin/...``): sessions, workers, hints. Needs an admin key (a tenant
admin sees its own tenant only); open in dev mode. A call that changes state refuses what
a page on another site can make a browser send (:mod:`.cross_site`).

Reads come from memory (sessions, workers, the index) and from the store (hint history,
sessions no longer in memory); the writer is flushed first so a read sees every write
made before it. A tenant admin reads hint reasons without the worker-wide budget figures
(:mod:`.tenant_reasons`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import heapq
import time
from collections.abc import Callable, Coroutine, Iterable
from typing import Annotated, Any, Literal

import msgspec
from fastapi import APIRouter, Depends, HTTPException, Path, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from pydantic import AfterValidator
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvhint.router.policy import ANY_TOOL, USER_GAP, LearnedStats, agent_scope
from kvhint.router.policy.tenant_feedback import TENANTS_KEY, SplitFeedback
from kvhint.router.safe_text import unsafe_refusal
from kvhint.router.service.cross_site import cross_site_refusal
from kvhint.router.service.hint_records import HintStatus
from kvhint.router.service.runtime import RouterRuntime
from kvhint.router.service.sessions import SessionRecord, SessionState
from kvhint.router.service.tenancy import AuthError, Principal, api_key_of
from kvhint.router.service.tenant_call_rate import CALL_RATE_REJECTION
from kvhint.router.service.tenant_reasons import rows_for, tenant_reason
from kvhint.router.store.reader import (
    count_hints_by_status,
    get_session,
    query_hints,
    query_sessions,
)


# Tools listed per tenant in the overview's learnt figures (its most observed ones).
_LEARNED_TOOLS_SHOWN = 20

# Names in paths and queries (tenants, session ids, workers): bounded, and none holding
# what the gateway refuses in a session id (safe_text.py's one rule: C0 and C1 controls,
# DEL, bidi and other format characters, line separators; PostgreSQL refuses a NUL,
# which was a 500). Before, only C0 and DEL were refused here. A bad one is a 422
# naming the parameter and the character, escaped.
_NAME_MAX_LENGTH = 512


def _safe_name(value: str | None) -> str | None:
    if value is not None and (bad := unsafe_refusal(value)) is not None:
        raise ValueError(f"holds a control, bidi or other format character ({bad})")
    return value


_QueryName = Annotated[str | None, Query(max_length=_NAME_MAX_LENGTH),
                       AfterValidator(_safe_name)]
_PathName = Annotated[str, Path(max_length=_NAME_MAX_LENGTH), AfterValidator(_safe_name)]


class Refusal(HTTPException):
    """An admin call refused, with the reason ``admin_rejections_total`` counts it by
    (metric_labels.ADMIN_REJECTIONS)."""

    def __init__(self, reason: str, status: int, message: str,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(status, message, headers)
        self.reason = reason


class _CountedRoute(APIRoute):
    """An admin route whose every refusal is counted: the handler's own
    (:class:`Refusal`), its dependencies' (the key, the cross-site check) and FastAPI's
    422 for a path or query parameter it refuses, all raised inside the route's
    handler; the app's exception handlers then answer them as before."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def counted(request: Request) -> Response:
            try:
                return await handler(request)
            except RequestValidationError:
                _count_refusal(request, "bad_request")
                raise
            except StarletteHTTPException as exc:
                _count_refusal(request, exc.reason if isinstance(exc, Refusal)
                               else _REASON_OF_STATUS.get(exc.status_code, "bad_request"))
                raise

        return counted


# A refusal raised without a reason of its own (none in this module; a guard).
_REASON_OF_STATUS = {401: "unauthorized", 403: "forbidden"}


def _count_refusal(request: Request, reason: str) -> None:
    request.app.state.runtime.metrics.admin_rejections.labels(reason).inc()


def admin_principal(request: Request) -> Principal:
    runtime: RouterRuntime = request.app.state.runtime
    key = api_key_of(request.headers)
    try:
        return runtime.directory.admin(key)
    except AuthError as exc:
        raise Refusal("unauthorized" if exc.status == 401 else "forbidden", exc.status,
                      exc.message) from exc


def _refuse_cross_site(request: Request,
                       _principal: Principal = Depends(admin_principal)) -> None:
    """Every admin call but a GET or HEAD (the state-changing ones, those to come too):
    403 for what a page on another site can make a browser send (:mod:`.cross_site`),
    checked after the key, so a call without one is still a 401."""
    message = cross_site_refusal(request.method, request.headers,
                                 request.app.state.runtime.metrics, "admin")
    if message is not None:
        raise Refusal("cross_site", 403, message)


def _charge_call(request: Request, principal: Principal = Depends(admin_principal)) -> None:
    """Every admin call, after the key and the cross-site check: one of its key's
    tenant's ``api_calls`` (a global admin's: ``default``'s), else a 429 with
    ``Retry-After`` (:mod:`.tenant_call_rate`). A tenant admin's key may read the store
    (a view of its sessions or hints) and end sessions: no more often than that."""
    over = request.app.state.runtime.call_rate.take(principal.tenant)
    if over is not None:
        raise Refusal(CALL_RATE_REJECTION, over.STATUS, over.message, over.headers)


def _scope(principal: Principal, tenant: str | None) -> str | None:
    """The tenant a query is limited to (None: all, for a global admin)."""
    if principal.tenant is None:
        return tenant
    if tenant is not None and tenant != principal.tenant.name:
        raise Refusal("forbidden", 403,
                      f"this key administers tenant {principal.tenant.name!r} only")
    return principal.tenant.name


def session_view(runtime: RouterRuntime, record: SessionRecord, detail: bool) -> dict[str, Any]:
    plan = record.plan
    view: dict[str, Any] = {
        "tenant": record.tenant, "session_id": record.session_id,
        "worker_session_id": record.worker_session_id, "worker_id": record.worker_id,
        "state": record.state, "turns": record.turns, "inflight": record.inflight,
        "created_at": record.created_at, "last_activity": record.last_activity,
        "ended_at": record.ended_at, "open_gap": record.open_gap,
        "prompt_tokens": record.prompt_tokens, "cached_tokens": record.cached_tokens,
        "cached_share": (record.cached_tokens / record.prompt_tokens
                         if record.prompt_tokens else None),
        "predicted_cached_tokens": record.predicted_cached_tokens,
        "planner": {
            "gap_kind": plan.gap_kind, "gap_predicted_s": plan.gap_predicted_s,
            "protection": (msgspec.to_builtins(plan.protection)
                           if plan.protection is not None else None),
            "demoted": plan.demoted, "agent_demoted": plan.agent_demoted,
            "context_tokens": plan.context_tokens,
            # As the store view's plan has it: an ended session its client (or an admin)
            # ended, not one the planner abandoned when idle (both are state "ended").
            "ended_explicitly": plan.ended_explicitly,
        },
        # Workers holding what an agent runtime asked for through the API (apart from the
        # planner's protection above).
        "agent_held_on": [w.worker_id for w in runtime.workers.all()
                          if runtime.hints.holdings.holds(
                              w.worker_id, agent_scope(record.worker_session_id))],
    }
    if detail:
        view["gaps"] = record.gaps[-32:]
        view["resident_blocks"] = resident_blocks(runtime, record)
        view["index_placements"] = [
            {"worker_id": p.worker_id, "frontiers": list(p.frontiers),
             "frontiers_resident": sum(1 for f in p.frontiers
                                       if runtime.index.has_block(p.worker_id, f))}
            for p in runtime.index.session_placements(record.worker_session_id)]
    return view


def resident_blocks(runtime: RouterRuntime, record: SessionRecord) -> dict[str, Any]:
    """Of the blocks of the session's last prompt: how many each worker holds, per tier
    (from the cluster index, i.e. what the workers' events said)."""
    per_worker: dict[str, dict[str, int]] = {}
    for block_hash in record.last_block_hashes:
        for worker_id, tiers in runtime.index.locate(block_hash).items():
            counts = per_worker.setdefault(worker_id, {})
            for tier in tiers:
                counts[tier] = counts.get(tier, 0) + 1
    return {"prompt_blocks": len(record.last_block_hashes), "by_worker": per_worker}


def worker_view(runtime: RouterRuntime, worker_id: str,
                principal: Principal | None = None) -> dict[str, Any]:
    """A worker's state. A worker serves every tenant, so a tenant admin (``principal`` of
    one tenant) sees only what carries no other tenant's traffic (None for the rest):

    - shown: its id, address and whether it came from the config (fleet configuration);
      ``http_up``, ``plugin_alive``, ``epoch`` and the event stream's phase and epoch
      (liveness); its heartbeat ``status`` less what traffic makes of it (model, block
      size, hash algorithm, supported actions and budgets: capabilities and capacity).
    - null: ``requests``, ``inflight``, the heartbeat's ``usage`` and ``last_event_seq``,
      ``index_blocks``, the stream's ``applied_seq`` and ``counters``, ``held_by_hints``
      (every tenant's requests, cached blocks and holds, counted); ``http_failures`` and
      ``last_http_error`` (the failures of other tenants' requests, and their error
      text). None of these is kept per tenant. The heartbeat's ``none_hash_seed`` and
      ``cache_namespace`` (the hash chain's seed, in clear in the namespace too:
      trust-boundary configuration, no tenant's business).
    - ``feedback`` (what hint outcomes taught the planner) in part: the worker's
      capability part and the tenant's own part, never another tenant's
      (:meth:`SplitFeedback.to_dict_of`), its reasons without the worker-wide budget
      figures (:mod:`.tenant_reasons`)."""
    worker = runtime.workers.get(worker_id)
    if worker is None:
        raise Refusal("unknown_worker", 404, f"unknown worker {worker_id!r}")
    stream = runtime.ingestor.worker_views().get(worker_id)
    feedback = runtime.hints.feedback.get(worker_id)
    held = runtime.hints.holdings.worker(worker_id)
    fleet = principal is None or principal.tenant is None
    return {
        "worker_id": worker.worker_id, "url": worker.url, "from_config": worker.from_config,
        "http_up": worker.http_up,
        "http_failures": worker.http_failures if fleet else None,
        "last_http_error": worker.last_http_error if fleet else None,
        "plugin_alive": worker.plugin_alive,
        "epoch": worker.epoch, "inflight": worker.inflight if fleet else None,
        "requests": worker.requests if fleet else None,
        "status": _status_view(worker, fleet),
        "index_blocks": dict(runtime.index.worker_block_counts(worker_id)) if fleet else None,
        "stream": ({"phase": stream.phase, "epoch": stream.epoch,
                    "applied_seq": stream.applied_seq if fleet else None,
                    "counters": dict(stream.counters) if fleet else None}
                   if stream is not None else None),
        # Two engines heartbeat under this id (kv_index/stream_sources.py): the one not
        # followed. None: no conflict reported. Shown to a tenant admin too: an address and
        # an epoch, fleet configuration, no tenant's traffic.
        "conflict": (dataclasses.asdict(stream.conflict)
                     if stream is not None and stream.conflict is not None else None),
        "held_by_hints": ({"pinned_blocks": held.pinned_blocks,
                           "retained_blocks": held.retained_blocks} if fleet else None),
        "feedback": _feedback_view(feedback, principal),
    }


def learned_view(stats: LearnedStats, quantile: float) -> dict[str, Any]:
    """What one tenant's planning predicts from (:class:`LearnedStats`), in figures: the
    gap not exceeded with probability ``quantile`` (``PlannerConfig.gap_quantile``, what
    a session's ``gap_predicted_s`` is) for a user turn, any tool and its most observed
    tools at depth 1, the chance a first turn is followed by another, and of a next turn
    reading the previous response's KV. A tenant with nothing learnt shows the priors."""
    tools = sorted(((hist.total, key[:-2]) for key, hist in stats.gaps.items()
                    if key.endswith("|*") and not key.startswith("@")), reverse=True)
    return {
        "user_gap_predicted_s": stats.gap_quantile(USER_GAP, 1, quantile),
        "tool_gap_predicted_s": stats.gap_quantile(ANY_TOOL, 1, quantile),
        "tools_gap_predicted_s": {name: stats.gap_quantile(name, 1, quantile)
                                  for _total, name in tools[:_LEARNED_TOOLS_SHOWN]},
        "tools_learnt": len(tools),
        "return_probability_first_turn": stats.return_probability(1),
        "completion_read_probability": stats.completion_read_probability(),
    }


def _feedback_view(feedback: SplitFeedback | None,
                   principal: Principal | None) -> dict[str, Any] | None:
    """A worker's outcome feedback as ``principal`` may read it (see :func:`worker_view`)."""
    if feedback is None:
        return None
    if principal is None or principal.tenant is None:
        return feedback.to_dict()
    view = feedback.to_dict_of(principal.tenant.name)
    for part in (view, *view[TENANTS_KEY].values()):
        part["disabled_reasons"] = {kind: tenant_reason(reason)
                                    for kind, reason in part["disabled_reasons"].items()}
    return view


def _status_view(worker: Any, fleet: bool) -> dict[str, Any] | None:
    if worker.status is None:
        return None
    status = msgspec.to_builtins(worker.status)
    if not fleet:  # every tenant's traffic: its KV use and holds, its events' count
        status["usage"] = None
        status["last_event_seq"] = None
        # The seed of the worker's block-hash chain, and its cache_namespace, which
        # holds it in clear: the worker's PYTHONHASHSEED where set (also the key of its
        # Python processes' str hashing), which with xxhash is what keeps block hashes
        # unpredictable (docs/router.md). Trust-boundary configuration, on NATS for the
        # router, that no tenant needs: before, every tenant admin read it here. Null as
        # the fleet-only fields are (not "secret", which a null seed means on the wire).
        status["none_hash_seed"] = None
        status["cache_namespace"] = None
    return status


def _private_answer(response: Response) -> None:
    """Admin answers show tenants' sessions and hints: never kept by a cache, never
    content-sniffed (the dashboard's origin)."""
    response.headers["Cache-Control"] = "no-store"
    response.headers["X-Content-Type-Options"] = "nosniff"


def build_admin_router() -> APIRouter:
    router = APIRouter(prefix="/admin", tags=["admin"], route_class=_CountedRoute,
                       dependencies=[Depends(_private_answer), Depends(_refuse_cross_site),
                                     Depends(_charge_call)])

    @router.get("/sessions")
    async def list_sessions(request: Request, tenant: _QueryName = None,
                            state: SessionState | None = None,
                            source: Literal["memory", "store"] = "memory",
                            limit: int = Query(100, ge=1, le=10_000),
                            principal: Principal = Depends(admin_principal)) -> dict[str, Any]:
        runtime: RouterRuntime = request.app.state.runtime
        scope = _scope(principal, tenant)
        if source == "store":
            await runtime.writer.flush()
            rows = await asyncio.to_thread(query_sessions, runtime.engine, scope, state, limit)
            return {"sessions": rows, "source": "store"}
        records = [r for r in runtime.sessions.of_tenant(scope)
                   if state is None or r.state == state]
        return {"sessions": [session_view(runtime, r, detail=False)
                             for r in _most_recent(records, limit)],
                "total": len(records), "source": "memory"}

    @router.get("/sessions/{tenant}/{session_id:path}")
    async def get_one_session(request: Request, tenant: _PathName,
                              session_id: _PathName,
                              principal: Principal = Depends(admin_principal)
                              ) -> dict[str, Any]:
        runtime: RouterRuntime = request.app.state.runtime
        _scope(principal, tenant)
        await runtime.writer.flush()
        hints = rows_for(principal, await asyncio.to_thread(
            query_hints, runtime.engine, None, tenant, session_id, None, 200))
        record = runtime.sessions.get(tenant, session_id)
        if record is not None:
            return {**session_view(runtime, record, detail=True), "hints": hints}
        row = await asyncio.to_thread(get_session, runtime.engine, tenant, session_id)
        if row is None:
            raise Refusal("unknown_session", 404, f"unknown session {tenant}/{session_id}")
        return {**row, "source": "store", "hints": hints}

    @router.post("/sessions/{tenant}/{session_id:path}/end")
    async def end_session(request: Request, tenant: _PathName,
                          session_id: _PathName,
                          principal: Principal = Depends(admin_principal)) -> dict[str, Any]:
        runtime: RouterRuntime = request.app.state.runtime
        _scope(principal, tenant)
        await runtime.lifecycle.recall(tenant, session_id)  # forgotten from memory
        record = runtime.sessions.get(tenant, session_id)
        if record is None:
            raise Refusal("unknown_session", 404, f"unknown session {tenant}/{session_id}")
        await runtime.lifecycle.end(record)
        return session_view(runtime, record, detail=False)

    @router.get("/workers")
    async def list_workers(request: Request, principal: Principal = Depends(admin_principal)
                           ) -> dict[str, Any]:
        runtime: RouterRuntime = request.app.state.runtime
        return {"workers": [worker_view(runtime, w.worker_id, principal)
                            for w in runtime.workers.all()]}

    @router.get("/workers/{worker_id}")
    async def get_worker(request: Request, worker_id: _PathName,
                         principal: Principal = Depends(admin_principal)) -> dict[str, Any]:
        return worker_view(request.app.state.runtime, worker_id, principal)

    @router.get("/hints")
    async def list_hints(request: Request, status: HintStatus | None = None,
                         tenant: _QueryName = None,
                         session_id: _QueryName = None,
                         worker_id: _QueryName = None,
                         limit: int = Query(100, ge=1, le=10_000),
                         principal: Principal = Depends(admin_principal)) -> dict[str, Any]:
        runtime: RouterRuntime = request.app.state.runtime
        scope = _scope(principal, tenant)
        await runtime.writer.flush()
        rows = await asyncio.to_thread(query_hints, runtime.engine, status, scope, session_id,
                                       worker_id, limit)
        counts = await asyncio.to_thread(count_hints_by_status, runtime.engine, scope)
        return {"hints": rows_for(principal, rows), "counts_by_status": counts}

    @router.get("/overview")
    async def overview(request: Request, principal: Principal = Depends(admin_principal)
                       ) -> dict[str, Any]:
        runtime: RouterRuntime = request.app.state.runtime
        return overview_of(runtime, principal)

    return router


def overview_of(runtime: RouterRuntime, principal: Principal) -> dict[str, Any]:
    """Everything the dashboard draws, in one call. A tenant admin's holds its tenant's
    sessions and hints only; the fleet's traffic totals and timeline, which are not kept
    per tenant, are left out (``totals`` None, ``timeline`` empty), and its hints'
    reasons carry no worker-wide budget figures (:mod:`.tenant_reasons`).

    ``learned``: what the planner learnt (:func:`learned_view`), per tenant, each
    tenant's from its own traffic only: a tenant admin's holds its own tenant; a global
    admin's every tenant the router serves, each apart (there is no fleet-wide figure
    to show: no tenant plans from one)."""
    scope = principal.tenant.name if principal.tenant is not None else None
    quantile = runtime.hints.planner_config.gap_quantile
    # The tenant's own sessions only, not every tenant's walked and filtered (a tenant
    # admin's dashboard polls this every 2 s: its cost grew with the other tenants').
    sessions = _most_recent(runtime.sessions.of_tenant(scope), 100)
    # The tenant's own last 50, not its share of the fleet's last 50.
    recent_hints = [a for a in reversed(runtime.hints.recent)
                    if scope is None or a.tenant == scope][:50]
    pending = sorted((a for a in runtime.hints.pending.values()
                      if scope is None or a.tenant == scope),
                     key=lambda a: a.created_at, reverse=True)
    hints = rows_for(principal, [a.row() for a in (pending[:50] + recent_hints)][:100])
    stats = runtime.index.stats()
    return {
        "now": time.time(), "started_at": runtime.started_at,
        "dev_mode": runtime.directory.dev_mode,
        "nats_connected": runtime.link.connected if runtime.link is not None else False,
        "totals": _fleet_totals(runtime) if scope is None else None,
        "timeline": runtime.timeline.as_list() if scope is None else [],
        "workers": [worker_view(runtime, w.worker_id, principal) for w in runtime.workers.all()],
        "sessions": [session_view(runtime, r, detail=False) for r in sessions],
        "sessions_by_state": runtime.sessions.counts_by_state(scope),
        "hints": hints,
        "hint_status_counts": runtime.hints.status_counts_of(scope),
        "hints_pending": len(pending),
        "index": ({"distinct_blocks": stats.distinct_blocks, "entries": stats.entries,
                   "sessions": stats.sessions, "workers": stats.workers}
                  if scope is None else None),
        "learned": {tenant: learned_view(runtime.hints.stats_of(tenant), quantile)
                    for tenant in ((scope,) if scope is not None else runtime.hints.tenants)},
    }


def _most_recent(records: Iterable[SessionRecord], limit: int) -> list[SessionRecord]:
    """The ``limit`` most recently active, newest first, without sorting them all (200k
    sessions sorted took ~0.1-0.2 s of the event loop at every dashboard poll)."""
    return heapq.nlargest(limit, records, key=lambda r: r.last_activity)


def _fleet_totals(runtime: RouterRuntime) -> dict[str, Any]:
    # Forgotten workers' totals too (``retired``): the fleet's never go back.
    totals = [*runtime.metrics.totals.values(), runtime.metrics.retired]
    prompt = sum(t.prompt_tokens for t in totals)
    cached = sum(t.cached_tokens for t in totals)
    return {"requests": sum(t.requests for t in totals),
            "errors": sum(t.errors for t in totals),
            "prompt_tokens": prompt, "cached_tokens": cached,
            "predicted_cached_tokens": sum(t.predicted_cached_tokens for t in totals),
            "actual_cached_of_predicted": sum(t.actual_cached_of_predicted for t in totals),
            "cached_share": cached / prompt if prompt else None}
