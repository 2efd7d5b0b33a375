"""The router's Prometheus metrics, on a registry the app owns (no global state).

Gauges that mirror in-memory state (index size, sessions, workers) are read at scrape
time by :class:`~kvhint.router.service.metrics_state.StateCollector` from a callback, so
the request path never updates them.
Every drop anywhere in the router is a ``kvhint_router_drops_total{what}`` increment.
The bounded label sets each labelled series is declared with: metric_labels.py.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvhint.router.service.metric_labels import (
    ADMIN_REJECTIONS,
    CLIENT_TIMEOUT_PHASES,
    CORS_REFUSAL_REASONS,
    CROSS_SITE_ENDPOINTS,
    CROSS_SITE_REASONS,
    HINT_API_REJECTIONS,
    NATS_ERROR_KINDS,
    RESPONSES_CANCEL_NOTICE_OUTCOMES,
    RESPONSES_READ_FAILED_REASONS,
    RESPONSES_ROUTER_END_REASONS,
    RESPONSE_ID_MISSES,
    RESPONSE_SESSION_READS,
    ROUTE_REFUSALS,
    SESSION_END_REJECTIONS,
    SESSION_END_SKIPS,
    SESSION_READS,
    SESSION_REFRESHES,
    SESSION_SAVE_CONFLICTS,
    STREAM_KINDS,
)
from kvhint.router.service.metrics_state import StateCollector, StateSample

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_DECISION_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 5e-2)
_LAG_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 30.0)

_PROBE_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0)
# The metrics with a ``worker`` label (attribute -> its label names, in order): each is
# declared with these names, and RouterMetrics.forget_worker removes a forgotten
# worker's series by them (kept here, not read back from prometheus_client's private
# ``_labelnames``; ``remove_by_labels`` is not in every version the project allows).
_PER_WORKER: dict[str, tuple[str, ...]] = {
    "requests": ("endpoint", "worker", "code"),
    "retries": ("worker",),
    "broken_streams": ("worker",),
    "prompt_tokens": ("worker",),
    "cached_predicted": ("worker",),
    "cached_actual": ("worker", "predicted"),
    "resyncs": ("worker", "reason", "result"),
    "health_probes": ("worker", "outcome"),
}


@dataclass(slots=True)
class TrafficTotals:
    """Running totals per worker, for the dashboard's timeline (sampled, differenced)."""

    requests: int = 0
    errors: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    predicted_cached_tokens: int = 0
    # Actual cached tokens of the requests the router made a prediction for (the
    # denominator of prediction accuracy).
    actual_cached_of_predicted: int = 0


def _preset(counter: Counter, values: Iterable[str]) -> Counter:
    """``counter`` (of one label) with each of ``values`` exported at 0 from the start, so
    a dashboard's rate() sees the first one counted."""
    for value in values:
        counter.labels(value)
    return counter


class RouterMetrics:
    def __init__(self) -> None:
        self.totals: dict[str, TrafficTotals] = {}
        # The totals of workers forgotten since the start (forget_worker).
        self.retired = TrafficTotals()
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("kvhint_router_requests", "Inference requests by outcome",
                                _PER_WORKER["requests"], registry=r)
        self.retries = Counter("kvhint_router_retries",
                               "Requests retried on the next-best worker",
                               _PER_WORKER["retries"], registry=r)
        self.broken_streams = Counter("kvhint_router_broken_responses",
                                      "Responses that failed after the worker's began: broken "
                                      "or silent mid-answer, or a 200 carrying vLLM's "
                                      "error event",
                                      _PER_WORKER["broken_streams"], registry=r)
        self.ttfb = Histogram("kvhint_router_time_to_first_byte_seconds",
                              "Router receive to first response byte from the worker",
                              ["endpoint"], buckets=_LATENCY_BUCKETS, registry=r)
        self.duration = Histogram("kvhint_router_request_duration_seconds",
                                  "Whole request through the router", ["endpoint"],
                                  buckets=_LATENCY_BUCKETS, registry=r)
        self.decision = Histogram("kvhint_router_routing_decision_seconds",
                                  "Routing decision (hashing excluded)",
                                  buckets=_DECISION_BUCKETS, registry=r)
        self.hashing = Histogram("kvhint_router_prompt_hashing_seconds",
                                 "Tokenizing and hashing a prompt for routing (a long "
                                 "prompt's wait for the hashing thread included)",
                                 buckets=_DECISION_BUCKETS, registry=r)
        self.prompt_tokens = Counter("kvhint_router_prompt_tokens",
                                     "Prompt tokens the workers reported",
                                     _PER_WORKER["prompt_tokens"], registry=r)
        self.cached_predicted = Counter("kvhint_router_cached_tokens_predicted",
                                        "Cached prompt tokens the router predicted",
                                        _PER_WORKER["cached_predicted"], registry=r)
        self.cached_actual = Counter("kvhint_router_cached_tokens_actual",
                                     "Cached prompt tokens the worker reported "
                                     "(usage.prompt_tokens_details.cached_tokens); "
                                     "predicted=true: requests the router predicted for",
                                     _PER_WORKER["cached_actual"], registry=r)
        self.hints = Counter("kvhint_router_hints", "Hint actions by type and outcome",
                             ["action", "outcome", "source"], registry=r)
        self.hints_sent = Counter("kvhint_router_hints_sent", "Hint actions sent",
                                  ["action", "source"], registry=r)
        self.hold_releases = Counter(
            "kvhint_router_hold_released_blocks",
            "Blocks workers let go of accepted Pins/Retains unasked, by reason (displaced: "
            "a higher-priority retain; pressure: relieved for memory; reset: a prefix-cache "
            "reset; gone: vLLM dropped them from its cache by another path; other: a "
            "reason this router does not know, from a newer plugin) and action (the type "
            "the router sent)",
            ["action", "reason"], registry=r)
        self.event_lag = Histogram("kvhint_router_event_lag_seconds",
                                   "Event batch timestamp to router ingestion",
                                   buckets=_LAG_BUCKETS, registry=r)
        self.resyncs = Counter("kvhint_router_resyncs", "Worker resyncs by reason and result",
                               _PER_WORKER["resyncs"], registry=r)
        self.health_probes = Counter(
            "kvhint_router_health_probes",
            "/health probes of workers marked down or suspected hung, by outcome (answered: "
            "200 in time; failed: an error, a timeout or another status)",
            _PER_WORKER["health_probes"], registry=r)
        self.health_probe_seconds = Histogram(
            "kvhint_router_health_probe_seconds", "Time a /health probe took (its timeout "
            "included)", buckets=_PROBE_BUCKETS, registry=r)
        self.drops = Counter("kvhint_router_drops",
                             "Anything the router dropped, by what it was", ["what"],
                             registry=r)
        self.nats_errors = _preset(Counter(
            "kvhint_router_nats_errors",
            "NATS failures that lost no message by themselves, by kind (connect: a try "
            "to connect or reconnect failed; setup: streams or subscriptions could not be "
            "set up once connected; client: another error the NATS client reported, e.g. "
            "a stale connection, a server's -ERR). Messages lost are drops: drops_total "
            "what=nats_slow_consumer, hint_unsent", ["kind"], registry=r), NATS_ERROR_KINDS)
        self.streams_remade = _preset(Counter(
            "kvhint_router_streams_remade",
            "JetStream streams of the router found deleted and made again (an operator, a "
            "NATS server restarted without its store), their consumers started over on the "
            "new stream, by what the stream holds; what was published while none held it "
            "is lost (events: a gap, resynced; outcomes and releases: lost for good)",
            ["stream"], registry=r), STREAM_KINDS)
        self.hint_api_rejections = _preset(Counter(
            "kvhint_router_hint_api_rejections",
            "POST /v1/sessions/{id}/hints calls answered with an error (nothing sent), by "
            "reason", ["reason"], registry=r), HINT_API_REJECTIONS)
        self.session_end_rejections = _preset(Counter(
            "kvhint_router_session_end_rejections",
            "DELETE /v1/sessions/{id} calls answered with an error (nothing ended), by "
            "reason", ["reason"], registry=r), SESSION_END_REJECTIONS)
        self.admin_rejections = _preset(Counter(
            "kvhint_router_admin_rejections",
            "/admin calls answered with an error (nothing read or changed), by reason",
            ["reason"], registry=r), ADMIN_REJECTIONS)
        self.route_refusals = _preset(Counter(
            "kvhint_router_route_refusals",
            "Requests outside /admin that no route serves, by reason (unknown_path: 404; "
            "method_not_allowed: 405; ambiguous_length: 400, Content-Length and "
            "Transfer-Encoding both, on any path; unauthorized: 401, /v1/models without "
            "a known client key, /metrics without its token; malformed_request: 400, a "
            "request the HTTP server could not parse; no_worker: 503, /v1/models with no "
            "routable worker; no_worker_answered: 502, /v1/models no worker listed)",
            ["reason"], registry=r),
            ROUTE_REFUSALS)
        self.session_end_skips = _preset(Counter(
            "kvhint_router_session_end_skips",
            "Turns with X-Session-End that did not end their session because the turn did "
            "not succeed (the agent retries it), by reason (client_gone: 499; refused: "
            "4xx; failed: 5xx)", ["reason"], registry=r), SESSION_END_SKIPS)
        self.cross_site_refusals = Counter(
            "kvhint_router_cross_site_refusals",
            "State-changing admin and session calls refused (403, nothing changed) as what a "
            "page on another site can make a browser send, by endpoint and reason "
            "(cross_site: Sec-Fetch-Site not same-origin; no_marker: a POST without a key, "
            "a JSON body or X-Kvhint-Request)", ["endpoint", "reason"], registry=r)
        for endpoint in CROSS_SITE_ENDPOINTS:
            for reason in CROSS_SITE_REASONS:
                self.cross_site_refusals.labels(endpoint, reason)
        self.host_refusals = Counter(
            "kvhint_router_host_refusals",
            "Requests refused (403) in dev mode for a Host that is not localhost, an IP "
            "address, a name without a dot or in allowed_hosts (DNS rebinding; "
            "origin_policy.py)", registry=r)
        self.cors_refusals = _preset(Counter(
            "kvhint_router_cors_refusals",
            "CORS preflights on the inference endpoints refused (403), by reason (origin: "
            "not in cors_allowed_origins; method; headers: a malformed header name)",
            ["reason"], registry=r), CORS_REFUSAL_REASONS)
        self.foreign_messages = Counter(
            "kvhint_router_foreign_hint_messages",
            "Hint outcomes and hold releases (kind) for actions this router did not send or "
            "no longer knows: another replica's (every replica hears every worker), or sent "
            "before this router restarted and settled since. Not drops: the action's stored "
            "row is still updated, and its own router counts it. donor_release: a donor "
            "advice's retain released (kv.donor), which no hint action's record takes; "
            "donor_outcome: a donor advice's answer (kv.donor), likewise",
            ["kind"], registry=r)
        self.trace_written = Counter(
            "kvhint_router_trace_requests_written",
            "Requests the traffic recorder wrote (trace_dir; what it could not: drops_total "
            "what=trace_*)", registry=r)
        self.store_pruned = Counter("kvhint_router_store_pruned_rows",
                                    "History rows deleted from the store past "
                                    "store_retention_s (response_sessions: responses."
                                    "session_retention_s), by table", ["table"], registry=r)
        self.client_timeouts = _preset(Counter(
            "kvhint_router_client_timeouts",
            "Client connections closed for sending a request too slowly, by phase "
            "(headers: not all in within http_header_timeout_s; body: not all in within "
            "http_body_timeout_s, answered 408)", ["phase"], registry=r), CLIENT_TIMEOUT_PHASES)
        # Tenant labels: the configured tenants and ``default`` (bounded).
        self.sessions_evicted = Counter(
            "kvhint_router_sessions_evicted",
            "Sessions evicted from memory past their tenant's max_sessions (or the "
            "router's bound), by tenant; each stays in the store", ["tenant"], registry=r)
        self.gateway_rejections = Counter(
            "kvhint_router_gateway_rejections",
            "Inference requests the router refused before any worker had them, by tenant "
            "and reason (over_in_flight: past the tenant's max_in_flight; "
            "background_over_cap: a background Responses request of a tenant with one; "
            "priority_not_allowed: a priority outside the tenant's bounds; "
            "over_in_flight too: a streamed GET of a stored response); and "
            "calls to the session and admin endpoints (ends, hints, /admin; a plain GET "
            "or a cancel of a stored response) past the tenant's api_calls rate "
            "(over_call_rate); hints calls past hints.api_max_open_calls open "
            "(over_open_hints)",
            ["tenant", "reason"], registry=r)
        self.tenant_in_flight = Gauge(
            "kvhint_router_tenant_in_flight",
            "Inference requests (and streamed GETs of stored responses) of the tenant in "
            "flight (admitted, not yet ended), as its "
            "max_in_flight counts them; kept for tenants without one too",
            ["tenant"], registry=r)
        self.response_ids = Gauge(
            "kvhint_router_response_ids",
            "Stored Responses API response ids the router remembers (id -> worker, "
            "tenant), at most responses.max_ids", registry=r)
        self.response_ids_evicted = Counter(
            "kvhint_router_response_ids_evicted",
            "Response ids forgotten past responses.max_ids (the least recently used of the "
            "tenant holding the most): a "
            "later request naming one is reached from the id alone, its session not "
            "continued", registry=r)
        self.response_ids_read = Counter(
            "kvhint_router_response_ids_read",
            "Requests naming a response id this router does not remember (another "
            "replica's, from before its restart, forgotten) whose worker and tenant were "
            "read from the id itself and checked", registry=r)
        self.response_id_misses = _preset(Counter(
            "kvhint_router_response_id_misses",
            "Requests naming a stored response id (previous_response_id, GET, cancel) "
            "the router did not send on, by reason", ["reason"], registry=r), RESPONSE_ID_MISSES)
        self.response_session_reads = _preset(Counter(
            "kvhint_router_response_session_reads",
            "Store reads of the session a response was made in, for a follow-up naming "
            "no session of a response this router did not relay, by outcome "
            "(responses.session_read_timeout_s)", ["outcome"], registry=r), RESPONSE_SESSION_READS)
        self.session_reads = _preset(Counter(
            "kvhint_router_session_reads",
            "Store reads of a session's row for a turn, end or hints call of a session id "
            "this router holds no record of (another replica's, forgotten, or new), by "
            "outcome (routing.session_read_timeout_s)", ["outcome"], registry=r), SESSION_READS)
        self.session_refreshes = _preset(Counter(
            "kvhint_router_session_refreshes",
            "Store reads of a session's row before a turn, end or hints call of a session "
            "this router holds a record of, by outcome (merged: another replica's saves "
            "since merged in)", ["outcome"], registry=r), SESSION_REFRESHES)
        self.idle_reviews_yielded = Counter(
            "kvhint_router_idle_reviews_yielded",
            "Idle reviews of a session this router left to the replica that saw its "
            "latest event (served its latest turn): the record forgotten here",
            registry=r)
        self.session_save_conflicts = _preset(Counter(
            "kvhint_router_session_save_conflicts",
            "Saves of a session whose row another replica saved since this router read "
            "or wrote it: not written over, merged with it and saved again, by outcome",
            ["outcome"], registry=r), SESSION_SAVE_CONFLICTS)
        self.response_id_requests = Counter(
            "kvhint_router_response_id_requests",
            "GET /v1/responses/{id} and POST /v1/responses/{id}/cancel, by op and code "
            "(the worker's, or the router's own refusal)", ["op", "code"], registry=r)
        self.responses_background = Counter(
            "kvhint_router_responses_background",
            "Background Responses API requests (background: true) answered while still "
            "running: their generation, usage and turn outcome come after the answer, "
            "unseen by the router", registry=r)
        self.responses_cancel_ends = Counter(
            "kvhint_router_responses_cancel_ends",
            "Streams of a cancelled background response the router ended itself (a "
            "response.failed, status cancelled): the worker sent no terminal event within "
            "responses.cancel_grace_s of the cancel it relayed", registry=r)
        self.responses_router_ends = _preset(Counter(
            "kvhint_router_responses_router_ends",
            "Responses API streams the router ended itself with response.failed, by "
            "reason: unterminated (the worker closed the stream without a terminal "
            "event), background_idle (a background response's stream sent no event "
            "within responses.background_idle_s), event_too_large (one event past "
            "stream_event_max_bytes without its end)", ["reason"], registry=r), RESPONSES_ROUTER_END_REASONS)
        self.responses_read_failed = _preset(Counter(
            "kvhint_router_responses_read_failed",
            "GET /v1/responses/{id} of a background response this router relayed queued "
            "answered failed by the router, its run known to have ended without its "
            "answer, by reason: worker_gone, worker_restarted, worker_forgot (its worker "
            "lost the response), stream_error (a stream of it relayed vLLM's error event; "
            "vLLM keeps it queued)", ["reason"], registry=r), RESPONSES_READ_FAILED_REASONS)
        self.responses_cancel_notices = _preset(Counter(
            "kvhint_router_responses_cancel_notices",
            "Cancels of background responses told between router replicas over NATS "
            "(<prefix>.v1.cancels.<worker>), by outcome: sent (this replica relayed the "
            "cancel), applied (heard from another, a stream of it open here: its grace "
            "started), no_stream (heard, none here), recovered (not heard, found "
            "cancelled at its worker once this replica's NATS link was back, a stream of "
            "it open here: its grace started), resent (not sent when relayed, the link "
            "down: sent once it was back); lost ones count as drops",
            ["outcome"], registry=r), RESPONSES_CANCEL_NOTICE_OUTCOMES)
        self.session_moves = Counter("kvhint_router_session_moves",
                                     "Turns routed to a different worker than the last",
                                     registry=r)
        self._state_collector: StateCollector | None = None

    def bind_state(self, sample: Callable[[], StateSample]) -> None:
        if self._state_collector is not None:
            self.registry.unregister(self._state_collector)
        self._state_collector = StateCollector(sample)
        self.registry.register(self._state_collector)

    def record_request(self, endpoint: str, worker: str, status: int) -> None:
        self.requests.labels(endpoint, worker, str(status)).inc()
        totals = self.totals.setdefault(worker, TrafficTotals())
        totals.requests += 1
        if status >= 400:
            totals.errors += 1

    def record_usage(self, worker: str, prompt: int, cached: int,
                     predicted: int | None) -> None:
        """The worker's usage for one request, and what the router predicted it would
        cache (None: no prediction was needed, e.g. the only worker was chosen unhashed)."""
        self.prompt_tokens.labels(worker).inc(prompt)
        self.cached_actual.labels(worker, "false" if predicted is None else "true").inc(cached)
        totals = self.totals.setdefault(worker, TrafficTotals())
        totals.prompt_tokens += prompt
        totals.cached_tokens += cached
        if predicted is not None:
            self.cached_predicted.labels(worker).inc(predicted)
            totals.predicted_cached_tokens += predicted
            totals.actual_cached_of_predicted += cached

    def forget_worker(self, worker_id: str) -> None:
        """A worker the registry forgot (heard only by heartbeats, silent for good):
        its series go, so ids of pods long gone do not pile up in every scrape (the
        gauges the collector reads go with the registry's and the index's entries). Its
        traffic totals are kept, summed apart (``retired``), so fleet totals never go
        back."""
        for name, label_names in _PER_WORKER.items():
            metric = getattr(self, name)
            position = label_names.index("worker")
            for labels in _label_sets(metric, label_names):
                if labels[position] == worker_id:
                    metric.remove(*labels)
        totals = self.totals.pop(worker_id, None)
        if totals is not None:
            retired = self.retired
            retired.requests += totals.requests
            retired.errors += totals.errors
            retired.prompt_tokens += totals.prompt_tokens
            retired.cached_tokens += totals.cached_tokens
            retired.predicted_cached_tokens += totals.predicted_cached_tokens
            retired.actual_cached_of_predicted += totals.actual_cached_of_predicted

    def record_probe(self, worker: str, answered: bool, seconds: float) -> None:
        """One /health probe of ``worker`` (health.py)."""
        self.health_probes.labels(worker, "answered" if answered else "failed").inc()
        self.health_probe_seconds.observe(seconds)

    def drop(self, what: str, count: int = 1) -> None:
        self.drops.labels(what).inc(count)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _label_sets(metric: Counter, names: tuple[str, ...]) -> set[tuple[str, ...]]:
    """The label values of every series ``metric`` (declared with label ``names``) has, in
    that order (what ``remove`` takes), read from its samples (public API only)."""
    return {tuple(sample.labels[name] for name in names)
            for family in metric.collect() for sample in family.samples}
