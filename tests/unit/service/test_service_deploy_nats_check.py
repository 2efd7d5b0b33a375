"""NATS does not start with the public placeholder password (or an empty one).

Before, the router and the plugin refused a ``change-me...`` NATS password, but NATS itself
started with Kubernetes' shipped ``change-me-nats`` (and compose's NATS with any
placeholder an operator typed) and took clients with it. Now deploy/nats-check-password.sh
runs first (the StatefulSet's init container, from ConfigMap kvhint-nats-check; compose's
nats-password-check, which NATS depends on) and exits non-zero with a message naming what
to replace, never the password. Its prefix is the code's PLACEHOLDER_SECRET_PREFIX: the
script is run here with sh on both sides of it."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from deploy_manifests import DEPLOY, interpolated, k8s_config_map, k8s_container, k8s_env, \
    k8s_secrets, k8s_workload
from kvhint.schemas.nats_address import PLACEHOLDER_SECRET_PREFIX, is_placeholder_secret

SCRIPT = DEPLOY / "nats-check-password.sh"
# Every POSIX shell here: the images run busybox's sh, this machine dash or bash.
_SHELLS = [[path] if name != "busybox" else [path, "sh"] for name in ("sh", "dash", "busybox")
           if (path := shutil.which(name))] + ([[shutil.which("bash"), "--posix"]]
                                               if shutil.which("bash") else [])
_PINNED_BUSYBOX = re.compile(r"busybox:\d+\.\d+\.\d+")
_REAL = ["pw-from-env_1.x", "-1234", "true", "change-mx", "xchange-me", "0change-me"]
_REFUSED = [PLACEHOLDER_SECRET_PREFIX, f"{PLACEHOLDER_SECRET_PREFIX}-nats",
            f"{PLACEHOLDER_SECRET_PREFIX.upper()}-Secret_1", ""]


def _check(script: Path, env: dict[str, str], shell: list[str] | None = None
           ) -> subprocess.CompletedProcess[str]:
    """The check as a container runs it: ``sh <file>`` with the container's environment."""
    return subprocess.run([*(shell or ["sh"]), str(script)], env={"PATH": os.defpath} | env,
                          capture_output=True, text=True, timeout=30)


@pytest.mark.parametrize("shell", _SHELLS, ids=lambda shell: Path(shell[0]).name)
@pytest.mark.parametrize("password", _REFUSED + _REAL + [None])
def test_the_check_refuses_exactly_what_the_router_and_plugin_refuse(
        shell: list[str], password: str | None) -> None:
    env = {} if password is None else {"NATS_PASSWORD": password}
    done = _check(SCRIPT, env, shell)
    refused = not password or is_placeholder_secret(password)
    assert (done.returncode != 0) == refused, done.stderr
    if refused:
        assert "refusing to start NATS" in done.stderr
        assert ("placeholder" if password else "empty") in done.stderr
        assert "Secret kvhint-nats" in done.stderr and "KVHINT_NATS_PASSWORD" in done.stderr
    if password and len(password) > len(PLACEHOLDER_SECRET_PREFIX):
        assert password not in done.stdout + done.stderr  # never echoes the secret


def test_the_scripts_prefix_is_the_codes() -> None:
    (prefix,) = re.findall(r"^prefix=(\S+)$", SCRIPT.read_text(), re.M)
    assert prefix == PLACEHOLDER_SECRET_PREFIX


def test_kubernetes_nats_runs_the_check_before_it_starts(tmp_path: Path) -> None:
    """The StatefulSet's init container runs the same script, from a ConfigMap, with the
    password NATS gets from Secret kvhint-nats, never on its command line; the shipped
    Secret is refused, a replaced password starts."""
    pod = k8s_workload("kvhint-nats")["spec"]["template"]["spec"]
    (init,) = pod["initContainers"]
    assert _PINNED_BUSYBOX.fullmatch(init["image"]), init["image"]
    shell, path = init["command"]
    assert shell == "sh" and "args" not in init
    assert "NATS_PASSWORD" not in json.dumps(init["command"])  # ps would show it
    (mount,) = [m for m in init["volumeMounts"] if path.startswith(m["mountPath"] + "/")]
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    text = k8s_config_map(volume["configMap"]["name"])["data"][Path(path).name]
    assert text == SCRIPT.read_text()
    script = tmp_path / Path(path).name
    script.write_text(text)

    def ref(container: dict) -> dict:
        (variable,) = [v for v in container["env"] if v["name"] == "NATS_PASSWORD"]
        return variable["valueFrom"]["secretKeyRef"]
    assert ref(init) == ref(k8s_container("kvhint-nats"))

    secrets = k8s_secrets()
    refused = _check(script, k8s_env(init, secrets))  # the Secret as shipped
    assert refused.returncode != 0 and "placeholder" in refused.stderr
    secrets["kvhint-nats"]["password"] = "pw-from-secret_2.y"
    assert _check(script, k8s_env(init, secrets)).returncode == 0


@pytest.mark.parametrize("password", [f"{PLACEHOLDER_SECRET_PREFIX}-nats", "pw-from-env_1.x"])
def test_compose_nats_waits_for_the_check(password: str, tmp_path: Path) -> None:
    """compose's NATS depends on nats-password-check completing successfully; the check
    gets KVHINT_NATS_PASSWORD, mounts the script and reaches no network."""
    env = {"KVHINT_ADMIN_KEY": "adm", "KVHINT_NATS_PASSWORD": password}
    services = yaml.safe_load(interpolated((DEPLOY / "compose.yaml").read_text(), env))[
        "services"]
    (name,) = services["nats"]["depends_on"]
    assert services["nats"]["depends_on"][name] == {
        "condition": "service_completed_successfully"}
    check = services[name]
    assert _PINNED_BUSYBOX.fullmatch(check["image"]), check["image"]
    assert check["network_mode"] == "none" and "ports" not in check
    shell, path = check["command"]
    assert shell == "sh"
    (volume,) = check["volumes"]
    source, target, mode = volume.split(":")
    assert (target, mode) == (path, "ro") and DEPLOY / source == SCRIPT
    done = _check(SCRIPT, check["environment"])
    assert (done.returncode == 0) == (not is_placeholder_secret(password)), done.stderr
