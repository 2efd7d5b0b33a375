"""Reading deploy/'s compose file and Kubernetes manifests as compose and the kubelet do:
compose's ``${VAR...}`` interpolation, and the environment, Secrets and ConfigMaps a
Kubernetes container gets. Shared by the deploy tests."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

DEPLOY = Path(__file__).resolve().parents[3] / "deploy"


def interpolated(text: str, env: dict[str, str]) -> str:
    """``text`` with compose's ``${VAR}``, ``${VAR:-default}`` and ``${VAR:?error}`` filled
    from ``env`` (a ``:-`` default where ``env`` lacks the variable)."""
    def value(match: re.Match[str]) -> str:
        name, form, rest = match.group(1), match.group(2), match.group(3)
        if env.get(name):
            return env[name]
        assert form == ":-", f"compose needs {name} set"
        return rest
    return re.sub(r"\$\{([A-Z_]+)(?:(:[-?])([^}]*))?\}", value, text)


# --- Kubernetes: the environment a container gets, as the kubelet builds it -----------

K8S_REFERENCE = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def k8s_expanded(text: str, env: dict[str, str]) -> str:
    """``text`` with Kubernetes' ``$(VAR)`` references filled from ``env`` (one it lacks
    is left as written; ``$$`` is a ``$``), as in env values, command and args."""
    def value(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        return env.get(match.group(1), match.group(0))
    return K8S_REFERENCE.sub(value, text)


def k8s_docs() -> list[dict]:
    return [doc for path in sorted((DEPLOY / "kubernetes").glob("*.yaml"))
            for doc in yaml.safe_load_all(path.read_text()) if doc]


def k8s_secrets() -> dict[str, dict[str, str]]:
    """Every shipped Secret's values, by the Secret's name."""
    return {doc["metadata"]["name"]: dict(doc["stringData"])
            for doc in k8s_docs() if doc["kind"] == "Secret"}


def k8s_workload(name: str) -> dict:
    return next(doc for doc in k8s_docs() if doc["kind"] in (
        "Deployment", "StatefulSet") and doc["metadata"]["name"] == name)


def k8s_container(workload: str) -> dict:
    (container,) = k8s_workload(workload)["spec"]["template"]["spec"]["containers"]
    return container


def k8s_config_map(name: str) -> dict:
    return next(doc for doc in k8s_docs()
                if doc["kind"] == "ConfigMap" and doc["metadata"]["name"] == name)


def k8s_env(container: dict, secrets: dict[str, dict[str, str]],
            pod_name: str = "pod-0") -> dict[str, str]:
    """The container's environment: values from Secrets (``secretKeyRef``: a missing
    Secret or key fails, as the pod would not start), the pod's name (``fieldRef``), and
    plain values with ``$(VAR)`` of the variables listed before them."""
    env: dict[str, str] = {}
    for variable in container.get("env", []):
        source = variable.get("valueFrom", {})
        if "secretKeyRef" in source:
            ref = source["secretKeyRef"]
            env[variable["name"]] = secrets[ref["name"]][ref["key"]]
        elif "fieldRef" in source:
            assert source["fieldRef"]["fieldPath"] == "metadata.name", variable
            env[variable["name"]] = pod_name
        else:
            env[variable["name"]] = k8s_expanded(variable["value"], env)
    return env
