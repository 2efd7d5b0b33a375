"""Every metric the dashboard and the alerts query is one the router or the engine plugin
exports (a renamed metric must not silently blank a panel or an alert), and what an
operator looks for has its panel: worker-id conflicts, every refusal counter, every
index ingestion loss."""

from __future__ import annotations

import json
import re

import yaml

from deploy_manifests import DEPLOY
from kvhint.engine_plugin.metrics import exposed_names as plugin_names
from kvhint.router.service.metric_labels import ADMIN_REJECTIONS, CLIENT_TIMEOUT_PHASES, \
    CORS_REFUSAL_REASONS, \
    CROSS_SITE_REASONS, GATEWAY_REJECTIONS, HINT_API_REJECTIONS, SESSION_END_REJECTIONS, \
    SESSION_END_SKIPS
from kvhint.router.service.metrics import RouterMetrics
from kvhint.router.service.metrics_state import StateSample

_METRIC = re.compile(r"\bkvhint_router_[a-z_]+")
# The plugin's metrics appear on vLLM's /metrics under vLLM-style names (kvhint:...).
_PLUGIN_METRIC = re.compile(r"\bkvhint:[a-z_]+")


def exported_names() -> set[str]:
    metrics = RouterMetrics()
    metrics.bind_state(lambda: StateSample())
    names = set()
    for family in metrics.registry.collect():
        names.add(family.name)
        for sample in family.samples:
            names.add(sample.name)
    # Families with labels export no sample until first used: add the suffixed forms.
    for family in metrics.registry.collect():
        if family.type == "counter":
            names.add(family.name + "_total")
        if family.type == "histogram":
            names.update(family.name + s for s in ("_bucket", "_sum", "_count"))
    return names


def queried(text: str) -> set[str]:
    return set(_METRIC.findall(text))


def test_alert_rules_and_dashboard_query_real_metrics() -> None:
    names = exported_names()
    rules = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())
    exprs = [rule["expr"] for group in rules["groups"] for rule in group["rules"]]
    assert len(exprs) >= 8
    dashboard = json.loads((DEPLOY / "grafana" / "kvhint-router.json").read_text())
    exprs += [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    used = set().union(*(queried(e) for e in exprs))
    assert used, "no kvhint metric queried"
    assert used <= names, f"unknown metrics: {sorted(used - names)}"
    plugin_used = set().union(*(set(_PLUGIN_METRIC.findall(e)) for e in exprs))
    assert "kvhint:retained_kept_in_use_under_pressure_total" in plugin_used
    assert plugin_used <= plugin_names(), f"unknown metrics: {sorted(plugin_used - plugin_names())}"


def test_the_dashboard_shows_worker_id_conflicts_by_worker() -> None:
    """kvhint_router_worker_id_conflict{worker} (two engines publishing under one worker
    id) was in an alert only, on no panel: the dashboard graphs it per worker, and says
    what to do."""
    dashboard = json.loads((DEPLOY / "grafana" / "kvhint-router.json").read_text())
    shown = [(panel, target) for panel in dashboard["panels"] for target in panel["targets"]
             if "kvhint_router_worker_id_conflict" in queried(target["expr"])]
    assert shown, "no panel shows kvhint_router_worker_id_conflict"
    assert any(target.get("legendFormat") == "{{worker}}" for _, target in shown)
    assert all("worker_id" in panel["description"] for panel, _ in shown)


def test_every_refusal_counter_is_on_the_refusals_panel() -> None:
    """Every counter of calls the router refuses itself (``*_refusals_total``,
    ``*_rejections_total``, ``*_skips_total``) is graphed on the one refusals panel, where
    an operator looks for a client's 403s or 429s. Before, the
    cross-site, Host, CORS, skipped-end and in-flight counters were on no panel, nor
    kvhint_router_client_timeouts_total (requests sent too slowly), now there by phase."""
    refusals = {name for name in exported_names()
                if re.fullmatch(r"kvhint_router_\w+_(refusals|rejections|skips)_total", name)}
    assert {"kvhint_router_host_refusals_total",
            "kvhint_router_session_end_skips_total"} <= refusals
    dashboard = json.loads((DEPLOY / "grafana" / "kvhint-router.json").read_text())
    (panel,) = [p for p in dashboard["panels"] if any(
        "kvhint_router_hint_api_rejections_total" in queried(t["expr"]) for t in p["targets"])]
    shown = set().union(*(queried(t["expr"]) for t in panel["targets"]))
    assert refusals <= shown, f"not on the refusals panel: {sorted(refusals - shown)}"
    (timeouts,) = [t for t in panel["targets"]
                   if "kvhint_router_client_timeouts_total" in queried(t["expr"])]
    assert "by (phase)" in timeouts["expr"] and "{{phase}}" in timeouts["legendFormat"]
    # Its description names every reason the code can count (it lacked body_timeout,
    # session_ended and cross_site, added since).
    reasons = {*HINT_API_REJECTIONS, *SESSION_END_REJECTIONS, *SESSION_END_SKIPS,
               *CROSS_SITE_REASONS, *CORS_REFUSAL_REASONS, *GATEWAY_REJECTIONS,
               *ADMIN_REJECTIONS}
    unnamed = sorted(r for r in reasons if not re.search(rf"\b{r}\b", panel["description"]))
    unnamed += [p for p in CLIENT_TIMEOUT_PHASES if f"{p}:" not in panel["description"]]
    assert not unnamed, f"the refusals panel's description lacks {unnamed}"


# What the router's index ingestion counts that is throughput or bookkeeping, not a loss:
# every other kvhint_router_index_ingest_total{what} is on the dashboard's Drops panel.
_INGEST_THROUGHPUT = {
    "stream_batches_applied", "stream_buffered", "stream_covered_by_snapshot",
    "stream_epoch_changes", "stream_resyncs_started", "stream_resyncs_completed",
    "stream_snapshot_pages", "stream_deaths", "adapter_batches", "adapter_events",
    "index_stored_blocks", "index_removed_blocks", "index_cleared_workers",
    "index_purged_workers", "index_snapshots_loaded",
    # Host-tier references taken and given back (vLLM announces a hash once per chunk):
    # bookkeeping, nothing lost.
    "index_repeat_stores", "index_repeat_removes",
    # Heartbeats that waited for their worker's replayed history instead of a snapshot,
    # and how those waits ended: bookkeeping (a resync that follows is counted as one).
    "stream_resyncs_deferred", "stream_resyncs_avoided", "stream_replay_waits_expired",
    # Conflicts found over a worker's id: each has its alert (KvhintWorkerIdConflict);
    # what they make the router refuse is a loss (stream_other_source_dropped). Those
    # that ended unreported (a rollout's overlap, most likely): bookkeeping.
    "stream_id_conflicts", "stream_id_conflicts_unconfirmed",
    # Heartbeats whose interval_s was out of the plugin's bounds: taken, at the bound.
    "stream_status_interval_bounded",
    # A session a snapshot listed more than once: read once, every branch kept.
    "adapter_snapshot_session_repeats"}


def test_every_index_ingestion_loss_is_on_the_drops_panel() -> None:
    """Before, the panel's filter left out subject mismatches, implausible sequence
    numbers, ignored snapshot pages, missing batches, gaps, snapshot failures, stalled
    resyncs and events of other KV groups: messages or batches dropped, on no panel."""
    from kvhint.router.kv_index.ingest import KvEventIngestor
    from kvhint.router.kv_index.memory import InMemoryClusterKvIndex
    from kvhint.router.service.runtime import _ingest_counters

    index = InMemoryClusterKvIndex()
    names = set(_ingest_counters(KvEventIngestor(index, clock=lambda: 0.0), index.stats()))
    assert _INGEST_THROUGHPUT <= names, sorted(_INGEST_THROUGHPUT - names)
    dashboard = json.loads((DEPLOY / "grafana" / "kvhint-router.json").read_text())
    (drops,) = [p for p in dashboard["panels"] if p["title"].startswith("Drops")]
    (expr,) = [t["expr"] for t in drops["targets"] if "index_ingest" in t["expr"]]
    pattern = re.search(r'what=~\\?"(.+?)\\?"', expr).group(1).replace("\\\\", "\\")
    shown = {name for name in names if re.fullmatch(pattern, name)}
    assert shown == names - _INGEST_THROUGHPUT, (
        f"losses not on the panel: {sorted(names - _INGEST_THROUGHPUT - shown)}; "
        f"throughput on it: {sorted(shown & _INGEST_THROUGHPUT)}")
