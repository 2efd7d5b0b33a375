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

import yaml

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
    if promtool is None:
        return  # not installed here: test_service_deploy_queries.py is the check
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
