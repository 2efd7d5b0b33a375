"""What an operator watches (deploy/prometheus/alerts.yml, the Grafana dashboard) asks for
labels, label values and metric types the router and the engine plugin really export,
and every alert can fire and says what to do. test_service_deploy_files.py checks the
metric names; this checks the rest, with promql_lint (a small PromQL reader: no
dependency; promtool is not installable from the package registries this project uses,
and a test skipped where it is missing would check nothing here).

The catalog is built from the real registries: RouterMetrics (its scrape-time gauges
bound to a populated sample) and the plugin's KvHintPromMetrics fed one of each of its
stats through its own ``observe``, with the labels vLLM gives every connector metric.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Callable
from http import HTTPStatus
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from drop_reasons import emitted_drop_reasons
from promql_lint import Catalog, Linter, Metric, legend_labels, parse, \
    template_labels, value_set
from promql_lint import selected as _selected
from promql_lint import selectors as _selectors
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from router_families import router_families

from kvhint.router.service import metric_labels
from kvhint.router.service.hint_records import API_SOURCE, EXPIRED, FAILED, PLANNER_SOURCE
from kvhint.router.service.inbound import Endpoint
from kvhint.router.service.metrics import RouterMetrics
from kvhint.router.service.settings import RouterSettings
from kvhint.schemas.hints import ACTION_TYPE_VALUES
from kvhint.schemas.outcomes import OutcomeStatus
from kvhint.schemas.releases import ReleaseReason

REPO = Path(__file__).resolve().parents[3]
DEPLOY = REPO / "deploy"
# vLLM labels every connector metric so (vllm/v1/metrics/loggers.py builds
# KVConnectorProm with labelnames ["model_name", "engine"]); README says the same.
VLLM_LABELS = ["model_name", "engine"]
ROUTER_JOB = "kvhint-router"


# --- what the router and the plugin export ----------------------------------------------

def _router_source_calls(match: Callable[[ast.Call], bool]) -> list[ast.Call]:
    calls = []
    for path in sorted((REPO / "router").rglob("*.py")):
        calls += [node for node in ast.walk(ast.parse(path.read_text()))
                  if isinstance(node, ast.Call) and match(node)]
    return calls


def _label_literals(attribute: str, position: int) -> set[str] | None:
    """The values the router's code passes ``<x>.<attribute>.labels(...)`` at
    ``position``; None where one call site passes a computed value (an open set)."""
    def match(call: ast.Call) -> bool:
        f = call.func
        return (isinstance(f, ast.Attribute) and f.attr == "labels"
                and isinstance(f.value, ast.Attribute) and f.value.attr == attribute)
    values: set[str] = set()
    for call in _router_source_calls(match):
        arg = call.args[position]
        if not (isinstance(arg, ast.Constant) and isinstance(arg.value, str)):
            return None
        values.add(arg.value)
    return values


def _router_domains() -> dict[str, dict[str, Callable[[str], bool]]]:
    """Series name -> label -> the values it can take, where code bounds them."""
    from kvhint.router.kv_index.ingest import KvEventIngestor
    from kvhint.router.kv_index.memory import InMemoryClusterKvIndex
    from kvhint.router.service.runtime import _ingest_counters

    index = InMemoryClusterKvIndex()
    ingest = set(_ingest_counters(KvEventIngestor(index, clock=lambda: 0.0), index.stats()))
    actions = value_set(ACTION_TYPE_VALUES)
    sources = value_set({PLANNER_SOURCE, API_SOURCE})
    outcomes = value_set({s.value for s in OutcomeStatus if s.is_terminal} | {EXPIRED, FAILED})
    domains = {
        "requests_total": {"endpoint": value_set(e.value for e in Endpoint),
                           "code": value_set({str(s.value) for s in HTTPStatus} | {"499"})},
        "hints_total": {"action": actions, "outcome": outcomes, "source": sources},
        "hints_sent_total": {"action": actions, "source": sources},
        "hold_released_blocks_total": {
            "action": value_set(ACTION_TYPE_VALUES | {"other"}),
            "reason": value_set(r.value for r in ReleaseReason)},
        "resyncs_total": {"result": _label_literals("resyncs", 2)},
        "health_probes_total": {"outcome": metric_labels.HEALTH_PROBE_OUTCOMES},
        "drops_total": {"what": emitted_drop_reasons()},
        "nats_errors_total": {"kind": metric_labels.NATS_ERROR_KINDS},
        "streams_remade_total": {"stream": metric_labels.STREAM_KINDS},
        "hint_api_rejections_total": {"reason": metric_labels.HINT_API_REJECTIONS},
        "session_end_rejections_total": {"reason": metric_labels.SESSION_END_REJECTIONS},
        "session_end_skips_total": {"reason": metric_labels.SESSION_END_SKIPS},
        "cross_site_refusals_total": {"endpoint": metric_labels.CROSS_SITE_ENDPOINTS,
                                      "reason": metric_labels.CROSS_SITE_REASONS},
        "cors_refusals_total": {"reason": metric_labels.CORS_REFUSAL_REASONS},
        "client_timeouts_total": {"phase": metric_labels.CLIENT_TIMEOUT_PHASES},
        "gateway_rejections_total": {"reason": metric_labels.GATEWAY_REJECTIONS},
        "foreign_hint_messages_total": {"kind": _label_literals("foreign_messages", 0)},
        "cached_tokens_actual_total": {"predicted": {"true", "false"}},
        "index_ingest_total": {"what": ingest},
    }
    return {f"kvhint_router_{name}": {label: v if callable(v) else value_set(v)
                                      for label, v in labels.items() if v is not None}
            for name, labels in domains.items()}


def _family_metrics(family, labels: frozenset[str], values) -> dict[str, Metric]:
    """The series names a query may use for one collected family."""
    if family.type == "counter":
        return {f"{family.name}_total": Metric("counter", labels, values)}
    if family.type == "histogram":
        return {f"{family.name}_bucket": Metric("bucket", labels, values),
                f"{family.name}_sum": Metric("counter", labels, values),
                f"{family.name}_count": Metric("counter", labels, values)}
    return {family.name: Metric("gauge", labels, values)}


def router_catalog() -> dict[str, Metric]:
    metrics, families = router_families()
    domains = _router_domains()
    out: dict[str, Metric] = {}
    for family, labels in families:
        for name, metric in _family_metrics(family, labels, {}).items():
            out[name] = Metric(metric.kind, metric.labels, domains.get(name, {}))
    out["kvhint_router_worker_up"].values["kind"] = value_set(
        s.labels["kind"] for f in metrics.registry.collect()
        if f.name == "kvhint_router_worker_up" for s in f.samples)
    return out


def plugin_catalog() -> dict[str, Metric]:
    """The plugin's families, as vLLM's API server records them: one of each stat fed
    through KvHintPromMetrics.observe, so each family shows every label it carries."""
    from kvhint.engine_plugin import metrics as plugin

    registry = CollectorRegistry()

    def bind(cls: type) -> type:
        return type(cls.__name__, (cls,), {"__init__": lambda self, *a, **k:
                                           cls.__init__(self, *a, registry=registry, **k)})
    prom = plugin.KvHintPromMetrics(SimpleNamespace(kv_transfer_config=None),
                                    {Counter: bind(Counter), Gauge: bind(Gauge),
                                     Histogram: bind(Histogram)}, VLLM_LABELS, {0: ["m", "0"]})
    stats = {key: 1 for key in (*plugin.COUNTERS, *plugin.GAUGES)}
    stats |= {key: {value: 1 for value in values}
              for key, (_, values, _) in plugin.LABELLED_COUNTERS.items()}
    stats[plugin.HINTS_KEY] = {"kv.pin|accepted": 1}
    stats[plugin.LATENCY_KEY] = [0.01]
    prom.observe(stats)
    domains = {f"{plugin.PREFIX}{key}_total": {label: value_set(values)}
               for key, (label, values, _) in plugin.LABELLED_COUNTERS.items()}
    domains[f"{plugin.HINTS_METRIC}_total"] = {
        "action": value_set(ACTION_TYPE_VALUES | {plugin.OTHER_LABEL,
                                                  plugin.UNIDENTIFIED_ACTION_LABEL}),
        "status": value_set(s.value for s in OutcomeStatus)}
    out: dict[str, Metric] = {}
    for family in registry.collect():
        labels = frozenset(label for s in family.samples for label in s.labels) - {"le"}
        for name, metric in _family_metrics(family, labels, {}).items():
            out[name] = Metric(metric.kind, metric.labels, domains.get(name, {}))
    return out


def catalog() -> Catalog:
    jobs = [job["job_name"] for job in _scrape_config()["scrape_configs"]]
    metrics = router_catalog() | plugin_catalog()
    # Prometheus's own per-target series, with its job label bounded by the scrape config.
    metrics["up"] = Metric("gauge", frozenset(), {"job": value_set(jobs)})
    return Catalog(metrics, must_split={
        # requested (per snapshot page), purged, loaded, failed: not one thing.
        "kvhint_router_resyncs_total": frozenset({"result"}),
        # http and plugin liveness: 1 + 0 is no count of anything.
        "kvhint_router_worker_up": frozenset({"kind"})})


# --- the deploy files --------------------------------------------------------------------

def _scrape_config() -> dict:
    return yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())


def _rules() -> list[dict]:
    rules = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())
    return [rule for group in rules["groups"] for rule in group["rules"]]


def _targets() -> list[tuple[str, dict]]:
    dashboard = json.loads((DEPLOY / "grafana" / "kvhint-router.json").read_text())
    return [(panel["title"], target) for panel in dashboard["panels"]
            for target in panel.get("targets", [])]


def _lint(expr: str, cat: Catalog) -> tuple[list[str], frozenset[str] | None]:
    linter = Linter(cat)
    info = linter.check(expr)
    return linter.errors, info.labels


def test_every_query_uses_labels_values_and_types_the_metrics_have() -> None:
    cat = catalog()
    problems = []
    for rule in _rules():
        errors, labels = _lint(rule["expr"], cat)
        read = set().union(*(template_labels(str(v)) for v in rule.get("annotations", {})
                             .values()))
        missing = read - (labels or set()) - set(rule.get("labels", {}))
        errors += [f"annotations read $labels.{name}, which the result lacks"
                   for name in sorted(missing)]
        problems += [f"alert {rule['alert']}: {e}" for e in errors]
    for title, target in _targets():
        errors, labels = _lint(target["expr"], cat)
        missing = legend_labels(target.get("legendFormat", "")) - (labels or set())
        errors += [f"legend reads {{{{{name}}}}}, which the result lacks"
                   for name in sorted(missing)]
        problems += [f"panel {title!r} {target['refId']}: {e}" for e in errors]
    assert not problems, "\n".join(problems)


def test_every_alert_waits_is_graded_and_says_what_to_do() -> None:
    """Each rule: a ``for:`` (one scrape's blip pages no one), a severity Alertmanager
    can route, a summary, and a description that says what to look at or do."""
    problems = []
    for rule in _rules():
        name = rule["alert"]
        if not str(rule.get("for", "")).rstrip("smh").isdigit():
            problems.append(f"{name}: no for:")
        if rule.get("labels", {}).get("severity") not in ("critical", "warning", "info"):
            problems.append(f"{name}: severity is not critical, warning or info")
        annotations = rule.get("annotations", {})
        if not annotations.get("summary"):
            problems.append(f"{name}: no summary")
        description = annotations.get("description", "")
        if len(description.split()) < 8 or description == annotations.get("summary"):
            problems.append(f"{name}: no description of what to do")
    assert not problems, "\n".join(problems)
    assert len({rule["alert"] for rule in _rules()}) == len(_rules())


def _rule(name: str) -> dict:
    (rule,) = [r for r in _rules() if r["alert"] == name]
    return rule


def _threshold(expr: str) -> float:
    tree = parse(expr)
    assert tree.op in (">", ">=") and isinstance(tree.rhs, float), expr
    return tree.rhs


def test_alert_thresholds_can_be_reached_with_the_readme_defaults() -> None:
    """A store backlog over the writer's queue bound cannot happen (past it rows are
    dropped, and KvhintDrops says so); a p99 above the histogram's highest finite bucket
    cannot be computed (histogram_quantile answers that bucket's bound)."""
    assert 0 < _threshold(_rule("KvhintStoreBacklog")["expr"]) < RouterSettings().store_queue_max
    registry = RouterMetrics().registry
    top = max(float(s.labels["le"]) for f in registry.collect()
              if f.name == "kvhint_router_event_lag_seconds" for s in f.samples
              if s.name.endswith("_bucket") and s.labels["le"] != "+Inf")
    assert 0 < _threshold(_rule("KvhintEventLag")["expr"]) < top


def test_the_router_being_down_or_without_a_worker_alerts() -> None:
    """Before, a router Prometheus could not scrape silenced every router alert and
    alerted on nothing; and KvhintNoRoutableWorker summed every replica's workers (one
    replica cut off from all of them did not fire) and was empty, so silent, for a
    router that knew no worker at all. Now KvhintRouterDown watches the router's
    scrape, and KvhintNoRoutableWorker starts from each router that is up."""
    down = parse(_rule("KvhintRouterDown")["expr"])
    assert down.op == "==" and down.rhs == 0.0
    assert down.lhs.name == "up" and ("job", "=", ROUTER_JOB) in down.lhs.matchers
    assert ROUTER_JOB in [job["job_name"] for job in _scrape_config()["scrape_configs"]]
    none = parse(_rule("KvhintNoRoutableWorker")["expr"])
    assert none.op == "unless" and none.matching == "on" and none.labels == ("instance",)
    (up,) = _selectors(none.lhs)
    assert up.name == "up" and ("job", "=", ROUTER_JOB) in up.matchers
    assert _rule("KvhintNoRoutableWorker")["labels"]["severity"] == "critical"


def test_frequent_resyncs_counts_snapshots_taken_not_pages_asked() -> None:
    """resyncs_total{result="requested"} counts each snapshot page asked for (the
    ingestor asks page after page, snapshot_page_limit blocks each) and each retry: the
    rule counted one resync of a large cache as several, with no ``for:``, and fired on
    it. It counts result="loaded" (one per snapshot taken in full), per router."""
    tree = parse(_rule("KvhintFrequentResyncs")["expr"])
    (resyncs,) = _selectors(tree)
    assert ("result", "=", "loaded") in resyncs.matchers
    assert set(tree.lhs.labels) == {"instance", "worker"}


# Every drops_total{what} the router's code can count (drop_reasons), classified. Losses
# (KvhintDrops fires): something was lost (hints, outcomes, releases, store rows, usage,
# learnt statistics, inbound messages), bytes could not be read, a queue was full, an
# error was caught, a setting or a peer is wrong, or an admin key went into a URL.
_DROP_LOSSES = {
    "internal_error", "periodic_job_error", "nats_slow_consumer", "jetstream_unavailable",
    "stream_setting_not_applied", "hint_unsent", "outcome_malformed",
    "outcome_unknown_status", "outcome_amount_clamped", "releases_malformed", "release_unreadable",
    # A release of a type neither a hint's nor kv.donor (a newer plugin's): applied to
    # nothing; if it was a hint's, its blocks stay counted until their TTL.
    "release_unknown_type",
    "snapshot_wrong_worker", "learned_stats_unknown_tenant", "learned_stats_unreadable",
    "store_write", "store_row_rejected", "store_read_error", "store_read_error:permanent",
    "response_unparsable", "response_usage_missing", "dashboard_key_in_query",
    "prompt_hashing:tenant_queue_full", "prompt_hashing:internal_error",
    "prompt_hashing:HashingError", "prompt_hashing:UnsupportedHashConfig",
    "prompt_hashing:UnknownModel", "trace_block_size", "trace_write_error",
    # A held action restored without its holding (a row that does not say what it
    # protects): its worker's and tenant's budgets believe its blocks free.
    "hint_not_restored:unscoped",
    # A pending or held action whose stored payload is no JSON object: not restored, so
    # its worker's and tenant's budgets believe what it holds free.
    "hint_not_restored:unreadable",
    # A Responses follow-up whose session the store could not say (failed, slow): the
    # turn continues none.
    "response_session_unread",
    # A turn of a session id this router holds no record of, whose stored row the store
    # could not give in time (slow, busy): a record of its own overwrites the row.
    "session_unread",
    # A session's end whose read of its agent claims in the store failed or was slow:
    # claims sent through another replica stay on their workers until their TTL.
    "agent_claims_unread",
    # A stored session row with a JSON column this router cannot read: that column (its
    # planner state, open gap or gap history) is lost, the rest of the row kept.
    "session_row_unreadable",
    # A worker hashing with another algorithm or seed than the one heard first: its
    # cache is invisible to routing (a fleet configured apart).
    "cached_prediction_unchecked:hash_config_differs",
    # A heartbeat's http_url refused (form, or a host heartbeat_worker_hosts does not
    # allow): the worker it names is not routed to; a setting or a publisher is wrong.
    "worker_url_refused",
    # A cancel not told to the other replicas (no NATS now, publish failed), or a notice
    # of one not acted on (not a ResponseCancelled 1.x; an id not minted for its tenant
    # and worker under this fleet's salt_secret): the other replicas' streams of that
    # response end at responses.background_idle_s / request_timeout_s, not the grace.
    "response_cancel_notice_unsent", "response_cancel_notice_malformed",
    "response_cancel_notice_unverified", "response_cancel_notice_unsent_discarded",
    # One still kept unsent when the router stopped without a NATS link: never told.
    "response_cancel_notice_unsent_at_stop",
    # After a NATS outage, a stream's response its worker did not say the status of (a
    # cancel missed then stays missed: that stream ends at its own bounds).
    "response_cancel_recheck_failed"}
# Normal under load or by design (on the Drops panel, no alert).
_DROP_EXPECTED = {
    # Bounded memory and disk letting go, as designed.
    "session_evicted_from_memory", "trace_session_evicted", "trace_rotated_out",
    # JetStream delivers at least once: a repeat of an answered outcome.
    "outcome_duplicate",
    # A worker's address changed under a request: the old address is left alone.
    "worker_left_address:failure", "worker_left_address:timeout",
    # Prompts routed without hashes by design: over routing.max_prompt_tokens, ones whose
    # tokens cannot be reproduced (images, LoRA...), bodies vLLM answers 400 too.
    "prompt_hashing:over_max_length", "prompt_hashing:UnsupportedPrompt",
    "prompt_hashing:PromptRenderError",
    # n > 1: the cached tokens are a sibling's, not compared with the prediction.
    "cached_prediction_unchecked:parallel_sampling",
    # A completions batch: the usage's cached tokens are one prompt's, its prompt tokens
    # every prompt's; the prediction is the first prompt's.
    "cached_prediction_unchecked:batched_prompts",
    # A prediction made before the worker's heartbeat gave its block size: unchecked.
    "cached_prediction_unchecked:block_size_unheard",
    # Requests the trace does not record: failed (counted by code), not hashed exactly
    # (counted under prompt_hashing), unfinished past 30 min, in flight at shutdown.
    "trace_failed", "trace_unhashed", "trace_stalled", "trace_unfinished",
    # At an upgrade, a pooled (every tenant's) row of statistics or feedback left unused:
    # no tenant starts from the others' history.
    "learned_stats_pooled_unused", "feedback_pooled_unused",
    # At a restart, the stored actions of a worker dropped from the config or silent too
    # long: they go with its row, as the worker's holds went with it.
    "hint_not_restored:worker_gone",
    # Store retention pruned a worker not heard within store_retention_s: its actions
    # (pending, held) go from memory with its rows.
    "hint_dropped:worker_pruned",
    # The registry forgot a worker (silent for good): its actions (pending, held) go
    # with it. An engine restarted (new epoch): its holds went with the old engine, and
    # the ledger lets them go as the worker did.
    "hint_dropped:worker_forgotten", "hint_dropped:worker_restarted",
    # A Responses follow-up naming no session on a replica that did not relay its
    # response, whose session the store does not hold (yet: written behind; pruned):
    # the client is to name it to be sure.
    "response_session_unknown",
    # Past the 10,000 responses cancelled lately remembered, the oldest: a stream of it
    # opened later (a GET long after its cancel) ends at responses.background_idle_s.
    "response_cancel_forgotten"}


def test_kvhint_drops_fires_on_losses_only_and_every_drop_is_classified() -> None:
    """KvhintDrops fired on every drop, the ones normal load makes too (a session evicted
    from memory past the bound, a rotated trace file, a repeated outcome...). Its
    matchers now let through exactly the losses; and every ``what`` the code can count
    is classified here, so a new one must be before this passes. A ``what`` unknown to
    these files (a newer router's) still fires."""
    emitted = emitted_drop_reasons()
    assert not _DROP_LOSSES & _DROP_EXPECTED
    assert emitted == _DROP_LOSSES | _DROP_EXPECTED, (
        f"unclassified: {sorted(emitted - _DROP_LOSSES - _DROP_EXPECTED)}; "
        f"no longer counted: {sorted((_DROP_LOSSES | _DROP_EXPECTED) - emitted)}")
    (drops,) = [s for s in _selectors(parse(_rule("KvhintDrops")["expr"]))
                if s.name == "kvhint_router_drops_total"]
    fired = {what for what in emitted if _selected(drops, {"what": what})}
    assert fired == _DROP_LOSSES, (f"losses left out: {sorted(_DROP_LOSSES - fired)}; "
                                   f"expected ones in: {sorted(fired - _DROP_LOSSES)}")
    assert _selected(drops, {"what": "a_newer_routers_drop"})


# Every series of the engine plugin's counters (kvhint:<key>_total, and <key>:<value> for
# a labelled one), classified like the router's drops. Losses (KvhintPluginDrops fires):
# a message lost or turned away (outcomes_dropped: final outcomes only), an exception
# caught. Events not kept for replay: the kvhint:events_kept gauge (KvhintPluginEventsNotKept).
_PLUGIN_LOSSES = {
    "events_dropped", "inbound_dropped", "outcomes_dropped", "releases_dropped",
    "nats_errors:slow_consumer", "publish_errors:heartbeat", "publish_errors:snapshot_reply",
    # An outcome or release report past NATS max_payload even cut or split: lost.
    "publish_errors:oversize",
    # Another plugin build's what: unknown here, so alerted on.
    "publish_errors:other",
    "snapshot_requests_unanswered", "internal_errors"}
# On the panels, no alert.
_PLUGIN_EXPECTED = {
    # Throughput.
    "events_published", "outcomes_published", "releases_published", "index_events",
    # A hybrid model's block events of the KV-cache groups the router does not follow.
    "events_other_group",
    # Hints doing what they say: holds released, displaced, expired, given back, clipped;
    # repeats of an answered action (at-least-once delivery).
    "retained_released_under_pressure", "retained_kept_in_use_under_pressure",
    "retained_displaced", "claims_expired", "held_blocks_gone", "held_released_on_reset",
    "prefetch_clipped_blocks", "hint_duplicates",
    # A waiting Prefetch replaced by a newer action under its id (a repeat after the
    # worker forgot it): that action's outcome answers the id.
    "prefetches_replaced",
    # Bounded memories letting go, as designed (a snapshot let go is taken anew; too many
    # resyncs have their own alert).
    "in_flight_ids_forgotten", "applied_ids_forgotten", "answered_ids_forgotten",
    "index_sessions_evicted", "index_frontiers_dropped", "index_unknown_removed",
    "index_unknown_hits", "snapshots_dropped", "snapshots_evicted",
    "hint_apply_samples_dropped",
    # Retried (put back at the queue's head); deferred outcomes whose final one follows
    # (never in outcomes_dropped); the connection's errors (nats_connected and
    # KvhintPluginSilent show a plugin cut off).
    "publish_errors:queued", "deferred_dropped", "nats_errors:other",
    # Failed looks for the events stream, one per look (every 60 s): what they left is
    # the kvhint:events_kept gauge, which KvhintPluginEventsNotKept reads (before, an
    # hour's increase of these held the alert for an hour after one failed look).
    "stream_create_failures", "jetstream_unavailable"}


def test_the_plugin_alerts_fire_on_its_losses_only_and_every_counter_is_classified() -> None:
    """KvhintPluginDrops watched events_dropped, inbound_dropped and internal_errors: the
    plugin losing outcomes, release reports, heartbeats, snapshot pages, snapshot
    requests, slow-consumer messages, or its events not kept for replay, alerted no one.
    Every series of the plugin's counters is classified here (a new one must be before
    this passes), and the plugin's alerts select exactly the losses."""
    from kvhint.engine_plugin import metrics as plugin

    series = set(plugin.COUNTERS) | {f"{key}:{value}" for key, (_, values, _) in
                                     plugin.LABELLED_COUNTERS.items() for value in values}
    assert not _PLUGIN_LOSSES & _PLUGIN_EXPECTED
    assert series == _PLUGIN_LOSSES | _PLUGIN_EXPECTED, (
        f"unclassified: {sorted(series - _PLUGIN_LOSSES - _PLUGIN_EXPECTED)}; "
        f"no longer exported: {sorted((_PLUGIN_LOSSES | _PLUGIN_EXPECTED) - series)}")
    selectors = [s for name in ("KvhintPluginDrops", "KvhintPluginEventsNotKept")
                 for s in _selectors(parse(_rule(name)["expr"]))]

    def fires(one: str) -> bool:
        key, _, value = one.partition(":")
        labels = {plugin.LABELLED_COUNTERS[key][0]: value} if value else {}
        return any(s.name == f"{plugin.PREFIX}{key}_total" and _selected(s, labels)
                   for s in selectors)
    fired = {one for one in series if fires(one)}
    assert fired == _PLUGIN_LOSSES, (f"losses left out: {sorted(_PLUGIN_LOSSES - fired)}; "
                                     f"expected ones in: {sorted(fired - _PLUGIN_LOSSES)}")


def test_the_workers_up_stat_counts_each_worker_once_across_router_replicas() -> None:
    """Every router replica reports every worker: the stat summed
    kvhint_router_worker_up over replicas, so the Kubernetes deployment's two routers
    showed two workers up as four. It takes each worker once (up at any router)."""
    dashboard = json.loads((DEPLOY / "grafana" / "kvhint-router.json").read_text())
    (panel,) = [p for p in dashboard["panels"] if p["title"] == "Workers up"]
    (target,) = panel["targets"]
    expr = re.sub(r"\s+", "", target["expr"])
    assert expr.startswith('count(maxby(worker)(kvhint_router_worker_up{kind="http"})==1)'), expr


def test_prometheus_loads_the_rules_compose_mounts() -> None:
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    mounts = dict(volume.rsplit(":", 2)[:2][::-1] for volume in
                  compose["services"]["prometheus"]["volumes"])
    for path in _scrape_config()["rule_files"]:
        assert mounts.get(path) == "./prometheus/alerts.yml", path


# --- the checker catches what it claims to (on queries written wrong on purpose) ---------

@pytest.mark.parametrize(("expr", "says"), [
    ('kvhint_router_worker_up{kind="plugin"} == 0 and kvhint_router_worker_up{kind="http"} == 1',
     "never matches: kind"),
    ("sum by (worker) (rate(kvhint_router_drops_total[5m]))", "no label 'worker'"),
    ('rate(kvhint_router_nats_errors_total{kind="conect"}[5m])', "never takes 'conect'"),
    ('rate(kvhint_router_nats_errors_total{kind=~"connect|slow"}[5m])', "'slow' matches no"),
    ('rate(kvhint_router_drops_total{what="no_such_drop_anywhere"}[5m])', "never takes"),
    # Exact: an f-string drop's values are resolved (drop_reasons), not any suffix.
    ('rate(kvhint_router_drops_total{what!="prompt_hashing:Unsupported"}[5m])',
     "never takes"),
    ("rate(kvhint_router_store_queue[5m])", "is a gauge"),
    ("kvhint_router_drops_total > 5", "raw value"),
    ("histogram_quantile(0.9, sum(rate(kvhint_router_event_lag_seconds_bucket[5m])))",
     "le kept"),
    ("sum by (worker) (increase(kvhint_router_resyncs_total[5m]))", "adds up ['result']"),
    ('sum(kvhint_router_worker_up)', "adds up ['kind']"),
    ("sum by (instance) (rate(kvhint:publish_errors_total{what=\"heartbeats\"}[5m]))",
     "never takes"),
    ("sum by (pod) (kvhint:pinned_blocks)", "no label 'pod'"),
    ("sum by (worker) (rate(kvhint_router_retries_total[5m])) / "
     "sum(rate(kvhint_router_retries_total[5m]))", "label sets differ"),
])
def test_the_checker_refuses_a_wrong_query(expr: str, says: str) -> None:
    errors, _ = _lint(expr, catalog())
    assert any(says in e for e in errors), errors


def test_the_checker_takes_right_queries() -> None:
    for expr in (
            'kvhint_router_worker_up{kind="plugin"} == 0 '
            'and ignoring (kind) kvhint_router_worker_up{kind="http"} == 1',
            'sum by (worker, result) (increase(kvhint_router_resyncs_total[5m]))',
            'rate(kvhint_router_drops_total{what=~"prompt_hashing:.*|hint_unsent"}[5m])',
            'sum by (instance, model_name, engine, action, status) '
            '(rate(kvhint:hints_total{status="rejected"}[5m]))'):
        assert _lint(expr, catalog())[0] == [], expr
