"""The router's bounded label sets: every value a labelled metric of
:class:`~kvhint.router.service.metrics.RouterMetrics` may take, where the code fixes them
(each series is declared up front, at 0, so a dashboard query sees it before the first
increment). REFERENCE.md's router metrics table lists exactly these
(tests/unit/test_readme_reference.py); the refusal reasons are named in the dashboard's
refusals panel too (deploy/grafana/kvhint-router.json).
"""

from __future__ import annotations

# kvhint_router_nats_errors_total{kind}: a bounded set (nats_link.NatsLink reports these).
NATS_ERROR_KINDS = ("connect", "setup", "client")
# kvhint_router_hint_api_rejections_total{reason}: a bounded set (sessions_api.py).
HINT_API_REJECTIONS = (
    "bad_request",      # 400: the body or the session id does not parse
    "too_large",        # 413: the body is over max_body_bytes
    "body_timeout",     # 408: the body did not all arrive within http_body_timeout_s
    "unauthorized",     # 401: no key, or a key the router does not know
    "forbidden",        # 403: not an admin key, or another tenant's
    "unknown_session",  # 404: no such session (or tenant)
    "unknown_worker",   # 404: worker_id names no worker
    "conflict",         # 409: an action id still pending; a session with no worker yet
    "session_ended",    # 409: the session was ended (DELETE, X-Session-End) since its turn
    "invalid_action",   # 422: an action (or the number of actions) the router refuses
    "over_rate",        # 429: over the tenant's API actions per minute
    "over_budget",      # 429: over a tenant's, a worker's or the tenant's share's budget
    "no_plugin",        # 503: the worker runs no kvhint plugin, or it is silent
    "client_gone",      # 499: the client left while sending its body
    "cross_site",       # 403: what a page on another site can send (cross_site.py)
    "over_call_rate",   # 429: past the key's tenant's tenants[].api_calls (tenant_call_rate.py)
    "over_open_hints",  # 429: its tenant's hints.api_max_open_calls open (hint_open_calls.py)
)
# kvhint_router_session_end_rejections_total{reason}: DELETE /v1/sessions/{id} calls
# answered with an error (nothing ended), a bounded set (sessions_api.py).
SESSION_END_REJECTIONS = (
    "bad_request",      # 400: the session id does not parse
    "unauthorized",     # 401: no key, or a key the router does not know
    "forbidden",        # 403: another tenant's key
    "unknown_session",  # 404: no such session of the tenant
    "cross_site",       # 403: what a page on another site can send (cross_site.py)
    "over_call_rate",   # 429: past the key's tenant's tenants[].api_calls (tenant_call_rate.py)
)
# kvhint_router_admin_rejections_total{reason}: /admin calls answered with an error
# (nothing read or changed), a bounded set (admin_api.py).
ADMIN_REJECTIONS = (
    "unauthorized",     # 401: no key, or a key the router does not know
    "forbidden",        # 403: not an admin key, or another tenant's
    "cross_site",       # 403: what a page on another site can send (cross_site.py)
    "unknown_session",  # 404: no such session, in memory or in the store
    "unknown_worker",   # 404: no such worker
    "bad_request",      # 422: a path or query parameter refused (a bound, a name)
    "unknown_path",     # 404: no admin route has that path (app.py; never the path itself)
    "method_not_allowed",  # 405: an admin route without that method (app.py)
    "over_call_rate",   # 429: past the key's tenant's tenants[].api_calls (tenant_call_rate.py)
)
# kvhint_router_route_refusals_total{reason}: requests outside /admin that no route serves
# (app.py; /admin's are admin_rejections), a bounded set: never the path itself.
ROUTE_REFUSALS = (
    "unknown_path",        # 404: no route has that path
    "method_not_allowed",  # 405: a route without that method (a GET of an inference path)
    "ambiguous_length",    # 400: Content-Length and Transfer-Encoding both (app.py)
    # 401: GET /v1/models without a client key the router knows, GET /metrics without
    # its metrics_token (app.py)
    "unauthorized",
    # 400: a request the HTTP server could not parse (its framing, request line or
    # headers), answered by uvicorn before any route, the connection closed
    # (client_deadlines.py)
    "malformed_request",
    "no_worker",           # 503: GET /v1/models with no routable worker (app.py)
    "no_worker_answered",  # 502: GET /v1/models that no worker answered with a listing
)
# kvhint_router_cross_site_refusals_total{endpoint, reason} (cross_site.py): bounded sets.
CROSS_SITE_ENDPOINTS = ("admin", "session_end", "session_hints", "responses_cancel")
CROSS_SITE_REASONS = ("cross_site", "no_marker")
# kvhint_router_cors_refusals_total{reason} (origin_policy.py): a bounded set.
CORS_REFUSAL_REASONS = ("origin", "method", "headers")
# kvhint_router_session_end_skips_total{reason}: turns with X-Session-End that did not
# end their session, the turn having failed (its agent retries it), a bounded set
# (forwarding.py), by the turn's status (a 200 stream that carried the worker's error
# event: by that error's code).
SESSION_END_SKIPS = (
    "client_gone",  # 499: the client left before the answer was whole
    "refused",      # 4xx: the worker (or the router) refused the turn
    "failed",       # 5xx: the worker failed, was unavailable or slow, or its stream broke
)
# kvhint_router_client_timeouts_total{phase} (service/client_deadlines.py, inbound.py).
CLIENT_TIMEOUT_PHASES = ("headers", "body")
# kvhint_router_gateway_rejections_total{tenant, reason}: inference requests the router
# refused itself before any worker had them, and session and admin calls past their
# tenant's rate, by reason (a bounded set; forwarding.py, tenant_call_rate.py).
GATEWAY_REJECTIONS = (
    "over_in_flight",  # 429: the tenant's max_in_flight requests are in flight already
    # 400: a background Responses request of a tenant with a max_in_flight (it would run
    # past the cap: responses_api.py)
    "background_over_cap",
    # 400: a request priority outside its tenant's tenants[].priority bounds (it would
    # move its requests ahead of other tenants' on workers scheduling by priority:
    # request_fields.py)
    "priority_not_allowed",
    # 429: a call to the session or admin endpoints (DELETE /v1/sessions/{id}, a hints
    # call, /admin, a plain GET or a cancel of a stored response) past its key's
    # tenant's tenants[].api_calls (tenant_call_rate.py)
    "over_call_rate",
    # 429: a hints call while its key's tenant has hints.api_max_open_calls open
    # (hint_open_calls.py)
    "over_open_hints",
    # 400: n or best_of over routing.max_n, or a completions batch's prompts x
    # max(n, best_of) over routing.max_sequences (sampling.py)
    "over_max_n",
    # 400: a session id (body session_id, prompt_cache_key or X-Session-ID) that is not
    # a string, is over 256 characters, or holds a control, bidi, zero-width or other
    # format character that would spoof logs and dashboards (inbound.check_session_id)
    "bad_session_id",
)
# kvhint_router_response_id_misses_total{reason}: a stored response id a request named
# that the router did not send on (responses_ids.py), a bounded set.
RESPONSE_ID_MISSES = (
    "unknown",           # 404: never seen, and not in the router's id form
    "other_tenant",      # 404 (as unknown): another tenant's response, held by this replica
    "unverified",        # 404 (as unknown): not held here, its tag not the requester's
    "worker_gone",       # 404: the worker that holds it left the fleet
    "worker_restarted",  # 404: its engine restarted since (vLLM's store is in memory)
    "worker_down",       # 503: the worker that holds it is down now
)
# kvhint_router_response_session_reads_total{outcome}: the store read of the session a
# response another replica relayed was made in (responses_sessions.py), a bounded set.
RESPONSE_SESSION_READS = (
    "found",         # continued
    "missing",       # no row: written behind (store_flush_interval_s), pruned, older
    "other_tenant",  # a row naming another tenant than the id's: not used
    "error",         # the store failed the read
    "timeout",       # no answer within responses.session_read_timeout_s
    "busy",          # not read: as many reads in flight as allowed (the store is slow)
)
# kvhint_router_session_reads_total{outcome}: the store read of a session's row on a turn
# (or an end, a hints call) of a session id this replica holds no record of
# (session_reads.py), a bounded set.
SESSION_READS = (
    "found",    # continued from the stored row (another replica's, or forgotten here)
    "missing",  # no row: a new session (or one written behind, store_flush_interval_s)
    "error",    # the store failed the read: a record of its own
    "timeout",  # no answer within routing.session_read_timeout_s: a record of its own
    "busy",     # not read: no read slot came free within that time (the store is slow)
)
# kvhint_router_session_save_conflicts_total{outcome}: a session's save that found its
# row saved by another replica since this one read or wrote it (sessions.py,
# session_merge.py), a bounded set. Either way saved again: nothing is written over.
SESSION_SAVE_CONFLICTS = (
    "merged",    # merged with the stored row (both replicas' turns), then saved
    "row_gone",  # the row was deleted meanwhile (retention): saved as this record
)
# kvhint_router_session_refreshes_total{outcome}: the store read of a session's row
# before a turn (or an end, a hints call) of a session this replica holds a record of,
# with none of its turns in flight here (session_reads.py), a bounded set. All but
# "merged" leave the record as it is (its save still merges: session_merge.py).
SESSION_REFRESHES = (
    "current",  # the row is the record's revision (or this router's flush in progress)
    "merged",   # another replica saved it since: merged into the record
    "missing",  # no row (not saved yet, store_flush_interval_s; or deleted)
    "error",    # the store failed the read
    "timeout",  # no answer within routing.session_read_timeout_s
    "busy",     # not read: no read slot free at once (it never queues the turn)
)
# kvhint_router_response_id_requests_total{op, code}: GET /v1/responses/{id} and
# POST /v1/responses/{id}/cancel (responses_api.py), a bounded set.
RESPONSE_ID_OPS = ("get", "cancel")
# kvhint_router_responses_router_ends_total{reason} (responses_cancels.py): a bounded set.
RESPONSES_ROUTER_END_REASONS = ("unterminated", "background_idle", "event_too_large")
# kvhint_router_responses_read_failed_total{reason} (responses_background.py).
RESPONSES_READ_FAILED_REASONS = ("worker_gone", "worker_restarted", "worker_forgot",
                                 "stream_error")
# kvhint_router_responses_cancel_notices_total{outcome} (responses_cancel_notices.py).
RESPONSES_CANCEL_NOTICE_OUTCOMES = ("sent", "applied", "no_stream",
                                    "recovered",  # responses_cancel_rechecks.py
                                    "resent")
# kvhint_router_health_probes_total{worker, outcome} (health.py): a bounded set.
HEALTH_PROBE_OUTCOMES = ("answered", "failed")
# kvhint_router_streams_remade_total{stream}: the router's JetStream streams, by what they
# hold (stream_watch.py, cluster_feed.py), a bounded set.
STREAM_KINDS = ("events", "outcomes", "releases")
