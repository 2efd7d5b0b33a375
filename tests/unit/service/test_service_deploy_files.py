"""The operator files in deploy/ parse and start with what they ship: compose, the
Kubernetes manifests, the router's configs and their secrets (the dashboards and alerts'
metrics: test_service_deploy_dashboard.py)."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from deploy_manifests import DEPLOY, compose_command, compose_mounts, interpolated, \
    k8s_config_map, k8s_container, k8s_docs, k8s_env, k8s_expanded, k8s_mounts, k8s_secrets, \
    k8s_workload, run_start
from kvhint.router.service.settings import RouterSettings
from kvhint.schemas.nats_address import NatsConnection, nats_connection


def test_compose_and_kubernetes_manifests_parse() -> None:
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    assert {"nats", "postgres", "router", "worker-0", "worker-1", "prometheus",
            "grafana"} <= set(compose["services"])
    kinds = []
    for path in sorted((DEPLOY / "kubernetes").glob("*.yaml")):
        kinds += [doc["kind"] for doc in yaml.safe_load_all(path.read_text()) if doc]
    assert {"Deployment", "StatefulSet", "Service", "ConfigMap", "Secret"} <= set(kinds)
    scrape = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    assert any(job["job_name"] == "kvhint-router" for job in scrape["scrape_configs"])


@pytest.fixture
def example_secrets_allowed(monkeypatch: pytest.MonkeyPatch) -> None:
    """The shipped files' secrets are placeholders the router refuses to start with
    (test_the_shipped_placeholder_secrets_are_refused); these tests check the rest."""
    from kvhint.schemas import nats_address

    monkeypatch.setattr(nats_address, "PLACEHOLDER_SECRET_PREFIX", "\0not-a-placeholder")


def test_the_shipped_placeholder_secrets_are_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The deploy files ship public placeholders (change-me...) for every secret; a router
    started with one (the Kubernetes Secrets applied as they are, compose's router.yaml
    unedited) served with keys anyone who read the repository holds. It now refuses to
    start, naming each setting, never its value."""
    from pydantic import ValidationError

    ours = RouterSettings(admin_keys=["a-real-key"], salt_secret="ours",
                          nats_url="nats://kvhint:s3cret@nats:4222,nats://n2:4222",
                          database_url="postgresql+psycopg://u:pw@db/kvhint")
    assert ours.admin_keys == ["a-real-key"]
    with pytest.raises(ValidationError, match="metrics_token"):
        RouterSettings(metrics_token="Change-Me-0123456789")
    with pytest.raises(ValidationError, match=r"tenants\[team-a\]\.api_keys"):
        RouterSettings(config_file=DEPLOY / "router.yaml")  # compose's, unedited
    config = _k8s_router_as_shipped(tmp_path, monkeypatch)
    with pytest.raises(ValidationError) as refused:
        RouterSettings(config_file=config)
    message = str(refused.value)
    for name in ("admin_keys", "tenants[team-a].api_keys", "salt_secret",
                 "nats_url password", "database_url password"):
        assert name in message, name
    assert "change-me-admin" not in message and "change-me-nats" not in message


def _k8s_router_as_shipped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                           secrets: dict[str, dict[str, str]] | None = None) -> Path:
    """The Kubernetes router's settings file (its ConfigMap's, returned) and the
    environment its container starts the router with (set here): the Deployment's, from
    the Secrets (``secrets``, else as shipped), and the NATS URL its start script
    (nats-url-env.sh, run) adds."""
    container = k8s_container("kvhint-router")
    env = k8s_env(container, secrets or k8s_secrets())
    started = run_start([k8s_expanded(arg, env) for arg in container["command"]
                         + container["args"]], env, k8s_mounts("kvhint-router", tmp_path),
                        ["kvhint"], tmp_path)
    argv = started["argv"]
    assert argv[0] == "router", argv
    for name, value in started["env"].items():
        if name.startswith("KVHINT_"):
            monkeypatch.setenv(name, value)
    return Path(argv[argv.index("--config") + 1])  # the ConfigMap's file


def test_shipped_router_configs_are_valid_settings(example_secrets_allowed: None) -> None:
    settings = RouterSettings(config_file=DEPLOY / "router.yaml")
    assert [w.id for w in settings.workers] == ["w0", "w1"]
    k8s = next(doc for doc in yaml.safe_load_all(
        (DEPLOY / "kubernetes" / "router.yaml").read_text()) if doc["kind"] == "ConfigMap")
    assert RouterSettings(**yaml.safe_load(k8s["data"]["router.yaml"])).nats_url


def _commented_examples(text: str) -> dict:
    """The top-level settings a router config shows commented out (``# key: value``)."""
    examples: dict = {}
    for match in re.finditer(r"(?m)^\s*# ([a-z_]+: \S.*)$", text):
        examples |= {key: value for key, value in yaml.safe_load(match[1]).items()
                     if key in RouterSettings.model_fields}
    return examples


def test_the_commented_examples_in_the_router_configs_are_valid_settings(
        example_secrets_allowed: None) -> None:
    """An operator uncommenting an example (CORS, allowed_hosts, metrics_token, the
    replay and conflict waits...) gets settings the router starts with, not a refusal."""
    compose = _commented_examples((DEPLOY / "router.yaml").read_text())
    assert {"cors_allowed_origins", "cors_allow_credentials", "allowed_hosts",
            "metrics_token", "replay_wait_s", "conflict_hold_s"} <= set(compose)
    settings = RouterSettings(config_file=DEPLOY / "router.yaml", **compose)
    assert settings.cors_allowed_origins and settings.allowed_hosts
    k8s = k8s_config_map("kvhint-router")["data"]["router.yaml"]
    examples = _commented_examples(k8s)
    assert {"cors_allowed_origins", "replay_wait_s", "conflict_hold_s"} <= set(examples)
    assert RouterSettings(**yaml.safe_load(k8s), **examples).cors_allowed_origins


def test_the_shipped_deployments_start_with_their_environment(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, example_secrets_allowed: None) -> None:
    """The Kubernetes router as shipped: its ConfigMap file plus the environment its
    Deployment sets from the Secret (admin keys comma-separated, tenants as JSON); and
    compose's single admin key. Before, both env forms crashed the router at start."""
    config = _k8s_router_as_shipped(tmp_path, monkeypatch)
    settings = RouterSettings(config_file=config)
    assert settings.admin_keys == ["change-me-admin"]
    assert [(t.name, t.api_keys) for t in settings.tenants] == [
        ("team-a", ["change-me-team-a"])]
    assert not settings.dev_mode and settings.database_url.startswith("postgresql+psycopg")
    monkeypatch.setenv("KVHINT_ROUTER_ADMIN_KEYS", "k1, k2")
    assert RouterSettings(config_file=config).admin_keys == ["k1", "k2"]


def test_the_router_deployment_probes_real_paths(tmp_path: Path) -> None:
    """Readiness asks ``/ready`` (a worker answered), liveness and start-up ``/health``:
    with readiness on ``/health``, a router that can only answer 503 stayed in rotation."""
    from kvhint.router.service.app import create_app

    deployment = next(doc for doc in yaml.safe_load_all(
        (DEPLOY / "kubernetes" / "router.yaml").read_text()) if doc and doc["kind"] == "Deployment")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    probes = {kind: container[kind]["httpGet"]["path"]
              for kind in ("startupProbe", "readinessProbe", "livenessProbe")}
    assert probes == {"startupProbe": "/health", "readinessProbe": "/ready",
                      "livenessProbe": "/health"}
    settings = RouterSettings(database_url=f"sqlite:///{tmp_path / 'r.db'}", nats_url=None)
    paths = {getattr(route, "path", None) for route in create_app(settings).api.routes}
    assert set(probes.values()) <= paths


def _host_ip(port: str) -> str | None:
    """The host address a compose short-syntax port binds ("[IP:]HOST:CONTAINER"), with
    a ``${VAR:-default}`` address read as its default; None: all interfaces."""
    port = re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", port)
    parts = port.rsplit(":", 2)
    return parts[0] if len(parts) == 3 else None


def test_compose_keeps_nats_and_postgres_private_and_publishes_on_loopback(
        example_secrets_allowed: None) -> None:
    """Security review: compose published NATS's 4222 on every interface, without
    credentials, against README's trust boundary (whoever reaches NATS reads prompts'
    token ids and steers the caches). NATS and PostgreSQL are published nowhere and sit
    on internal networks only the router (and, for NATS, the workers) join; every
    published port binds 127.0.0.1 by default."""
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    services = compose["services"]
    for name in ("nats", "postgres"):
        assert "ports" not in services[name], name
    networks = compose["networks"]
    (bus,) = services["nats"]["networks"]
    (store,) = services["postgres"]["networks"]
    assert networks[bus]["internal"] is True and networks[store]["internal"] is True
    on = {net: {name for name, service in services.items()
                if net in service.get("networks", ["default"])} for net in (bus, store)}
    assert on[bus] == {"nats", "router", "worker-0", "worker-1"}
    assert on[store] == {"postgres", "router"}
    published = {name: service["ports"] for name, service in services.items()
                 if "ports" in service}
    assert set(published) == {"router", "prometheus", "alertmanager", "grafana"}
    for name, ports in published.items():
        for port in ports:
            assert _host_ip(str(port)) == "127.0.0.1", (name, port)
    # The workers and the router still reach NATS by its service name.
    assert RouterSettings(config_file=DEPLOY / "router.yaml").nats_url == "nats://nats:4222"


def test_kubernetes_lets_only_the_router_and_the_workers_reach_nats() -> None:
    docs = [doc for doc in yaml.safe_load_all(
        (DEPLOY / "kubernetes" / "nats.yaml").read_text()) if doc]
    (policy,) = [doc for doc in docs if doc["kind"] == "NetworkPolicy"]
    assert policy["spec"]["podSelector"]["matchLabels"] == {
        "app.kubernetes.io/name": "kvhint-nats"}
    client_rules = [rule for rule in policy["spec"]["ingress"]
                    if any(p["port"] == 4222 for p in rule["ports"])]
    assert len(client_rules) == 1 and "from" in client_rules[0]
    allowed = {peer["podSelector"]["matchLabels"]["app.kubernetes.io/name"]
               for peer in client_rules[0]["from"]}
    assert allowed == {"kvhint-router", "vllm-worker"}
    labels = {doc["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/name"]
              for path in ("router.yaml", "vllm-workers.yaml")
              for doc in yaml.safe_load_all((DEPLOY / "kubernetes" / path).read_text())
              if doc and doc["kind"] in ("Deployment", "StatefulSet")}
    assert labels == allowed  # the selectors name pods that exist


def test_kubernetes_admits_only_labelled_pods_to_the_nats_monitor_port() -> None:
    """Security review: NATS's monitor port 8222 (/connz, /subsz, /jsz: the clients, their
    subjects, the streams) was open to every pod. Now each ingress rule names its peers
    and ports, and 8222 admits only this namespace's pods labelled
    kvhint.io/nats-monitor: "true" (Prometheus scrapes no NATS; the readiness probe
    comes from the node, which a NetworkPolicy always admits)."""
    (policy,) = [doc for doc in k8s_docs() if doc["kind"] == "NetworkPolicy"
                 and doc["metadata"]["name"] == "kvhint-nats"]
    rules = policy["spec"]["ingress"]
    for rule in rules:  # a rule without peers or ports admits every pod or every port
        assert rule.get("from") and rule.get("ports"), rule
        for peer in rule["from"]:
            assert set(peer) == {"podSelector"} and peer["podSelector"].get("matchLabels"), peer
    monitor = [rule for rule in rules if any(p["port"] == 8222 for p in rule["ports"])]
    assert [rule["from"] for rule in monitor] == [
        [{"podSelector": {"matchLabels": {"kvhint.io/nats-monitor": "true"}}}]]
    assert [p["port"] for p in monitor[0]["ports"]] == [8222]
    probe = k8s_container("kvhint-nats")["readinessProbe"]["httpGet"]
    assert probe == {"path": "/healthz", "port": "monitor"}  # from the node: admitted


def _kv_transfer_configs(service: dict) -> list[dict]:
    return [json.loads(arg.split("=", 1)[1]) for arg in service.get("command") or []
            if isinstance(arg, str) and arg.startswith("--kv-transfer-config=")]


def _nats_password_uses(text: str) -> list[str]:
    """Every ``${KVHINT_NATS_PASSWORD...}`` in ``text``, as written."""
    return re.findall(r"\$\{KVHINT_NATS_PASSWORD(?:[:?+-][^}]*)?\}", text)


def test_compose_refuses_to_start_without_the_nats_password() -> None:
    """Security review: compose's NATS defaulted to a public password (change-me-nats).
    Now every use of KVHINT_NATS_PASSWORD is ``${...:?...}``, which compose refuses to
    start without (unset or empty), with a message naming deploy/.env.example; and
    .env.example ships it empty. With docker compose here, its own check says so too."""
    text = (DEPLOY / "compose.yaml").read_text()
    uses = _nats_password_uses(text)
    assert len(uses) >= 2  # the URL the router and workers get; NATS's environment
    assert text.count("${KVHINT_NATS_PASSWORD") == len(uses)  # all of them, and no bare
    assert "$KVHINT_NATS_PASSWORD" not in text  # $VAR form
    for use in uses:
        assert use.startswith("${KVHINT_NATS_PASSWORD:?") and "deploy/.env.example" in use
    with pytest.raises(AssertionError, match="needs KVHINT_NATS_PASSWORD"):
        interpolated(text, {"KVHINT_ADMIN_KEY": "adm", "KVHINT_NATS_PASSWORD": "",
                            "KVHINT_WORKER_API_KEY": "wk"})
    example = (DEPLOY / ".env.example").read_text()
    # No secret ships with a value (it held change-me-admin, a public admin key).
    for secret in ("KVHINT_NATS_PASSWORD", "KVHINT_ADMIN_KEY"):
        assert re.search(rf"^{secret}=$", example, re.M), secret
    assert "${KVHINT_ADMIN_KEY:?" in text and "${KVHINT_ADMIN_KEY:-" not in text

    compose = compose_command()
    if compose is None:
        return  # no Docker Compose here (Python 3.10): the parse above is the check
    docker = [*compose, "--env-file", os.devnull, "-f", str(DEPLOY / "compose.yaml"),
              "config", "-q"]
    env = {k: v for k, v in os.environ.items() if k != "KVHINT_NATS_PASSWORD"}
    env["KVHINT_ADMIN_KEY"] = "adm"
    env["KVHINT_WORKER_API_KEY"] = "wk"
    refused = subprocess.run(docker, env=env, capture_output=True, text=True, timeout=60)
    assert refused.returncode != 0 and "deploy/.env.example" in refused.stderr
    started = subprocess.run(docker, env=env | {"KVHINT_NATS_PASSWORD": "pw"},
                             capture_output=True, text=True, timeout=60)
    assert started.returncode == 0, started.stderr


@pytest.mark.parametrize("password", ["pw-from-env_1.x", "p/a#s?s@w%rd,x"])
def test_compose_nats_reads_its_password_from_its_environment_not_its_command_line(
        password: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        example_secrets_allowed: None) -> None:
    """Security review: compose's NATS took the password as ``--pass`` on its command
    line, which ``ps`` and /proc/PID/cmdline show. Now it starts with ``-c`` and the
    mounted nats.conf only, and gets the password (in double quotes: nats.conf says why)
    in NATS_PASSWORD_QUOTED. (tests/integration/service/test_service_deploy_nats.py runs
    the real nats-server so.) The router gets the URL with user kvhint and the password
    in its environment, over router.yaml's, and each worker in the variable its plugin's
    nats_url_env names: vLLM logs --kv-transfer-config, and no service's holds a NATS
    URL, let alone a password.

    The URL is built at start by nats-url-env.sh (run here, the servers stand-ins), the
    password percent-encoded: before, compose wrote it raw into the URL, and a password
    with '/', '#', '?', '@', '%' or ',' gave a URL the router and the plugin refused (or
    read another host from), so the deploy files allowed letters, digits, '-', '_' and
    '.' only."""
    from kvhint.engine_plugin.config import load_plugin_config

    env = {"KVHINT_ADMIN_KEY": "adm", "KVHINT_NATS_PASSWORD": password,
           "KVHINT_WORKER_API_KEY": "wk"}
    services = yaml.safe_load(interpolated((DEPLOY / "compose.yaml").read_text(), env))[
        "services"]
    nats = services["nats"]
    assert nats["command"] == ["nats-server", "-c", "/etc/nats/nats.conf"]
    assert "./nats.conf:/etc/nats/nats.conf:ro" in nats["volumes"]
    assert nats["environment"] == {"NATS_PASSWORD": password,  # nats-check-password.sh's
                                   "NATS_PASSWORD_QUOTED": f'"{password}"'}
    for name, service in services.items():
        command = json.dumps([*(service.get("entrypoint") or []), *(service.get("command")
                                                                     or [])])
        assert password not in command and "--pass" not in command, name
    expected = NatsConnection(("nats://nats:4222",), user="kvhint", password=password)

    workers = 0
    for name, service in services.items():
        for config in _kv_transfer_configs(service):
            extra = config["kv_connector_extra_config"]
            assert password not in json.dumps(config) and "nats_url" not in extra, name
            started = run_start([*service["entrypoint"], *service["command"]],
                                service["environment"], compose_mounts(service),
                                ["python3"], tmp_path)
            # vLLM's OpenAI server, with the service's arguments.
            assert started["argv"] == ["-m", "vllm.entrypoints.openai.api_server",
                                       *service["command"]], name
            assert started["program"] == "python3"
            url = started["env"][extra["nats_url_env"]]
            assert password not in url
            monkeypatch.setenv(extra["nats_url_env"], url)
            # What the plugin connects with.
            assert load_plugin_config(extra).nats_connection == expected, name
            workers += 1
    assert workers == 2
    router = services["router"]
    mounts = compose_mounts(router)
    started = run_start([*router["entrypoint"], *router["command"]], router["environment"],
                        mounts, ["kvhint"], tmp_path)
    # The image's own entrypoint and command (router.Dockerfile), run by the script (the
    # mounted router.yaml, here the local file).
    dockerfile = (DEPLOY / "docker" / "router.Dockerfile").read_text()
    image_start = [json.loads(m) for m in re.findall(r"^(?:ENTRYPOINT|CMD) (\[.*\])$",
                                                      dockerfile, re.M)]
    assert ["kvhint", *started["argv"]] == [str(mounts.get(arg, arg))
                                            for arg in [*image_start[0], *image_start[1]]]
    for variable, value in started["env"].items():
        if variable.startswith("KVHINT_ROUTER_"):
            monkeypatch.setenv(variable, value)
    settings = RouterSettings(config_file=DEPLOY / "router.yaml")
    assert password not in settings.nats_url
    assert nats_connection(settings.nats_url) == expected


@pytest.mark.parametrize("password", [None, "pw-from-secret_2.y", "p/a#s?s@w%rd,x"])
def test_kubernetes_nats_requires_a_password_kept_out_of_kv_transfer_config(
        password: str | None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        example_secrets_allowed: None) -> None:
    """Security review: the Kubernetes NATS took any client (compose's already required a
    password), then took the password as ``--pass`` on its command line (ps shows it).
    Now it requires user kvhint and the password in Secret kvhint-nats (as shipped, and
    as an operator replaces it), which it reads from its environment through the
    ConfigMap's nats.conf; the router and the workers start through nats-url-env.sh
    (ConfigMap kvhint-nats-client), which puts the URL with that password,
    percent-encoded, in their environment, the workers' through the plugin's
    nats_url_env: vLLM logs --kv-transfer-config, and none holds a NATS URL or the
    password. The password is written nowhere in the manifests but the Secret.

    Before, the manifests composed the URL with Kubernetes' $(KVHINT_NATS_PASSWORD): the
    raw password in the URL, so one with '/', '#', '?', '@', '%' or ',' was refused by
    the router and the plugin (or read as another host)."""
    from kvhint.engine_plugin.config import load_plugin_config

    secrets = k8s_secrets()
    shipped = secrets["kvhint-nats"]["password"]
    assert shipped == "change-me-nats"
    manifests = "".join(p.read_text() for p in (DEPLOY / "kubernetes").glob("*.yaml"))
    assert manifests.count(shipped) == 1 and "@kvhint-nats" not in manifests
    assert "$(KVHINT_NATS_PASSWORD)" not in manifests  # raw into a URL
    if password is not None:
        secrets["kvhint-nats"]["password"] = password
    secret = password or shipped
    expected = NatsConnection(("nats://kvhint-nats:4222",), user="kvhint", password=secret)

    # NATS: `-c` and the ConfigMap's nats.conf only on its command line (ps shows it),
    # the password from the Secret in its environment, in double quotes (nats.conf).
    nats = k8s_container("kvhint-nats")
    nats_env = k8s_env(nats, secrets)
    args = [k8s_expanded(arg, nats_env) for arg in nats.get("command", []) + nats["args"]]
    assert args == ["-c", "/etc/nats/nats.conf"]
    assert nats_env["NATS_PASSWORD_QUOTED"] == f'"{secret}"'
    (volume,) = [v for v in k8s_workload("kvhint-nats")["spec"]["template"]["spec"][
        "volumes"] if v.get("configMap", {}).get("name") == "kvhint-nats"]
    assert {"name": volume["name"], "mountPath": "/etc/nats", "readOnly": True} in nats[
        "volumeMounts"]
    assert "nats.conf" in k8s_config_map("kvhint-nats")["data"]
    client_script = k8s_config_map("kvhint-nats-client")["data"]["nats-url-env.sh"]
    assert client_script == (DEPLOY / "nats-url-env.sh").read_text()

    config = _k8s_router_as_shipped(tmp_path, monkeypatch, secrets)
    assert config.read_text() == k8s_config_map("kvhint-router")["data"]["router.yaml"]
    assert nats_connection(RouterSettings(config_file=config).nats_url) == expected

    worker = k8s_container("vllm-worker")
    env = k8s_env(worker, secrets, pod_name="vllm-worker-1") | {"MODEL": "m"}
    started = run_start([k8s_expanded(arg, env) for arg in worker["command"] + worker["args"]],
                        env, k8s_mounts("vllm-worker", tmp_path), ["vllm"], tmp_path)
    argv = started["argv"]
    assert argv[:2] == ["serve", "m"]
    (config_arg,) = [argv[i + 1] for i, arg in enumerate(argv)
                     if arg == "--kv-transfer-config"]
    transfer = json.loads(config_arg)
    extra = transfer["kv_connector_extra_config"]
    assert secret not in config_arg and "nats_url" not in extra and "nats://" not in config_arg
    assert extra["worker_id"] == "w1"
    url = started["env"][extra["nats_url_env"]]
    assert secret not in url
    monkeypatch.setenv(extra["nats_url_env"], url)
    assert load_plugin_config(extra).nats_connection == expected  # what the plugin uses
