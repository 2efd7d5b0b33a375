"""Prometheus sends the alerts of deploy/prometheus/alerts.yml to an Alertmanager the deploy
files ship: compose's service and Kubernetes' Deployment and Service, both reading
deploy/alertmanager/alertmanager.yml. Before, prometheus.yml had no ``alerting:``: every
alert fired into nothing.

amtool (Alertmanager's checker) is no PyPI package; where it is installed (Debian's
prometheus-alertmanager) the test runs ``amtool check-config`` too, elsewhere the parse
below is the check."""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from kvhint.router.kv_index import InMemoryClusterKvIndex, KvEventIngestor
from kvhint.schemas import Budgets, Usage, WorkerStatus, new_epoch
from deploy_manifests import DEPLOY, k8s_config_map, k8s_container, k8s_docs, k8s_workload

CONFIG = DEPLOY / "alertmanager" / "alertmanager.yml"
_PINNED = re.compile(r"prom/alertmanager:v\d+\.\d+\.\d+")


def _flags(args: list[str]) -> dict[str, str]:
    return dict(arg.split("=", 1) for arg in args if arg.startswith("--"))


def _listen_port(flags: dict[str, str]) -> int:
    return int(flags.get("--web.listen-address", ":9093").rsplit(":", 1)[1])


def _compose_services() -> dict[str, dict]:
    return yaml.safe_load((DEPLOY / "compose.yaml").read_text())["services"]


def test_prometheus_sends_its_alerts_to_compose_alertmanager() -> None:
    """prometheus.yml's alerting target is compose's Alertmanager service, on the port it
    listens on, on a network Prometheus shares; it reads the shipped file, mounted."""
    scrape = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    (manager,) = scrape["alerting"]["alertmanagers"]
    (static,) = manager["static_configs"]
    (target,) = static["targets"]
    host, port = target.rsplit(":", 1)
    services = _compose_services()
    assert host in services, f"{target}: no compose service {host!r}"
    alertmanager = services[host]
    assert _PINNED.fullmatch(alertmanager["image"]), alertmanager["image"]
    flags = _flags(alertmanager["command"])
    assert int(port) == _listen_port(flags)

    def networks(service: dict) -> set[str]:
        return set(service.get("networks", ["default"]))
    assert networks(services["prometheus"]) & networks(alertmanager)
    mounts = {target: source for source, target, *_ in
              (volume.split(":") for volume in alertmanager["volumes"])}
    assert mounts[flags["--config.file"]] == "./alertmanager/alertmanager.yml"
    assert flags["--cluster.listen-address"] == ""  # one instance: no gossip port


def test_kubernetes_ships_the_same_alertmanager_behind_a_service() -> None:
    config_map = k8s_config_map("kvhint-alertmanager")
    assert config_map["data"]["alertmanager.yml"] == CONFIG.read_text()
    container = k8s_container("kvhint-alertmanager")
    assert container["image"] == _compose_services()["alertmanager"]["image"]
    flags = _flags(container["args"])
    config_dir, config_name = flags["--config.file"].rsplit("/", 1)
    pod = k8s_workload("kvhint-alertmanager")["spec"]["template"]
    volumes = {volume["name"]: volume for volume in pod["spec"]["volumes"]}
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == config_dir]
    assert volumes[mount["name"]]["configMap"]["name"] == "kvhint-alertmanager"
    assert config_name in config_map["data"]
    (port,) = container["ports"]
    assert port["containerPort"] == _listen_port(flags)
    assert {container[probe]["httpGet"]["path"] for probe in (
        "readinessProbe", "livenessProbe")} == {"/-/ready", "/-/healthy"}

    (service,) = [doc for doc in k8s_docs() if doc["kind"] == "Service"
                  and doc["metadata"]["name"] == "kvhint-alertmanager"]
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    (service_port,) = service["spec"]["ports"]
    assert service_port["targetPort"] in (port["name"], port["containerPort"])
    # What an operator's Prometheus targets: the manifest says so, with this port.
    address = f"kvhint-alertmanager:{service_port['port']}"
    assert address in (DEPLOY / "kubernetes" / "alertmanager.yaml").read_text()


def _routes(route: dict) -> Iterator[dict]:
    yield route
    for child in route.get("routes", []):
        yield from _routes(child)


def test_the_alertmanager_config_routes_to_receivers_it_defines() -> None:
    """Every route names a receiver the file defines; the shipped default notifies no one
    (a null receiver, not a made-up URL that fails every notification) until an
    operator replaces it, as the file's comment says."""
    config = yaml.safe_load(CONFIG.read_text())
    receivers = {receiver["name"]: receiver for receiver in config["receivers"]}
    for route in _routes(config["route"]):
        assert route.get("receiver", config["route"]["receiver"]) in receivers, route
    assert set(receivers[config["route"]["receiver"]]) == {"name"}
    assert "Replace the receiver" in CONFIG.read_text()
    if shutil.which("amtool") is None:
        return  # not installed here: the parse above is the check
    checked = subprocess.run(["amtool", "check-config", str(CONFIG)], capture_output=True,
                             text=True, timeout=60)
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_kvhint_drops_fires_in_prometheus_on_a_loss_not_on_an_eviction(tmp_path: Path) -> None:
    """Prometheus's own rule engine (promtool test rules, where promtool is installed:
    it is no PyPI package; test_service_deploy_queries.py checks the matchers without
    it): a steady stream of sessions evicted from memory past the bound, normal under
    load, fires nothing; hints the router could not send fire KvhintDrops."""
    promtool = shutil.which("promtool")
    if promtool is None:  # no PyPI package; test_service_deploy_queries.py checks matchers
        pytest.skip("promtool is not installed: Prometheus's rule engine not run")
    rules = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())
    (drops,) = [rule for group in rules["groups"] for rule in group["rules"]
                if rule["alert"] == "KvhintDrops"]
    series = 'kvhint_router_drops_total{{job="kvhint-router",instance="router:8080",what="{}"}}'
    spec = {
        "rule_files": [str(DEPLOY / "prometheus" / "alerts.yml")],
        "evaluation_interval": "1m",
        "tests": [{
            "interval": "1m",
            "input_series": [
                {"series": series.format("session_evicted_from_memory"), "values": "0+50x40"},
                {"series": series.format("trace_rotated_out"), "values": "0+3x40"},
                {"series": series.format("hint_unsent"), "values": "0+1x40"}],
            "alert_rule_test": [
                {"eval_time": "5m", "alertname": "KvhintDrops", "exp_alerts": []},
                {"eval_time": "30m", "alertname": "KvhintDrops", "exp_alerts": [{
                    "exp_labels": {"severity": "info", "what": "hint_unsent"},
                    "exp_annotations": {
                        key: text.replace("{{ $labels.what }}", "hint_unsent")
                        for key, text in drops["annotations"].items()}}]}],
        }],
    }
    test_file = tmp_path / "drops_test.yml"
    test_file.write_text(yaml.safe_dump(spec))
    done = subprocess.run([promtool, "test", "rules", str(test_file)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


def _promtool_rule_test(tmp_path: Path, series: list[dict], tests: list[dict]) -> None:
    """``promtool test rules`` on alerts.yml with these input series and alert tests
    (one a minute); the test is skipped where promtool is not installed."""
    promtool = shutil.which("promtool")
    if promtool is None:  # no PyPI package; test_service_deploy_queries.py checks matchers
        pytest.skip("promtool is not installed: Prometheus's rule engine not run")
    spec = {"rule_files": [str(DEPLOY / "prometheus" / "alerts.yml")],
            "evaluation_interval": "1m",
            "tests": [{"interval": "1m", "input_series": series, "alert_rule_test": tests}]}
    test_file = tmp_path / "rules_test.yml"
    test_file.write_text(yaml.safe_dump(spec))
    done = subprocess.run([promtool, "test", "rules", str(test_file)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


def test_events_not_kept_fires_on_a_lasting_state_not_for_an_hour_after_one_failure(
        tmp_path: Path) -> None:
    """KvhintPluginEventsNotKept read the last hour's increase of the plugin's
    stream_create_failures: one failed look for the events stream (the router creating
    it a minute later) held the alert for an hour. It now reads kvhint:events_kept,
    which the plugin looks at again every 60 s: a failed look corrected at the next
    fires nothing; a stream missing for good fires while the plugin is connected, and
    not while it is cut off from NATS (nothing is published then)."""
    worker = '{{job="vllm-workers",instance="{}",model_name="m",engine="0"}}'

    def plugin(instance: str, kept: str, connected: str, failures: str) -> list[dict]:
        labels = worker.format(instance)
        return [{"series": f"kvhint:events_kept{labels}", "values": kept},
                {"series": f"kvhint:nats_connected{labels}", "values": connected},
                {"series": f"kvhint:stream_create_failures_total{labels}", "values": failures}]
    series = (
        # One failed look at set-up, found at the next (the router made it meanwhile).
        plugin("w0:8000", "0 0 1x60", "1x62", "0 1x61")
        # No stream for good (the plugin may not create it).
        + plugin("w1:8000", "0x62", "1x62", "1+1x61")
        # Cut off from NATS: nothing published, nothing to keep.
        + plugin("w2:8000", "0x62", "0x62", "0x62"))
    expected = {"job": "vllm-workers", "instance": "w1:8000", "model_name": "m",
                "engine": "0", "severity": "warning"}
    rules = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())
    (rule,) = [rule for group in rules["groups"] for rule in group["rules"]
               if rule["alert"] == "KvhintPluginEventsNotKept"]
    annotations = {key: text.replace("{{ $labels.instance }}", "w1:8000")
                   for key, text in rule["annotations"].items()}
    _promtool_rule_test(tmp_path, series, [
        {"eval_time": "3m", "alertname": "KvhintPluginEventsNotKept", "exp_alerts": []},
        {"eval_time": "30m", "alertname": "KvhintPluginEventsNotKept",
         "exp_alerts": [{"exp_labels": expected, "exp_annotations": annotations}]}])


def _conflict_gauge(minutes: int, old_pod_drains_s: float | None) -> str:
    """kvhint_router_worker_id_conflict{worker="w0"} as a scrape a minute would read it
    from the real ingestor (promtool's series notation; ``_``: no sample, the router
    exports none), while two engines heartbeat under w0 every 2 s (the plugin's default)
    with B taken first: A stops after ``old_pod_drains_s`` (a surge rollout's old pod),
    or never (None: a misconfiguration)."""
    clock = [1000.0]
    ingestor = KvEventIngestor(InMemoryClusterKvIndex(), lambda: clock[0])
    start, samples = clock[0], []
    epochs = {"a": new_epoch(1.0), "b": new_epoch(2.0)}

    def beat(pod: str) -> None:
        ingestor.on_status(WorkerStatus(
            worker_id="w0", epoch=epochs[pod], model="m", cache_namespace="ns",
            block_size=16, hash_algo="sha256", none_hash_seed=None, supported_actions={},
            budgets=Budgets(max_pinned_blocks=0, max_pin_ttl_s=0, max_retained_blocks=0,
                            max_retain_ttl_s=0),
            usage=Usage(gpu_blocks_total=1, gpu_blocks_free=1, kv_usage=0.0),
            interval_s=2.0, at=0.0, http_url=f"http://{pod}:8000"))
    beat("a")
    for step in range(minutes * 30 + 1):  # a 2 s heartbeat interval
        if step % 30 == 0:
            samples.append("1" if ingestor.conflicting_workers() == ("w0",) else "_")
        clock[0] += 1.0
        beat("b")
        clock[0] += 1.0
        if old_pod_drains_s is None or clock[0] - start <= old_pod_drains_s:
            beat("a")
        ingestor.tick()
    return " ".join(samples)


def test_a_surge_rollout_fires_no_id_conflict_and_two_live_servers_do(tmp_path: Path) -> None:
    """The router's gauge as it sets it, through Prometheus's rule engine: a rollout
    whose old pod drains 90 s beside the new one fires nothing (before, the router held
    the conflict conflict_hold_s, 10 min, after the old pod's last beat: the alert fired
    at every rollout); two servers under one id for good fire, once the router reported
    it (conflict_confirm_s, 5 min) and the rule's for: passed."""
    rollout = _conflict_gauge(20, old_pod_drains_s=90.0)
    assert set(rollout.split()) == {"_"}, rollout
    misconfigured = _conflict_gauge(20, old_pod_drains_s=None)
    # Found at its first seconds, reported past 300 s: absent at minute 5, 1 from 6 on.
    assert misconfigured.split()[5:7] == ["_", "1"], misconfigured
    rules = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())
    (rule,) = [rule for group in rules["groups"] for rule in group["rules"]
               if rule["alert"] == "KvhintWorkerIdConflict"]
    labels = '{{job="kvhint-router",instance="router:8080",worker="{}"}}'
    annotations = {key: text.replace("{{ $labels.worker }}", "w1")
                   for key, text in rule["annotations"].items()}
    fired = {"exp_labels": {"worker": "w1", "severity": "warning"},  # max by (worker)
             "exp_annotations": annotations}
    _promtool_rule_test(tmp_path, [
        {"series": f"kvhint_router_worker_id_conflict{labels.format('w0')}", "values": rollout},
        {"series": f"kvhint_router_worker_id_conflict{labels.format('w1')}",
         "values": misconfigured}], [
        {"eval_time": f"{m}m", "alertname": "KvhintWorkerIdConflict", "exp_alerts": []}
        for m in (1, 2, 5, 6)] + [
        {"eval_time": f"{m}m", "alertname": "KvhintWorkerIdConflict", "exp_alerts": [fired]}
        for m in (8, 12, 20)])


def test_kubernetes_lets_only_prometheus_reach_alertmanager() -> None:
    """Security review: whoever reaches Alertmanager's 9093 reads the alerts and silences
    them, and no NetworkPolicy covered its pods (NATS's ports had one): every pod of
    the cluster reached it. Now one policy selects them and admits, on 9093 only,
    Prometheus (pods labelled app.kubernetes.io/name: prometheus in one namespace, named
    by the label Kubernetes itself sets) and this namespace's pods labelled
    kvhint.io/alertmanager-client: "true"; no rule admits every pod or every port."""
    pod = k8s_workload("kvhint-alertmanager")["spec"]["template"]
    labels = pod["metadata"]["labels"]
    (policy,) = [doc for doc in k8s_docs() if doc["kind"] == "NetworkPolicy"
                 and doc["spec"]["podSelector"]["matchLabels"].items() <= labels.items()]
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    (port,) = k8s_container("kvhint-alertmanager")["ports"]
    peers = []
    for rule in policy["spec"]["ingress"]:
        assert rule.get("from") and rule.get("ports"), rule  # else every pod or port
        assert rule["ports"] == [{"protocol": "TCP", "port": port["containerPort"]}]
        peers += rule["from"]
    for peer in peers:
        assert set(peer) <= {"podSelector", "namespaceSelector"}, peer
        assert peer["podSelector"].get("matchLabels"), peer
        if "namespaceSelector" in peer:  # one namespace, by the name Kubernetes sets
            assert list(peer["namespaceSelector"]) == ["matchLabels"], peer
            assert list(peer["namespaceSelector"]["matchLabels"]) == [
                "kubernetes.io/metadata.name"], peer
    prometheus = [peer for peer in peers if peer["podSelector"]["matchLabels"] == {
        "app.kubernetes.io/name": "prometheus"}]
    assert len(prometheus) == 1 and "namespaceSelector" in prometheus[0]
    local = [peer for peer in peers if "namespaceSelector" not in peer]
    assert [peer["podSelector"]["matchLabels"] for peer in local] == [
        {"kvhint.io/alertmanager-client": "true"}]
    # The readiness and liveness probes come from the node, which a policy admits.
    container = k8s_container("kvhint-alertmanager")
    assert {container[probe]["httpGet"]["port"] for probe in (
        "readinessProbe", "livenessProbe")} == {port["name"]}
