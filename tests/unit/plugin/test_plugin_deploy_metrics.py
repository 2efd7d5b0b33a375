"""The plugin's drop counters are graphed and the worst alerted on (deploy/): a drop that
is counted but on no panel is as good as silent."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

from kvhint.engine_plugin.metrics import COUNTERS, GAUGES, LABELLED_COUNTERS, PREFIX, \
    exposed_names

DEPLOY = Path(__file__).resolve().parents[3] / "deploy"
_PLUGIN_METRIC = re.compile(r"\bkvhint:[a-z_]+")

# Plugin counters that count no loss, with where they are read instead; every other
# counter belongs on the "Plugin drops" panel.
NOT_DROPS = {
    "events_published": "throughput",
    "outcomes_published": "throughput",
    "releases_published": "throughput",
    "index_events": "throughput",
    "events_other_group": "by design: a hybrid model's other KV-cache groups' events, which "
                          "every router drops; nothing it follows is lost",
    "retained_released_under_pressure": "the retain policy at work: its own panel",
    "retained_kept_in_use_under_pressure": "the retain policy at work: its own panel",
    "retained_displaced": "the retain policy at work: its own panel",
    "claims_expired": "TTLs reached as asked: the retain panel",
    "hint_duplicates": "repeats answered their first outcome: nothing lost",
}


def _queried(expr: str) -> set[str]:
    return set(_PLUGIN_METRIC.findall(expr))


def test_every_plugin_drop_counter_is_on_the_plugin_drops_panel() -> None:
    """Before, only kvhint:releases_dropped_total of them was graphed."""
    dashboard = json.loads((DEPLOY / "grafana" / "kvhint-router.json").read_text())
    (panel,) = [p for p in dashboard["panels"] if p["title"].startswith("Plugin drops")]
    used = set().union(*(_queried(t["expr"]) for t in panel["targets"]))
    drops = {f"kvhint:{key}_total" for key in (*COUNTERS, *LABELLED_COUNTERS)
             if key not in NOT_DROPS}
    assert set(NOT_DROPS) <= set(COUNTERS)
    assert drops <= used, f"not graphed: {sorted(drops - used)}"
    assert used <= exposed_names()
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))


def test_the_plugin_alert_watches_dropped_events_inbound_and_internal_errors() -> None:
    rules = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())
    plugin_rules = [rule for group in rules["groups"] for rule in group["rules"]
                    if _queried(rule["expr"])]
    watched = set().union(*(_queried(rule["expr"]) for rule in plugin_rules))
    assert {"kvhint:events_dropped_total", "kvhint:inbound_dropped_total",
            "kvhint:internal_errors_total"} <= watched
    assert watched <= exposed_names()


def test_every_plugin_metric_an_alert_reads_is_on_a_panel() -> None:
    """KvhintPluginEventsNotKept reads kvhint:events_kept and kvhint:nats_connected, which
    were on no panel: an operator paged by it could not see which engines, since when, nor
    whether the plugin was connected. Now one panel graphs both per instance and engine,
    and says which alert they feed."""
    dashboard = json.loads((DEPLOY / "grafana" / "kvhint-router.json").read_text())
    rules = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())
    alerted = set().union(*(_queried(rule["expr"]) for group in rules["groups"]
                            for rule in group["rules"]))
    graphed = set().union(*(_queried(t["expr"]) for p in dashboard["panels"]
                            for t in p["targets"]))
    assert {"kvhint:events_kept", "kvhint:nats_connected"} <= alerted
    assert alerted <= graphed, f"alerted on, on no panel: {sorted(alerted - graphed)}"
    (panel,) = [p for p in dashboard["panels"] if any(
        "kvhint:events_kept" in _queried(t["expr"]) for t in p["targets"])]
    for target in panel["targets"]:  # a line per engine, not one per fleet
        assert "by (instance, engine)" in target["expr"], target
    assert "KvhintPluginEventsNotKept" in panel["description"]


def test_every_plugin_gauge_is_on_a_panel_per_engine() -> None:
    """kvhint:index_blocks and kvhint:index_sessions (the size of the plugin's session
    index) were on no panel. Every gauge of the plugin is graphed, a line per instance
    and engine (one per fleet would hide the engine that differs)."""
    dashboard = json.loads((DEPLOY / "grafana" / "kvhint-router.json").read_text())
    gauges = {f"{PREFIX}{key}" for key in GAUGES}
    assert {"kvhint:index_blocks", "kvhint:index_sessions"} <= gauges <= exposed_names()
    per_engine = set().union(*(_queried(t["expr"]) for p in dashboard["panels"]
                               for t in p["targets"] if "by (instance, engine)" in t["expr"]))
    assert gauges <= per_engine, f"not graphed per engine: {sorted(gauges - per_engine)}"
