"""The worker API key in deploy/: the vLLM workers require one (``VLLM_API_KEY``, which
vLLM reads when no ``--api-key`` is given) and the router sends the same one
(``worker_api_key``), from one Kubernetes Secret or one compose variable; the key is never
on a command line (``ps`` shows those); a placeholder key is refused by the router; the
docs say so. Before, the deploy files started the workers with no key at all: any pod
the NetworkPolicy admitted (Prometheus's) could call inference past the router's checks.
(tests/integration/service/test_service_deploy_worker_auth.py serves vLLM's real app
with the key so given, and the router's real client against it.)"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from deploy_manifests import DEPLOY, compose_mounts, interpolated, k8s_container, k8s_docs, \
    k8s_env, k8s_expanded, k8s_mounts, k8s_secrets, run_start
from kvhint.router.service.settings import RouterSettings
from kvhint.schemas.nats_address import PLACEHOLDER_SECRET_PREFIX, is_placeholder_secret

SECRET = "kvhint-worker-api-key"
# Characters a shell or Kubernetes' $(VAR) would expand, were the key ever on a command.
K8S_KEY = "wk-0p3r/at+r=$x$(HOME)"
COMPOSE_KEY = "wk-c0mpose_1.x/+="


def _operators(secrets: dict[str, dict[str, str]]) -> dict[str, dict[str, str]]:
    """The shipped Secrets with every placeholder replaced, as an operator does."""
    return {name: {key: value.replace(PLACEHOLDER_SECRET_PREFIX, "op-secret")
                   for key, value in data.items()} for name, data in secrets.items()}


def _secret_ref(container: dict, variable: str) -> dict:
    (entry,) = [e for e in container.get("env", []) if e["name"] == variable]
    assert "value" not in entry, entry  # from a Secret, not written in the manifest
    return entry["valueFrom"]["secretKeyRef"]


def _k8s_started(workload: str, program: str, secrets: dict[str, dict[str, str]],
                 tmp_path: Path, env_extra: dict[str, str] | None = None) -> dict:
    """The workload's container started as the kubelet starts it (its environment from
    ``secrets``, ``$(VAR)`` filled, its ConfigMap files mounted), its start script run
    for real and ``program`` a stand-in: what that program got."""
    container = k8s_container(workload)
    env = k8s_env(container, secrets, pod_name=f"{workload}-0") | (env_extra or {})
    argv = [k8s_expanded(arg, env) for arg in container["command"] + container["args"]]
    return run_start(argv, env, k8s_mounts(workload, tmp_path), [program], tmp_path)


def _router_settings(started: dict, monkeypatch: pytest.MonkeyPatch,
                     config: Path | None = None) -> RouterSettings:
    """The settings the started router reads: its environment's KVHINT_ROUTER_* over its
    --config file (``config``: that file here, when the start names a container path)."""
    for name, value in started["env"].items():
        if name.startswith("KVHINT_ROUTER_"):
            monkeypatch.setenv(name, value)
    argv = started["argv"]
    return RouterSettings(config_file=config or Path(argv[argv.index("--config") + 1]))


# --- Kubernetes ----------------------------------------------------------------------

def test_kubernetes_gives_the_workers_and_the_router_one_key_from_one_secret(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    worker_ref = _secret_ref(k8s_container("vllm-worker"), "VLLM_API_KEY")
    router_ref = _secret_ref(k8s_container("kvhint-router"), "KVHINT_ROUTER_WORKER_API_KEY")
    assert worker_ref == router_ref == {"name": SECRET, "key": "api-key"}
    shipped = k8s_secrets()[SECRET]["api-key"]
    assert is_placeholder_secret(shipped)
    manifests = "".join(p.read_text() for p in (DEPLOY / "kubernetes").glob("*.yaml"))
    assert manifests.count(shipped) == 1  # the Secret's, nowhere else
    for doc in k8s_docs():  # no command puts it there ($(VAR) or sh's $VAR)
        pod = doc["spec"]["template"]["spec"] if doc["kind"] in (
            "Deployment", "StatefulSet") else {}
        for container in pod.get("containers", []) + pod.get("initContainers", []):
            command = json.dumps(container.get("command", []) + container.get("args", []))
            assert "--api-key" not in command and "API_KEY" not in command, container

    secrets = _operators(k8s_secrets())
    secrets[SECRET]["api-key"] = K8S_KEY
    worker = _k8s_started("vllm-worker", "vllm", secrets, tmp_path, {"MODEL": "m"})
    assert worker["argv"][:2] == ["serve", "m"]
    assert worker["env"]["VLLM_API_KEY"] == K8S_KEY  # vLLM's own variable, as given
    assert not any("api-key" in arg or "api_key" in arg for arg in worker["argv"])
    assert K8S_KEY not in json.dumps(worker["argv"])

    router = _k8s_started("kvhint-router", "kvhint", secrets, tmp_path)
    assert K8S_KEY not in json.dumps(router["argv"])
    settings = _router_settings(router, monkeypatch)  # starts: no placeholder left
    assert settings.worker_api_key is not None
    assert settings.worker_api_key.get_secret_value() == K8S_KEY
    assert all(w.api_key is None for w in settings.workers)  # none overrides it


def test_kubernetes_router_refuses_the_shipped_worker_key(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every other Secret replaced, the worker key left as shipped: the router refuses to
    start, naming worker_api_key, never its value."""
    secrets = _operators(k8s_secrets())
    secrets[SECRET] = k8s_secrets()[SECRET]
    router = _k8s_started("kvhint-router", "kvhint", secrets, tmp_path)
    with pytest.raises(ValidationError) as refused:
        _router_settings(router, monkeypatch)
    message = str(refused.value)
    assert "worker_api_key" in message and "admin_keys" not in message
    assert secrets[SECRET]["api-key"] not in message


# --- compose -------------------------------------------------------------------------

def _compose(key: str) -> dict[str, dict]:
    env = {"KVHINT_ADMIN_KEY": "adm", "KVHINT_NATS_PASSWORD": "pw",
           "KVHINT_WORKER_API_KEY": key}
    return yaml.safe_load(interpolated((DEPLOY / "compose.yaml").read_text(), env))[
        "services"]


def _compose_router(services: dict[str, dict], tmp_path: Path,
                    monkeypatch: pytest.MonkeyPatch) -> RouterSettings:
    """compose's router started (nats-url-env.sh run, the server a stand-in), with the
    tenant key an operator gives in place of router.yaml's placeholder."""
    router = services["router"]
    started = run_start([*router["entrypoint"], *router["command"]], router["environment"],
                        compose_mounts(router), ["kvhint"], tmp_path)
    monkeypatch.setenv("KVHINT_ROUTER_TENANTS", '[{"name": "team-a", "api_keys": ["t-a"]}]')
    return _router_settings(started, monkeypatch, config=DEPLOY / "router.yaml")


def test_compose_gives_the_workers_and_the_router_one_key_from_one_variable(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    text = (DEPLOY / "compose.yaml").read_text()
    uses = re.findall(r"\$\{KVHINT_WORKER_API_KEY[^}]*\}", text)
    assert uses and all(use.startswith("${KVHINT_WORKER_API_KEY:?") for use in uses)
    assert text.count("KVHINT_WORKER_API_KEY}") == 0 and "$KVHINT_WORKER_API_KEY" not in text
    with pytest.raises(AssertionError, match="needs KVHINT_WORKER_API_KEY"):
        interpolated(text, {"KVHINT_ADMIN_KEY": "adm", "KVHINT_NATS_PASSWORD": "pw"})
    # Shipped empty: a copied example brings no public key.
    assert re.search(r"^KVHINT_WORKER_API_KEY=$", (DEPLOY / ".env.example").read_text(), re.M)

    services = _compose(COMPOSE_KEY)
    workers = {name: s for name, s in services.items() if name.startswith("worker-")}
    assert set(workers) == {"worker-0", "worker-1"}
    for name, service in services.items():  # on no service's command line
        command = json.dumps([*(service.get("entrypoint") or []),
                              *(service.get("command") or [])])
        assert COMPOSE_KEY not in command and "--api-key" not in command, name
    for name, worker in workers.items():
        assert worker["environment"]["VLLM_API_KEY"] == COMPOSE_KEY, name
        started = run_start([*worker["entrypoint"], *worker["command"]],
                            worker["environment"], compose_mounts(worker), ["python3"],
                            tmp_path)
        assert started["argv"][:2] == ["-m", "vllm.entrypoints.openai.api_server"], name
        assert started["env"]["VLLM_API_KEY"] == COMPOSE_KEY, name
    settings = _compose_router(services, tmp_path, monkeypatch)
    assert settings.worker_api_key is not None
    assert settings.worker_api_key.get_secret_value() == COMPOSE_KEY


def test_compose_router_refuses_a_placeholder_worker_key(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    placeholder = f"{PLACEHOLDER_SECRET_PREFIX}-worker-key"  # router.yaml's example
    with pytest.raises(ValidationError) as refused:
        _compose_router(_compose(placeholder), tmp_path, monkeypatch)
    message = str(refused.value)
    assert "worker_api_key" in message and placeholder not in message


def test_the_settings_check_refuses_a_placeholder_worker_key() -> None:
    """The router's own check (RouterSettings), for the fleet's key and a worker's own."""
    assert RouterSettings(worker_api_key="a-real-key").worker_api_key is not None
    with pytest.raises(ValidationError, match=r"worker_api_key: still the deploy files'"):
        RouterSettings(worker_api_key="Change-Me-worker")
    with pytest.raises(ValidationError, match=r"workers\[w0\]\.api_key"):
        RouterSettings(workers=[{"id": "w0", "url": "http://w0:8000",
                                 "api_key": "change-me-w0"}])


# --- the docs ------------------------------------------------------------------------

def test_the_readmes_say_the_workers_require_the_key() -> None:
    deploy_readme = (DEPLOY / "README.md").read_text()
    readme = (DEPLOY.parent / "README.md").read_text()
    for text in (deploy_readme, readme):
        for name in (SECRET, "KVHINT_WORKER_API_KEY", "VLLM_API_KEY"):
            assert name in text, name
    # The caveat stays: vLLM 0.32's key guards /v1, /v2, /inference and /cohere only.
    for path in ("/invocations", "/tokenize", "/metrics"):
        assert path in deploy_readme, path
