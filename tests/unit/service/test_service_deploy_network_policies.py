"""deploy/kubernetes's NetworkPolicies: every workload has one, each admits exactly the
ports its pods listen on, and the vLLM workers (which serve inference with none of the
router's tenant checks) admit only the router and Prometheus.

Peers and selectors are read as Kubernetes reads them: a policy selects the pods of its
own namespace whose labels match its podSelector (matchLabels and matchExpressions);
policies add up, so a pod is reachable on what any policy selecting it admits."""

from __future__ import annotations

import yaml

from deploy_manifests import k8s_config_map, k8s_docs

WORKLOAD_KINDS = ("Deployment", "StatefulSet")
NAME = "app.kubernetes.io/name"
# How alertmanager.yaml admits Prometheus: its pods' label, in the one namespace named
# by the label Kubernetes itself sets (no other namespace can claim it).
PROMETHEUS_PEER = {"namespaceSelector": {"matchLabels": {
    "kubernetes.io/metadata.name": "monitoring"}},
    "podSelector": {"matchLabels": {NAME: "prometheus"}}}


def _matches(selector: dict, labels: dict[str, str]) -> bool:
    """Whether a label selector selects ``labels`` ({} selects every pod)."""
    if any(labels.get(key) != value for key, value in selector.get("matchLabels", {}).items()):
        return False
    for expression in selector.get("matchExpressions", []):
        key, operator, values = expression["key"], expression["operator"], \
            expression.get("values", [])
        held = {"In": key in labels and labels[key] in values,
                "NotIn": key not in labels or labels[key] not in values,
                "Exists": key in labels, "DoesNotExist": key not in labels}[operator]
        if not held:
            return False
    return True


def _workloads() -> list[dict]:
    return [doc for doc in k8s_docs() if doc["kind"] in WORKLOAD_KINDS]


def _pod_labels(workload: dict) -> dict[str, str]:
    return workload["spec"]["template"]["metadata"]["labels"]


def _policies_for(workload: dict) -> list[dict]:
    return [doc for doc in k8s_docs() if doc["kind"] == "NetworkPolicy"
            and _matches(doc["spec"]["podSelector"], _pod_labels(workload))]


def _restricts_ingress(policy: dict) -> bool:
    """Whether the policy isolates its pods' ingress (policyTypes, or by default: Ingress
    always, Egress when it has egress rules)."""
    return "Ingress" in policy["spec"].get("policyTypes", ["Ingress"])


def _container_ports(workload: dict) -> dict[str, int]:
    """What the pod listens on, ``{name or number: number}`` (the init containers listen
    on nothing)."""
    ports = {}
    for container in workload["spec"]["template"]["spec"]["containers"]:
        for port in container.get("ports", []):
            assert port.get("protocol", "TCP") == "TCP", port  # the policies name TCP
            ports[str(port["containerPort"])] = port["containerPort"]
            if "name" in port:
                ports[port["name"]] = port["containerPort"]
    return ports


def _admitted_ports(policy: dict, workload: dict) -> set[int]:
    """The container ports the policy's rules admit; every rule must name its ports (one
    without admits every port) and each port must be one the pods have."""
    known = _container_ports(workload)
    admitted = set()
    for rule in policy["spec"].get("ingress", []):
        assert rule.get("ports"), f"{policy['metadata']['name']}: a rule admits every port"
        for port in rule["ports"]:
            assert port.get("protocol", "TCP") == "TCP", port
            assert "endPort" not in port, port
            assert str(port["port"]) in known, (
                f"{policy['metadata']['name']} admits port {port['port']}, which "
                f"{workload['metadata']['name']}'s containers do not have")
            admitted.add(known[str(port["port"])])
    return admitted


def _reachable_ports(workload: dict) -> set[int]:
    """The ports other pods reach: every one while no policy isolates the pods' ingress,
    else what the isolating policies admit together."""
    policies = [p for p in _policies_for(workload) if _restricts_ingress(p)]
    if not policies:
        return set(_container_ports(workload).values())
    return set().union(*(_admitted_ports(p, workload) for p in policies))


def test_every_workload_has_a_network_policy_admitting_exactly_its_ports() -> None:
    """Security review: the router and the vLLM workers had no NetworkPolicy (NATS and
    Alertmanager had), so any pod of the cluster could call a worker directly and bypass
    the router's tenant checks. Every Deployment and StatefulSet shipped now has a
    policy selecting its pods, restricting ingress, and admitting exactly its
    containers' ports: none left unreachable (a scrape or a Service broken), none
    admitted that nothing listens on (a port renamed in one place only)."""
    workloads = _workloads()
    assert {w["metadata"]["name"] for w in workloads} >= {
        "kvhint-router", "vllm-worker", "kvhint-nats", "kvhint-alertmanager"}
    problems = []
    for workload in workloads:
        name = workload["metadata"]["name"]
        policies = _policies_for(workload)
        if not policies:
            problems.append(f"{name}: no NetworkPolicy selects its pods")
            continue
        if not any(_restricts_ingress(p) for p in policies):
            problems.append(f"{name}: no NetworkPolicy restricts its pods' ingress")
            continue
        admitted = _reachable_ports(workload)
        listened = set(_container_ports(workload).values())
        if admitted != listened:
            problems.append(f"{name}: policies admit ports {sorted(admitted)}, its "
                            f"containers listen on {sorted(listened)}")
    assert not problems, "\n".join(problems)


def test_every_service_targets_a_port_its_pods_policy_admits() -> None:
    """A Service in front of a port no policy admits answers no one."""
    workloads = _workloads()
    for service in [doc for doc in k8s_docs() if doc["kind"] == "Service"]:
        (workload,) = [w for w in workloads
                       if _matches({"matchLabels": service["spec"]["selector"]},
                                   _pod_labels(w))]
        admitted = _reachable_ports(workload)
        known = _container_ports(workload)
        for port in service["spec"]["ports"]:
            target = str(port.get("targetPort", port["port"]))
            assert known.get(target) in admitted, (service["metadata"]["name"], port)


def _worker() -> dict:
    (workload,) = [w for w in _workloads() if w["metadata"]["name"] == "vllm-worker"]
    return workload


def _router() -> dict:
    (workload,) = [w for w in _workloads() if w["metadata"]["name"] == "kvhint-router"]
    return workload


def test_only_the_router_and_prometheus_reach_the_workers() -> None:
    """The workers' 8000 serves inference with no API key, tenant or budget check (the
    router's job), and any pod could reach it. Now, across every policy selecting the
    worker pods, the only peers are the router's pods (this namespace) and Prometheus
    (one peer with both selectors: as two, every pod of the monitoring namespace and
    any pod here labelled prometheus would get in), and no rule admits every source."""
    worker = _worker()
    (port,) = worker["spec"]["template"]["spec"]["containers"][0]["ports"]
    peers = []
    for policy in _policies_for(worker):
        for rule in policy["spec"].get("ingress", []):
            assert rule.get("from"), f"{policy['metadata']['name']}: admits every source"
            assert [p["port"] for p in rule["ports"]] == [port["containerPort"]]
            peers += rule["from"]
    router_peer = {"podSelector": {"matchLabels": {NAME: "kvhint-router"}}}
    assert sorted(peers, key=str) == sorted([router_peer, PROMETHEUS_PEER], key=str)
    # The router peer names the router's pods, which exist; nothing else here matches it.
    assert _matches(router_peer["podSelector"], _pod_labels(_router()))
    assert [w["metadata"]["name"] for w in _workloads()
            if _matches(router_peer["podSelector"], _pod_labels(w))] == ["kvhint-router"]


def test_the_router_reaches_the_workers_and_prometheus_scrapes_them_on_the_admitted_port(
) -> None:
    """The addresses the router calls (its ConfigMap's workers, the plugin's http_url in
    the heartbeat) and Prometheus's scrape annotation use the port the policy admits;
    the kubelet's readiness probe comes from the node, which a policy always admits."""
    worker = _worker()
    admitted = _reachable_ports(worker)
    settings = yaml.safe_load(k8s_config_map("kvhint-router")["data"]["router.yaml"])
    assert {int(w["url"].rsplit(":", 1)[1]) for w in settings["workers"]} == admitted
    (args,) = worker["spec"]["template"]["spec"]["containers"][0]["args"]
    assert '\\"http_url\\":\\"http://${POD_NAME}.vllm-worker:8000\\"' in args
    assert "--port 8000" in args and admitted == {8000}
    annotations = worker["spec"]["template"]["metadata"]["annotations"]
    assert {int(annotations["prometheus.io/port"])} == admitted


def test_the_router_is_the_open_entry_point_on_its_port_only() -> None:
    """The router is where clients come in: its policy admits every source, explicitly
    (a rule without ``from``), on its one port, while no Ingress is shipped in front of
    it (with one, this rule should narrow to the ingress controller)."""
    assert not [doc for doc in k8s_docs() if doc["kind"] == "Ingress"]
    router = _router()
    (policy,) = _policies_for(router)
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    (rule,) = policy["spec"]["ingress"]
    assert "from" not in rule
    (port,) = router["spec"]["template"]["spec"]["containers"][0]["ports"]
    assert rule["ports"] == [{"protocol": "TCP", "port": port["containerPort"]}]
